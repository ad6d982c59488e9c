"""GPTQ (Frantar et al., 2023, arXiv:2210.17323), jit-compiled end to end with lax loops.

GPTQ quantizes the input features of a layer one at a time and spreads each rounding error over
the features not yet quantized, using the inverse Hessian of the layer's squared output error
``E(W) = ||X W - X Q||^2`` (with ``H = 2 X^T X``, Eq. (1)-(2)):

    q_i = quant(w_i)                                  w_i: row i of W[K, N] (input feature i)
    e_i = (w_i - q_i) / [H_F^-1]_ii                   (Eq. 3, OBQ update)
    W_F <- W_F - [H_F^-1]_{F,i} e_i                   F: features not yet quantized

Algorithm 1 of the paper makes this fast and stable:
  * the needed rows of ``H_F^-1`` for every step are the rows of the upper Cholesky factor
    ``U`` of ``H^-1 = U^T U`` (Sec. 3, "Cholesky reformulation"), scaled by ``U_ii``:
    ``e_i = (w_i - q_i) / U_ii``, ``W_{>i} -= U_{i,>i}^T e_i``;
  * the updates are applied lazily: inside a block of ``block_size`` features only the block is
    updated; the rest of W receives one matrix product ``W -= U_{B,:}^T E_B`` per block (Sec. 3,
    "Lazy batch-updates");
  * dampening ``H + lambda * mean(diag H) * I`` (``damp`` = lambda, 1% by default).

Here the block is further split into sub-blocks of 16 features whose column loop is unrolled on
GPU (a ``lax.scan`` with ``unroll=True``) so the sequential part compiles to few, fused kernels; the
sub-blocks and blocks are rolled lax loops. Everything runs in float32 (float64 if the inputs are
float64 and x64 is enabled).

Extensions, as in the reference implementation (IST-DASLab ``gptq.py``):
  * dead features (``H_ii == 0``, never active): ``H_ii := 1`` and the weight row set to 0;
  * ``act_order``: features processed by descending ``H_ii``;
  * groups: scale / zero of a group are chosen on the error-updated weights when its first
    feature is reached (dynamic), or on the original weights (``static_groups``);
  * a Hessian that is not positive definite even after dampening (Cholesky returns NaN in jnp):
    the dampening is multiplied by 10 until it succeeds; the value used is returned.

Example:
  >>> h = quant.calibration.hessian_from_batches([x])          # x: [T, K] layer inputs
  >>> res = quant.gptq(w, h, bits=4, group_size=128)
  >>> y_hat = x @ quant.dequantize(res.qweight)
"""
from __future__ import annotations

import functools
import logging
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from quant import formats, gptq_kernel
from quant.rtn import _check_weight, quant_params, quantize_codes

log = logging.getLogger(__name__)

_SUB = 16                 # features per unrolled sub-block
_MAX_DAMP_RETRIES = 12    # damp * 10**12 at most; beyond that U = I (plain rounding)
_HI = jax.lax.Precision.HIGHEST


class GPTQResult(NamedTuple):
  """Result of ``gptq``.

  qweight: the quantized weight.
  losses: ``sum_n (w_kn - q_kn)^2 / (2 [H^-1]_kk)`` per input feature k (original order): the
    increase of the layer's output error caused by quantizing feature k (Eq. 3 of the paper).
  damp: the relative dampening actually used (``damp`` or a larger power-of-ten multiple when
    the Hessian was not positive definite); ``inf`` if even the largest failed.
  """
  qweight: formats.QuantizedWeight
  losses: Float[Array, "K"]
  damp: Float[Array, ""]


def gptq(w: Float[Array, "K N"], hessian: Float[Array, "K K"], *, bits: int = 4,
         group_size: int | None = 128, sym: bool = False, act_order: bool = False,
         static_groups: bool = False, block_size: int = 128, damp: float = 0.01,
         implementation: str | None = None) -> GPTQResult:
  """Quantizes ``w[K_in, N_out]`` with GPTQ given the Hessian ``H = 2/n sum x x^T [K, K]``.

  Args:
    w: float weight, Flax orientation (``y = x @ w``).
    hessian: float Hessian of the layer inputs, e.g. from ``quant.calibration``.
    bits: code width, 2..8.
    group_size: input features per scale / zero; -1 or None for one per output column.
    sym: symmetric quantization (zero point fixed at ``2**(bits-1)``).
    act_order: process features by descending Hessian diagonal (stores ``perm``).
    static_groups: choose group parameters on the original weights before any update.
    block_size: lazy-batch block length.
    damp: relative dampening lambda (fraction of the mean Hessian diagonal).
    implementation: how a block's column loop runs: "xla" (unrolled lax loops), "triton" (one
      Pallas kernel per block, ``gptq_kernel.py``; interpret mode without a GPU) or None: the
      kernel on a GPU where it applies (dynamic groups starting on block boundaries, float32),
      falling back to "xla" if it fails to compile.

  Returns:
    ``GPTQResult(qweight, losses, damp)``.

  Raises:
    ValueError: bad shapes, ``K % group_size != 0``, non-finite ``w`` or ``hessian`` (checked
      when the inputs are concrete).
  """
  w = _check_weight(w)
  k, n = w.shape
  hessian = jnp.asarray(hessian)
  if hessian.shape != (k, k):
    raise ValueError(f"hessian must have shape {(k, k)} for w of shape {w.shape}, got {hessian.shape}")
  if not jnp.issubdtype(hessian.dtype, jnp.floating):
    raise TypeError(f"hessian must be floating point, got {hessian.dtype}")
  gs = formats.canonical_group_size(group_size, k)
  formats.check_k(k, gs, bits)
  if not isinstance(block_size, int) or block_size <= 0:
    raise ValueError(f"block_size must be a positive int, got {block_size!r}")
  if not (isinstance(damp, (int, float)) and 0 <= damp and math.isfinite(damp)):
    raise ValueError(f"damp must be a finite float >= 0, got {damp!r}")
  for name, x in (("w", w), ("hessian", hessian)):
    if not isinstance(x, jax.core.Tracer) and not bool(jnp.isfinite(x).all()):
      raise ValueError(f"{name} contains NaN or inf (bad calibration data?)")
  if implementation not in (None, "xla", "triton"):
    raise ValueError(f"implementation must be 'xla', 'triton' or None, got {implementation!r}")
  bs, sub = _block_sizes(k, gs, block_size)
  kernel_ok = (not static_groups and gs >= bs and gptq_kernel.supported(bs, n)
               and jnp.promote_types(w.dtype, hessian.dtype) != jnp.float64)
  if implementation == "triton" and not kernel_ok:
    raise NotImplementedError("the triton GPTQ kernel needs dynamic groups that start on block "
                              "boundaries, a power-of-two block of 16..128 and float32")
  on_gpu = jax.default_backend() == "gpu"
  use_kernel = implementation == "triton" or (implementation is None and on_gpu and kernel_ok)
  call = functools.partial(
      _gptq, w, hessian, bits=bits, group_size=gs, sym=bool(sym), act_order=bool(act_order),
      static_groups=bool(static_groups), block_size=bs, sub=sub, damp=float(damp),
      unroll=_unroll(), interpret=not on_gpu)
  try:
    out = call(kernel=use_kernel)
  except Exception as e:  # pylint: disable=broad-except
    if implementation is not None or not use_kernel:
      raise
    log.warning("GPTQ triton kernel failed (%s: %s); using the XLA loop", type(e).__name__, e)
    out = call(kernel=False)
  codes, scales, zeros, perm, losses, used = out
  keep_perm = bool(act_order) and not static_groups and gs < k
  qw = formats.QuantizedWeight.from_codes(codes, scales, None if sym else zeros, bits=bits,
                                          group_size=gs, perm=perm if keep_perm else None)
  return GPTQResult(qw, losses, used)


def _unroll() -> bool:
  """Unroll the sub-block column loop on accelerators (few fused kernels, no per-column loop
  overhead); on CPU a rolled loop compiles several times faster and runs about as fast."""
  return jax.default_backend() != "cpu"


def _block_sizes(k: int, gs: int, block_size: int) -> tuple[int, int]:
  """Block length compatible with the groups (group starts fall on block or sub-block starts)."""
  bs = min(block_size, k)
  if gs < k:
    if gs <= bs:
      bs = (bs // gs) * gs
    else:
      bs = max(d for d in range(1, bs + 1) if gs % d == 0)
  grouped = gs if gs < bs else bs
  sub = math.gcd(_SUB, bs, grouped)
  return bs, sub


def _damped_cholesky(h, damp):
  """Upper ``U`` with ``(H + lambda mean(diag H) I)^-1 = U^T U``; raises lambda x10 on NaN."""
  k = h.shape[0]
  eye = jnp.eye(k, dtype=h.dtype)
  mean_diag = jnp.mean(jnp.diag(h))

  def attempt(frac):
    hd = h + (frac * mean_diag) * eye
    low = jnp.linalg.cholesky(hd)
    hinv = jax.scipy.linalg.cho_solve((low, True), eye)
    u = jnp.linalg.cholesky(hinv).T          # cholesky(H^-1, upper=True) of the reference
    return u, jnp.isfinite(u).all()

  def cond(state):
    tries, _, _, ok = state
    return jnp.logical_and(~ok, tries < _MAX_DAMP_RETRIES)

  def body(state):
    tries, frac, _, _ = state
    frac = jnp.where(frac > 0, frac * 10, jnp.asarray(1e-6, h.dtype))
    u, ok = attempt(frac)
    return tries + 1, frac, u, ok

  frac0 = jnp.asarray(damp, h.dtype)
  u, ok = attempt(frac0)
  _, frac, u, ok = jax.lax.while_loop(cond, body, (0, frac0, u, ok))
  # Last resort: no error feedback (plain rounding), reported as damp = inf.
  u = jnp.where(ok, u, eye)
  return u, jnp.where(ok, frac, jnp.inf)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "sym", "act_order",
                                             "static_groups", "block_size", "sub", "damp", "unroll",
                                             "kernel", "interpret"))
def _gptq(w, h, *, bits, group_size, sym, act_order, static_groups, block_size, sub, damp, unroll,
          kernel, interpret):
  dt = jnp.promote_types(jnp.promote_types(w.dtype, h.dtype), jnp.float32)
  k, n = w.shape
  gs, bs = group_size, block_size
  w = w.astype(dt)
  h = h.astype(dt)
  h = (h + h.T) / 2

  # Dead features (never active): H_kk := 1, w_k := 0 (reference implementation).
  dead = jnp.diag(h) <= 0
  h = jnp.where(dead[:, None] | dead[None, :], 0, h) + jnp.diag(dead.astype(dt))
  w = jnp.where(dead[:, None], 0, w)

  if static_groups:   # parameters of every group from the original weights
    st_scale, st_zero = quant_params(w.reshape(k // gs, gs, n), bits=bits, sym=sym)
  if act_order:
    perm = jnp.argsort(-jnp.diag(h), stable=True).astype(jnp.int32)
    w, h = w[perm], h[perm][:, perm]
  else:
    perm = jnp.arange(k, dtype=jnp.int32)

  u, used_damp = _damped_cholesky(h, damp)

  # Pad K to a multiple of the block: zero weights, identity inverse-Hessian rows.
  kp = -(-k // bs) * bs
  pad = kp - k
  w = jnp.pad(w, ((0, pad), (0, 0)))
  u = jnp.pad(u, ((0, pad), (0, pad))) + jnp.diag(jnp.arange(kp) >= k).astype(dt)
  row_group = jnp.pad(perm // gs, (0, pad))           # original group of each stored row

  def group_params(rows):            # rows [gs, N] -> (scale, zero) [N]
    return quant_params(rows, bits=bits, sym=sym)

  def sub_block(ws, us, sc, zr):
    """Sequential GPTQ over ``sub`` rows; returns codes, scaled errors, losses (Eq. 3)."""
    def step(ws, xs):
      j, u_row, s, z = xs
      wj = ws[j]
      q = quantize_codes(wj, s, z, bits=bits)
      diff = wj - (q - z) * s
      e = diff / u_row[j]
      ws = ws - u_row[:, None] * e[None, :]     # u_row[i] = 0 for i < j (U is upper triangular)
      return ws, (q, e)
    # Only elementwise work inside the unrolled steps, so XLA can fuse them; the per-feature
    # losses (w - q)^2 / (2 d^2) = e^2 / 2 reduce afterwards in one go.
    _, (q, e) = jax.lax.scan(step, ws, (jnp.arange(ws.shape[0]), us, sc, zr), unroll=unroll)
    return q, e, 0.5 * jnp.sum(e * e, axis=1)

  def block(b, carry):
    w, codes, losses, scales, zeros, cur = carry
    i1 = b * bs
    w1 = jax.lax.dynamic_slice(w, (i1, 0), (bs, n))
    u_rows = jax.lax.dynamic_slice(u, (i1, 0), (bs, kp))          # U[B, :]
    u1 = jax.lax.dynamic_slice(u_rows, (0, i1), (bs, bs))          # U[B, B]
    if not static_groups and gs >= bs:   # a group starts at this block: weights are up to date
      new = group_params(jax.lax.dynamic_slice(w, (i1, 0), (gs, n)))
      starts = i1 % gs == 0
      cur = jax.tree.map(lambda a, c: jnp.where(starts, a, c), new, cur)
      scales, zeros = _record(scales, zeros, cur, i1 // gs, starts)

    def sub_loop(s, carry):
      w1, e1, codes, losses, scales, zeros, cur = carry
      j0 = s * sub
      r0 = i1 + j0
      if static_groups:
        g = jax.lax.dynamic_slice(row_group, (r0,), (sub,))
        sc, zr = st_scale[g], st_zero[g]
      else:
        if gs < bs:      # a group starts inside the block: use the in-block, updated weights
          new = group_params(jax.lax.dynamic_slice(w1, (j0, 0), (gs, n)))
          starts = r0 % gs == 0
          cur = jax.tree.map(lambda a, c: jnp.where(starts, a, c), new, cur)
          scales, zeros = _record(scales, zeros, cur, r0 // gs, starts)
        sc = jnp.broadcast_to(cur[0], (sub, n))
        zr = jnp.broadcast_to(cur[1], (sub, n))
      ws = jax.lax.dynamic_slice(w1, (j0, 0), (sub, n))
      us = jax.lax.dynamic_slice(u1, (j0, j0), (sub, sub))
      q, e, loss = sub_block(ws, us, sc, zr)
      codes = jax.lax.dynamic_update_slice(codes, q.astype(jnp.int32), (r0, 0))
      losses = jax.lax.dynamic_update_slice(losses, loss, (r0,))
      e1 = jax.lax.dynamic_update_slice(e1, e, (j0, 0))
      # Lazy update of the rest of the block: W1 -= U[S, B]^T E_S.
      us_rows = jax.lax.dynamic_slice(u1, (j0, 0), (sub, bs))
      w1 = w1 - jnp.einsum("sb,sn->bn", us_rows, e, precision=_HI)
      return w1, e1, codes, losses, scales, zeros, cur

    if kernel:           # the whole block in one Pallas kernel
      q, e1 = gptq_kernel.gptq_block(w1, u1, cur[0], cur[1], bits=bits, interpret=interpret)
      codes = jax.lax.dynamic_update_slice(codes, q.astype(jnp.int32), (i1, 0))
      losses = jax.lax.dynamic_update_slice(losses, 0.5 * jnp.sum(e1 * e1, axis=1), (i1,))
    else:
      e1 = jnp.zeros((bs, n), dt)
      w1, e1, codes, losses, scales, zeros, cur = jax.lax.fori_loop(
          0, bs // sub, sub_loop, (w1, e1, codes, losses, scales, zeros, cur))
    # Lazy batch update of everything after the block (Algorithm 1): W -= U[B, :]^T E_B.
    w = w - jnp.einsum("bk,bn->kn", u_rows, e1, precision=_HI)
    return w, codes, losses, scales, zeros, cur

  g = k // gs
  init = (w, jnp.zeros((kp, n), jnp.int32), jnp.zeros((kp,), dt), jnp.zeros((g, n), dt),
          jnp.zeros((g, n), dt), (jnp.ones((n,), dt), jnp.zeros((n,), dt)))
  _, codes, losses, scales, zeros, _ = jax.lax.fori_loop(0, kp // bs, block, init)
  codes, losses = codes[:k], losses[:k]
  if static_groups:
    scales, zeros = st_scale, st_zero

  # Back to a canonical storage order.
  orig_codes = jnp.zeros_like(codes).at[perm].set(codes)
  orig_losses = jnp.zeros_like(losses).at[perm].set(losses)
  if act_order and not static_groups and gs < k:
    # Groups follow the processing order: store rows grouped, sorted within each group.
    g_idx = jnp.zeros((k,), jnp.int32).at[perm].set(jnp.arange(k, dtype=jnp.int32) // gs)
    store = jnp.argsort(g_idx, stable=True).astype(jnp.int32)
    stored_codes = orig_codes[store]
  else:
    store = jnp.arange(k, dtype=jnp.int32)
    stored_codes = orig_codes
  return (stored_codes, scales, zeros.astype(jnp.int32), store,
          orig_losses, used_damp)


def _record(scales, zeros, cur, gi, starts):
  """Writes the current group's parameters at row ``gi`` when a group starts."""
  g = scales.shape[0]
  gi = jnp.minimum(gi, g - 1)
  old = (jax.lax.dynamic_slice(scales, (gi, 0), (1, scales.shape[1]))[0],
         jax.lax.dynamic_slice(zeros, (gi, 0), (1, zeros.shape[1]))[0])
  s = jnp.where(starts, cur[0].astype(scales.dtype), old[0])
  z = jnp.where(starts, cur[1].astype(zeros.dtype), old[1])
  return (jax.lax.dynamic_update_slice(scales, s[None], (gi, 0)),
          jax.lax.dynamic_update_slice(zeros, z[None], (gi, 0)))


def quantize_error(w: Float[Array, "K N"], w_hat: Float[Array, "K N"],
                   hessian: Float[Array, "K K"]) -> Float[Array, ""]:
  """Proxy output error ``tr((W - W_hat)^T H (W - W_hat))`` = ``2/n ||X (W - W_hat)||^2``."""
  d = (w - w_hat).astype(jnp.float32)
  return jnp.sum(d * jnp.matmul(hessian.astype(jnp.float32), d, precision=_HI))


"""AWQ: activation-aware weight quantization (Lin et al., 2024, arXiv:2306.00978).

Salient input channels (large average activation) lose less to rounding if their weights are
scaled up before quantization and their inputs scaled down by the same factor (Sec. 3.2):

    y = x W = (x diag(s)^-1) (diag(s) W)  ~  (x / s) Q(diag(s) W)

The per-input-channel scale is searched on a grid (Eq. 5):

    s = s_x^alpha                      (or s_x^alpha / s_w^(1-alpha) with ``duo_scaling``)
    alpha* = argmin_{alpha in {0, 1/n_grid, ..., (n_grid-1)/n_grid}} || X W - (X / s) Q(s W) ||^2

where ``s_x`` is the mean |x| per channel and ``s_w`` the mean normalised |w| per channel. The
output error is computed exactly from the calibration Hessian ``H = 2/n X^T X`` instead of stored
activations: ``||X D||^2 = n/2 tr(D^T H D)``. A clipping search then shrinks, per group and output
channel, the quantization range by a factor ``c in {1, 1 - 1/n_clip, ..., 1 - max_shrink}``
minimising the group's own output error ``d^T H_gg d`` (llm-awq's ``auto_clip``).

The caller folds ``1/s`` into the operation that produces ``x`` (the preceding norm's scale or
linear layer's output columns) so the model computes the same function before quantization;
``quant.nnx.quantize_model`` does that, or multiplies the inputs explicitly where nothing can be
folded.

Example:
  >>> stats = quant.calibration.from_batches([x])
  >>> res = quant.awq(w, quant.calibration.hessian(stats), quant.calibration.mean_abs(stats))
  >>> y_hat = (x / res.scale) @ quant.dequantize(res.qweight)
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from quant import formats
from quant.rtn import _check_weight, quant_params, quantize_codes

_HI = jax.lax.Precision.HIGHEST


class AWQResult(NamedTuple):
  """Result of ``awq``.

  qweight: quantization of ``diag(scale) @ w``; feed it ``x / scale``.
  scale: per-input-channel scale ``s`` [K] (fold ``1/s`` into the previous operation).
  alpha: the chosen exponent.
  clip: per (group, output channel) range factor [G, N] (1 = no clipping).
  error: proxy output error ``tr(D^T H D)`` of the final weight, ``D = W - W_hat``.
  """
  qweight: formats.QuantizedWeight
  scale: Float[Array, "K"]
  alpha: Float[Array, ""]
  clip: Float[Array, "G N"]
  error: Float[Array, ""]


def awq(w: Float[Array, "K N"], hessian: Float[Array, "K K"], act_scale: Float[Array, "K"], *,
        bits: int = 4, group_size: int | None = 128, sym: bool = False, n_grid: int = 20,
        duo_scaling: bool = False, clip: bool = True, n_clip: int = 20,
        max_shrink: float = 0.5) -> AWQResult:
  """AWQ scale search (+ clipping search) for ``w[K_in, N_out]``.

  Args:
    w: float weight (Flax orientation). Several layers sharing one input are searched jointly by
      concatenating their weights along N.
    hessian: ``2/n X^T X`` of the layer inputs [K, K].
    act_scale: mean |x| per input channel [K] (``calibration.mean_abs``).
    bits, group_size, sym: the quantization format.
    n_grid: number of alphas tried in [0, 1).
    duo_scaling: also divide by the weight magnitude ``s_w^(1-alpha)``.
    clip: run the clipping search; ``n_clip`` grid points, shrinking by at most ``max_shrink``.
  """
  w = _check_weight(w)
  k, n = w.shape
  hessian, act_scale = jnp.asarray(hessian), jnp.asarray(act_scale)
  if hessian.shape != (k, k):
    raise ValueError(f"hessian must have shape {(k, k)}, got {hessian.shape}")
  if act_scale.shape != (k,):
    raise ValueError(f"act_scale must have shape {(k,)}, got {act_scale.shape}")
  gs = formats.canonical_group_size(group_size, k)
  formats.check_k(k, gs, bits)
  if not isinstance(n_grid, int) or n_grid < 1:
    raise ValueError(f"n_grid must be a positive int, got {n_grid!r}")
  if not isinstance(n_clip, int) or n_clip < 1:
    raise ValueError(f"n_clip must be a positive int, got {n_clip!r}")
  if not 0 <= max_shrink < 1:
    raise ValueError(f"max_shrink must be in [0, 1), got {max_shrink!r}")
  for name, x in (("w", w), ("hessian", hessian), ("act_scale", act_scale)):
    if not isinstance(x, jax.core.Tracer) and not bool(jnp.isfinite(x).all()):
      raise ValueError(f"{name} contains NaN or inf (bad calibration data?)")
  codes, scales, zeros, s, alpha, clip_f, err = _awq(
      w, hessian, act_scale, bits=bits, group_size=gs, sym=bool(sym), n_grid=n_grid,
      duo_scaling=bool(duo_scaling), clip=bool(clip), n_clip=n_clip, max_shrink=float(max_shrink))
  qw = formats.QuantizedWeight.from_codes(codes, scales, None if sym else zeros, bits=bits,
                                          group_size=gs)
  return AWQResult(qw, s, alpha, clip_f, err)


def _fake(w, *, bits, gs, sym, clip=1.0):
  """Quantize-dequantize w [K, N] with groups along K; ``clip`` broadcastable to [G, N]."""
  k, n = w.shape
  x = w.reshape(k // gs, gs, n)
  scale, zero = quant_params(x, bits=bits, sym=sym, clip=clip)
  q = quantize_codes(x, scale[:, None], zero[:, None], bits=bits)
  return ((q - zero[:, None]) * scale[:, None]).reshape(k, n), q, scale, zero


def _error(d, h):
  return jnp.sum(d * jnp.matmul(h, d, precision=_HI))


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "sym", "n_grid", "duo_scaling",
                                             "clip", "n_clip", "max_shrink"))
def _awq(w, h, act_scale, *, bits, group_size, sym, n_grid, duo_scaling, clip, n_clip, max_shrink):
  w = w.astype(jnp.float32)
  h = h.astype(jnp.float32)
  k, n = w.shape
  gs = group_size
  sx = jnp.maximum(act_scale.astype(jnp.float32), 1e-4)
  # s_w: per-channel mean of |w| normalised by its group's max (llm-awq get_weight_scale).
  wa = jnp.abs(w).reshape(k // gs, gs, n)
  sw = (wa / jnp.maximum(wa.max(axis=1, keepdims=True), 1e-8)).reshape(k, n).mean(axis=1)
  sw = jnp.maximum(sw, 1e-4)

  def scale_for(alpha):
    s = sx ** alpha / (sw ** (1 - alpha) if duo_scaling else 1.0)
    s = jnp.maximum(s, 1e-4)
    return s / jnp.sqrt(s.max() * s.min())           # keep the scales centred around 1

  def candidate_error(alpha):                       # Eq. 5 on the Hessian
    s = scale_for(alpha)
    w_hat = _fake(w * s[:, None], bits=bits, gs=gs, sym=sym)[0] / s[:, None]
    return _error(w - w_hat, h)

  alphas = jnp.arange(n_grid, dtype=jnp.float32) / n_grid
  errs = jax.lax.map(candidate_error, alphas)
  alpha = alphas[jnp.argmin(errs)]
  s = scale_for(alpha)
  ws = w * s[:, None]
  hs = h / s[:, None] / s[None, :]                  # Hessian of the inputs x / s

  if clip:
    # Group-local output error of each (group, column) for each shrink factor.
    g_ = jnp.arange(k // gs)
    hg = hs.reshape(k // gs, gs, k // gs, gs)[g_, :, g_, :]          # diagonal blocks [G, gs, gs]
    wg = ws.reshape(k // gs, gs, n)
    n_steps = max(1, int(max_shrink * n_clip))
    factors = 1.0 - jnp.arange(n_steps, dtype=jnp.float32) / n_clip

    def clip_error(c):
      w_hat = _fake(ws, bits=bits, gs=gs, sym=sym, clip=c)[0].reshape(k // gs, gs, n)
      d = wg - w_hat
      return jnp.einsum("gin,gij,gjn->gn", d, hg, d, precision=_HI)

    cerr = jax.lax.map(clip_error, factors)          # [steps, G, N]
    clip_f = factors[jnp.argmin(cerr, axis=0)]
  else:
    clip_f = jnp.ones((k // gs, n), jnp.float32)

  w_hat, q, scale, zero = _fake(ws, bits=bits, gs=gs, sym=sym, clip=clip_f)
  err = _error(w - w_hat / s[:, None], h)
  return (q.reshape(k, n).astype(jnp.int32), scale, zero.astype(jnp.int32), s, alpha, clip_f, err)

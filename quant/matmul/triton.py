"""Fused W4A16 matmul on the Pallas Triton backend: ``y = x @ dequantize(qw) (+ bias)``.

The kernel reads our packed layout as is (``qweight`` int32 ``[K/8, N]``, word ``j`` holding rows
``8j .. 8j+7`` in nibbles 0..7, see ``quant/formats.py``); expanded weights never touch HBM.

Maths. For a group ``g`` of rows with scale ``s_g`` and zero ``z_g`` (per column n)::

    y[m, n] = sum_g s_g[n] * sum_{k in g} x[m, k] * (q[k, n] - z_g[n])
            = sum_g s_g[n] * ( x_g @ (B + q_g) - (B + z_g[n]) * sum_{k in g} x[m, k] )

where ``B + q`` is formed without any integer-to-float conversion: OR-ing a 4-bit code into the
mantissa of the 16-bit pattern of ``B`` (bf16 0x4300 = 128, f16 0x6400 = 1024) gives exactly
``B + q``. So per weight element the kernel does a shift, an AND/OR and a bitcast; the dot
``x_g @ (B + q_g)`` multiplies exact small integers by x and accumulates in float32, and the scale
and zero are applied once per group on the ``[block_m, block_n]`` accumulator. Nothing is rounded
to 16 bits except the final output (the reference ``x @ dequantize(qw)`` in float32 is matched to
float32 accumulation error).

Unpacking (``Config.unpack``): "interleave" stacks the eight nibbles of each word as a
``[d/8, 8, bn]`` tensor and reshapes it to ``[d, bn]`` (rows in natural order, one dot per group
of ``d`` rows); "strided" does eight dots per group, nibble ``i`` of the ``d/8`` words against x's
columns ``i, i+8, ...``, which the wrapper has stored contiguously (a cheap transpose of x), so no
reshape is needed in the kernel (``d >= 128``); it also decodes two codes per 32-bit op
(``(w >> 4i) & 0x000F000F | B·0x10001`` holds nibbles ``i`` and ``i + 4`` in its two halves).

Tiling: program ``(i, j, s)`` owns rows ``[i*bm, (i+1)*bm)`` of x, columns ``[j*bn, (j+1)*bn)`` and
the ``s``-th of ``split_k`` contiguous slices of K. With ``split_k > 1`` it writes a float32
partial sum ``[split_k, M, N]`` that XLA adds up afterwards (deterministic; no atomics). M, N
and a per-channel K tail are handled with masked loads and stores, so M = 1 costs no padding
traffic. Act-order weights are served by gathering x's columns into the stored row order
(``x[..., perm]``); the kernel never sees ``g_idx``. Differentiable in x and bias (custom VJP:
``dx = dy @ W^T`` through XLA); the quantized weight gets no gradient.

Example:
  >>> qw = quant.rtn(w, bits=4, group_size=128)        # w: [K, N]
  >>> y = int4_matmul(x, qw, bias=None, config=None, interpret=False)
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from quant import formats
from quant.matmul import layout
from quant.matmul.config import Config, default_config, fit_config

# 16-bit pattern B with B + q exact for q < 16, by activation dtype.
_MAGIC = {jnp.dtype(jnp.bfloat16): (0x4300, 128.0), jnp.dtype(jnp.float16): (0x6400, 1024.0)}


@dataclasses.dataclass(frozen=True)
class Statics:
  """Everything static about one call (hashable)."""
  m: int                 # rows of x
  n: int                 # output features
  ks: int                # rows of K per split
  group_size: int        # true group length (K when per-channel)
  seg: int               # rows sharing one scale inside a split: group_size, or ks per-channel
  block_m: int
  block_n: int
  block_k: int
  bits: int
  sym: bool
  has_bias: bool
  split: bool            # write float32 partials [split_k, M, N]
  magic_bits: int
  magic: float
  strided: bool          # eight nibble dots (x columns pre-ordered) instead of one reshape

  @property
  def mask_m(self) -> bool:
    return self.m % self.block_m != 0

  @property
  def mask_n(self) -> bool:
    return self.n % self.block_n != 0

  @property
  def mask_k(self) -> bool:
    return self.seg >= self.block_k and self.seg % self.block_k != 0


def unpack_magic(words: jax.Array, *, dtype, magic_bits: int) -> jax.Array:
  """int32 words ``[r, bn]`` -> ``B + q`` in ``dtype``, rows in natural order ``[8r, bn]``.

  Row ``8j + i`` comes from nibble ``i`` of word ``j``: ``((w >> 4i) & 0xF) | B``, truncated to
  16 bits and bitcast to ``dtype``.
  """
  r, bn = words.shape
  shifts = lax.broadcasted_iota(jnp.int32, (1, 8, 1), 1) * 4
  codes = lax.shift_right_logical(words[:, None, :], shifts) & 0xF          # [r, 8, bn]
  pattern = (codes | magic_bits).astype(jnp.int16)
  return lax.bitcast_convert_type(pattern, dtype).reshape(8 * r, bn)


def _load(ref, mask):
  if mask is None:
    return ref[...]
  return plgpu.load(ref, mask=mask, other=0)


def _and(a, b):
  if a is None:
    return b
  if b is None:
    return a
  return a & b


def w4a16_kernel(x_ref, w_ref, s_ref, z_ref, b_ref, o_ref, *, st: Statics):
  """One program: output tile ``[bm, bn]`` from one K slice (refs are this program's blocks).

  x_ref [bm, ks] (activation dtype), w_ref int32 [ks/8, bn], s_ref [G, bn], z_ref [G, bn] (int32
  or uint8) or None, b_ref [bn] or None, o_ref [bm, bn] (x dtype, or float32 partials when split).
  """
  bm, bn, bk = st.block_m, st.block_n, st.block_k
  rows = pl.program_id(0) * bm + lax.broadcasted_iota(jnp.int32, (bm,), 0)
  cols = pl.program_id(1) * bn + lax.broadcasted_iota(jnp.int32, (bn,), 0)
  row_ok = rows < st.m if st.mask_m else None
  col_ok = cols < st.n if st.mask_n else None
  k_start = pl.program_id(2) * st.ks          # global row of this split's first row
  dtype = x_ref.dtype

  def x_mask(k_idx):
    """Mask of an x tile whose columns are local rows ``k_idx`` [c] of K (None: all valid)."""
    k_ok = k_idx < st.ks if st.mask_k else None
    if row_ok is None and k_ok is None:
      return None
    mask = _and(None if row_ok is None else row_ok[:, None],
                None if k_ok is None else k_ok[None, :])
    return jnp.broadcast_to(mask, (bm, k_idx.shape[0]))

  def dot_rows(r, d):
    """Raw dot of rows [r, r + d) (local, r % d == 0) and the row sums of x over them."""
    w_ok = None
    if st.mask_k:
      w_ok = ((r // 8 + lax.broadcasted_iota(jnp.int32, (d // 8,), 0)) < st.ks // 8)[:, None]
    w_mask = _and(w_ok, None if col_ok is None else col_ok[None, :])
    if w_mask is not None:
      w_mask = jnp.broadcast_to(w_mask, (d // 8, bn))
    words = _load(w_ref.at[pl.ds(r // 8, d // 8), :], w_mask)
    if not st.strided:
      k_idx = r + lax.broadcasted_iota(jnp.int32, (d,), 0)
      xt = _load(x_ref.at[:, pl.ds(r, d)], x_mask(k_idx))
      vals = unpack_magic(words, dtype=dtype, magic_bits=st.magic_bits)
      return plgpu.dot(xt, vals), jnp.sum(xt.astype(jnp.float32), axis=1)
    # Nibble i of the d/8 words holds rows r + i + 8j, j < d/8. The wrapper stored those x
    # columns contiguously at r + i*d/8 + j (and zero-padded any K tail), so no K mask is needed.
    raw = jnp.zeros((bm, bn), jnp.float32)
    xsum = jnp.zeros((bm,), jnp.float32)
    rows_mask = None if row_ok is None else jnp.broadcast_to(row_ok[:, None], (bm, d // 8))
    pair_magic = st.magic_bits | (st.magic_bits << 16)
    for i in range(4):
      # Two codes per 32-bit op: nibbles i and i + 4 land in the low and high 16-bit halves.
      pair = (lax.shift_right_logical(words, jnp.int32(4 * i)) & 0x000F000F) | pair_magic
      halves = (pair.astype(jnp.int16), lax.shift_right_logical(pair, 16).astype(jnp.int16))
      for nibble, half in ((i, halves[0]), (i + 4, halves[1])):
        xt = _load(x_ref.at[:, pl.ds(r + nibble * (d // 8), d // 8)], rows_mask)
        raw = raw + plgpu.dot(xt, lax.bitcast_convert_type(half, dtype))
        xsum = xsum + jnp.sum(xt.astype(jnp.float32), axis=1)
    return raw, xsum

  def apply_scale(acc, raw, xsum, r):
    gi = (k_start + r) // st.group_size
    s = _load(s_ref.at[gi, :], col_ok).astype(jnp.float32)
    if st.sym:
      corr = xsum[:, None] * (st.magic + 2.0 ** (st.bits - 1))
    else:
      z = _load(z_ref.at[gi, :], col_ok).astype(jnp.float32)
      corr = xsum[:, None] * (z + st.magic)[None, :]
    return acc + s[None, :] * (raw - corr)

  acc = jnp.zeros((bm, bn), jnp.float32)
  if st.seg >= bk:
    # One scale per segment of ``seg`` rows, covered by ``steps`` dots of block_k rows.
    steps = -(-st.seg // bk)

    def segment(t, acc):
      r0 = t * st.seg
      if steps == 1:
        raw, xsum = dot_rows(r0, bk)
      else:
        def step(i, carry):
          part, xs = dot_rows(r0 + i * bk, bk)
          return carry[0] + part, carry[1] + xs
        raw, xsum = lax.fori_loop(0, steps, step, (jnp.zeros((bm, bn), jnp.float32),
                                                   jnp.zeros((bm,), jnp.float32)))
      return apply_scale(acc, raw, xsum, r0)

    n_seg = st.ks // st.seg
    acc = segment(0, acc) if n_seg == 1 else lax.fori_loop(0, n_seg, segment, acc)
  else:
    # Several whole groups per step: one dot (and one scale) per group.
    per_step = bk // st.seg

    def step(i, acc):
      for j in range(per_step):
        r = i * bk + j * st.seg
        raw, xsum = dot_rows(r, st.seg)
        acc = apply_scale(acc, raw, xsum, r)
      return acc

    acc = lax.fori_loop(0, st.ks // bk, step, acc)

  if st.has_bias:
    acc = acc + _load(b_ref, col_ok).astype(jnp.float32)[None, :]
  out_mask = None
  if row_ok is not None or col_ok is not None:
    out_mask = jnp.broadcast_to(_and(None if row_ok is None else row_ok[:, None],
                                     None if col_ok is None else col_ok[None, :]), (bm, bn))
  out = acc.astype(o_ref.dtype)
  if out_mask is None:
    o_ref[...] = out
  else:
    plgpu.store(o_ref, out, mask=out_mask)


def strided_columns(x: jax.Array, *, rows_per_dot: int) -> jax.Array:
  """x's columns in the order of the "strided" unpack: in each span of ``d = rows_per_dot``
  columns, column ``i*d/8 + j`` holds row ``8j + i`` (the row of nibble ``i`` of word ``j``).
  K is zero-padded to a multiple of ``d`` (zero activations make padded codes harmless)."""
  m, k = x.shape
  d = rows_per_dot
  kp = -(-k // d) * d
  if kp != k:
    x = jnp.pad(x, ((0, 0), (0, kp - k)))
  return x.reshape(m, kp // d, d // 8, 8).swapaxes(2, 3).reshape(m, kp)


def check_supported(x, qw: formats.QuantizedWeight) -> None:
  """Raises NotImplementedError for valid calls this backend does not serve."""
  if x.dtype not in _MAGIC:
    raise NotImplementedError(f"triton int4_matmul takes bfloat16 or float16 x, got {x.dtype}")
  if qw.bits > 4:
    raise NotImplementedError(f"triton int4_matmul supports bits <= 4, got {qw.bits}")
  k = qw.shape[0]
  if qw.group_size < k and qw.group_size % 16:
    raise NotImplementedError(f"triton int4_matmul needs group_size % 16 == 0 (one dot per "
                              f"group), got {qw.group_size}")


def _check_direct_call(x, pw: layout.PackedWeight, bias) -> None:
  layout.check_packed(pw)
  k, n = pw.shape
  if not hasattr(x, "ndim") or x.ndim < 1 or x.shape[-1] != k:
    raise ValueError(f"x must be [..., K={k}], got shape {getattr(x, 'shape', type(x))}")
  if bias is not None and getattr(bias, "shape", None) != (n,):
    raise ValueError(f"bias must have shape {(n,)}, got {getattr(bias, 'shape', type(bias))}")


def resolve_config(config, *, m: int, k: int, n: int, group_size: int) -> Config:
  """The Config for a call: the heuristic for None, else ``config`` fitted to the shape."""
  if config is None:
    return default_config(m=m, k=k, n=n, group_size=group_size)
  if not isinstance(config, Config):
    raise NotImplementedError(f"config of type {type(config).__name__} is not a "
                              f"quant.matmul.config.Config")
  return fit_config(config, m=m, k=k, n=n, group_size=group_size)


def int4_matmul(x: Float[Array, "... K"], qw: formats.QuantizedWeight | layout.PackedWeight, *,
                bias: Float[Array, "N"] | None = None, config: Config | None = None,
                interpret: bool = False) -> Float[Array, "... N"]:
  """Triton backend of ``quant.int4_matmul``: ``x @ dequantize(qw) (+ bias)`` in x's dtype.

  ``qw`` is a ``QuantizedWeight`` (arguments then assumed checked by
  ``quant.matmul.api.check_inputs``) or a ``layout.PackedWeight`` from ``layout.prepare`` (uint8
  zero points, less traffic; checked here). Raises NotImplementedError for float32 x, bits > 4,
  groups that are not a multiple of 16 rows, or a ``config`` that cannot tile the shape.

  Example:
    >>> y = int4_matmul(x, qw, config=Config(block_n=64, split_k=2), interpret=True)
    >>> y = int4_matmul(x, layout.prepare(qw), config=None, interpret=False)
  """
  if isinstance(qw, layout.PackedWeight):
    _check_direct_call(x, qw, bias)
  k, n = qw.shape
  formats.check_k(k, qw.group_size, qw.bits)          # ValueError: K % group, K % 8
  check_supported(x, qw)
  lead = x.shape[:-1]
  x2 = x.reshape(-1, k)
  m = x2.shape[0]
  if m == 0:
    return jnp.zeros((*lead, n), x.dtype)
  cfg = resolve_config(config, m=m, k=k, n=n, group_size=qw.group_size)
  if qw.perm is not None:
    x2 = jnp.take(x2, qw.perm, axis=1)        # stored row i is input feature perm[i]
  y = _fused(x2, qw.qweight, qw.scales, qw.zeros, bias, _Static(cfg, qw.bits, qw.group_size,
                                                                  bool(interpret)))
  return y.reshape(*lead, n)


@dataclasses.dataclass(frozen=True)
class _Static:
  cfg: Config
  bits: int
  group_size: int
  interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused(x, qweight, scales, zeros, bias, static: _Static):
  return _call(x, qweight, scales, zeros, bias, cfg=static.cfg, bits=static.bits,
               group_size=static.group_size, interpret=static.interpret)


def _fused_fwd(x, qweight, scales, zeros, bias, static: _Static):
  return _fused(x, qweight, scales, zeros, bias, static), (qweight, scales, zeros, bias)


def _fused_bwd(static: _Static, res, dy):
  """dx = dy @ W^T with W dequantized by XLA (the weight itself gets no gradient)."""
  qweight, scales, zeros, bias = res
  k, n = qweight.shape[0] * 8, qweight.shape[1]
  g = static.group_size
  codes = formats.unpack(qweight, bits=static.bits).astype(jnp.float32).reshape(k // g, g, n)
  z = (jnp.float32(2 ** (static.bits - 1)) if zeros is None
       else zeros.astype(jnp.float32)[:, None, :])
  w = ((codes - z) * scales.astype(jnp.float32)[:, None, :]).reshape(k, n)
  dx = jnp.matmul(dy.astype(jnp.float32), w.T).astype(dy.dtype)
  dbias = None if bias is None else jnp.sum(dy.astype(jnp.float32), axis=0).astype(bias.dtype)
  return dx, None, None, None, dbias


_fused.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.jit, static_argnames=("cfg", "bits", "group_size", "interpret"))
def _call(x, qweight, scales, zeros, bias, *, cfg: Config, bits: int, group_size: int,
          interpret: bool):
  m, k = x.shape
  n = qweight.shape[1]
  ks = k // cfg.split_k
  bits_pattern, magic = _MAGIC[jnp.dtype(x.dtype)]
  st = Statics(m=m, n=n, ks=ks, group_size=group_size, seg=min(group_size, ks),
               block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k, bits=bits,
               sym=zeros is None, has_bias=bias is not None and cfg.split_k == 1,
               split=cfg.split_k > 1, magic_bits=bits_pattern, magic=magic,
               strided=cfg.unpack == "strided")
  bm, bn = cfg.block_m, cfg.block_n
  if st.strided:
    x = strided_columns(x, rows_per_dot=min(cfg.block_k, st.seg))
  grid = (pl.cdiv(m, bm), pl.cdiv(n, bn), cfg.split_k)
  g = scales.shape[0]
  col = lambda i, j, s: (0, j)
  in_specs = [
      pl.BlockSpec((bm, x.shape[1] // cfg.split_k), lambda i, j, s: (i, s)),
      pl.BlockSpec((ks // 8, bn), lambda i, j, s: (s, j)),
      pl.BlockSpec((g, bn), col),
      None if zeros is None else pl.BlockSpec((g, bn), col),
      None if not st.has_bias else pl.BlockSpec((bn,), lambda i, j, s: (j,)),
  ]
  if st.split:
    out_shape = jax.ShapeDtypeStruct((cfg.split_k, m, n), jnp.float32)
    out_spec = pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))
  else:
    out_shape = jax.ShapeDtypeStruct((m, n), x.dtype)
    out_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
  y = pl.pallas_call(
      functools.partial(w4a16_kernel, st=st),
      grid=grid,
      in_specs=in_specs,
      out_specs=out_spec,
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name="w4a16_matmul",
  )(x, qweight, scales, zeros, bias if st.has_bias else None)
  if st.split:
    y = jnp.sum(y, axis=0)
    if bias is not None:
      y = y + bias.astype(jnp.float32)
    y = y.astype(x.dtype)
  return y

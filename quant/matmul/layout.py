"""Kernel-ready weight for the W4A16 kernels, produced once at load time by ``prepare``.

The Triton kernel reads our packed codes as they are (``QuantizedWeight.qweight``), so the only
change is the zero points: ``QuantizedWeight.zeros`` is int32 (4 bytes per group and column, 6%
of the int4 bytes at group 128), which ``prepare`` narrows to uint8 (codes are < 16). At decode,
where the kernel streams every byte once, that is ~5% less traffic. Act-order stays a row
permutation (``perm``): the kernel gathers x's columns and never sees ``g_idx``. GPTQ / AWQ
checkpoints come in through ``quant.from_gptq`` / ``quant.from_awq`` first.

Example:
  >>> qw = quant.rtn(w, bits=4, group_size=128)
  >>> pw = prepare(qw)                                   # once, at load time
  >>> y = quant.matmul.triton.int4_matmul(x, pw, config=None, interpret=False)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt8

from quant import formats


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
  """A ``QuantizedWeight`` with uint8 zero points; same fields and static metadata otherwise."""
  qweight: Int[Array, "Kp N"]
  scales: Float[Array, "G N"]
  zeros: UInt8[Array, "G N"] | None
  perm: Int[Array, "K"] | None
  bits: int = dataclasses.field(metadata=dict(static=True), default=4)
  group_size: int = dataclasses.field(metadata=dict(static=True), default=128)
  sym: bool = dataclasses.field(metadata=dict(static=True), default=False)
  shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True), default=(0, 0))


def prepare(qw: formats.QuantizedWeight) -> PackedWeight:
  """``QuantizedWeight`` -> ``PackedWeight`` (zero points as uint8). Exact; jit-compatible.

  Raises TypeError / ValueError like ``formats.check_quantized`` for an inconsistent weight, and
  NotImplementedError for codes wider than 8 bits (none exist in our format).
  """
  formats.check_quantized(qw)
  zeros = None if qw.zeros is None else qw.zeros.astype(jnp.uint8)
  return PackedWeight(qweight=qw.qweight, scales=qw.scales, zeros=zeros, perm=qw.perm,
                      bits=qw.bits, group_size=qw.group_size, sym=qw.sym, shape=qw.shape)


def check_packed(pw: Any) -> None:
  """Raises TypeError / ValueError when ``pw`` is not a consistent PackedWeight."""
  if not isinstance(pw, PackedWeight):
    raise TypeError(f"expected a PackedWeight, got {type(pw).__name__}")
  k, n = pw.shape
  formats.check_k(k, pw.group_size, pw.bits)
  if pw.qweight.dtype != jnp.int32:
    raise TypeError(f"qweight must be int32 packed words, got {pw.qweight.dtype}")
  if pw.qweight.shape != (k // formats.per_word(pw.bits), n):
    raise ValueError(f"qweight shape {pw.qweight.shape} does not match shape {pw.shape}")
  if pw.scales.shape != (k // pw.group_size, n):
    raise ValueError(f"scales shape {pw.scales.shape} does not match groups "
                     f"{(k // pw.group_size, n)}")
  if pw.zeros is not None:
    if pw.zeros.dtype != jnp.uint8:
      raise TypeError(f"PackedWeight zeros must be uint8, got {pw.zeros.dtype}")
    if pw.zeros.shape != pw.scales.shape:
      raise ValueError(f"zeros shape {pw.zeros.shape} does not match scales {pw.scales.shape}")


# ----------------------------------------------------------------------------------------------
# Planar layout of the Mosaic GPU (Hopper wgmma) kernel
# ----------------------------------------------------------------------------------------------

PLANES = 4          # nibbles per int16 element: one "plane" of K columns each, per block
TILE_N = 64         # rows of N per warpgroup tile (wgmma's M side); N is padded to it
BLOCK_K = (64, 128, 256, 512)   # K rows per block (per kernel step) the layout is built for


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MosaicWeight:
  """4-bit weight in the planar, transposed layout read by ``quant.matmul.mosaic``.

  The kernel computes ``y^T = W^T x^T``, so the weight tile is wgmma's A operand: rows of N,
  K contiguous. K is cut into blocks of ``block_k`` rows; with ``span2 = block_k / 4``, int16
  element ``(n, b*span2 + c)`` of block ``b`` holds, in nibble ``p`` (bits ``4p .. 4p+3``), the
  code of stored row ``b*block_k + p*span2 + c``. Unpacking nibble ``p`` of a ``[64, span2]``
  tile therefore gives ``span2`` *contiguous* K columns (a whole wgmma operand) with shifts and
  masks only, no in-register interleave or transpose.

  Why 16-bit elements: wgmma's register A operand (bf16/f16) holds columns ``2u`` and ``2u+1`` of
  a row in one 32-bit register, and an int16 ``[64, span2]`` tile loaded in the same layout puts
  elements ``2u`` and ``2u+1`` in one 32-bit register too (low and high half). One 32-bit shift
  and one and/or then make both 16-bit operands of that register at once (see the kernel).

  Fields: ``qweight`` int16 ``[Np, Kp/4]`` (the same bytes as int4 codes); ``scales``
  ``[Gp, Np]`` (dtype of the source); ``zeros`` ``[Gp, Np]`` bfloat16 (small integers, exact) or
  None when symmetric; ``perm`` as in ``QuantizedWeight``. ``Np`` is N rounded up to 64 and
  ``Kp`` is K rounded up to whole blocks (and groups); padded codes are 0 and padded scales are 0
  (padded x columns are 0 as well). ``Gp`` is ``Kp / group_size``, or 1 per-channel. Static:
  ``bits``, ``group_size`` (K when per-channel), ``sym``, ``shape = (K, N)``, ``block_k``,
  ``tile_major``.

  ``tile_major``: the same elements stored tile by tile, so that each TMA box the kernel reads
  (64 features x one block, and the scale / zero rows of 64 features) is one contiguous run of
  memory: ``qweight [Np/64, Kp/block_k, 64, block_k/4]`` (16 KiB per box at block_k 512) and
  ``scales`` / ``zeros [Np/64, Gp, 64]``. Row-major, a box is 64 pieces of ``block_k/2`` bytes
  ``Kp/2`` bytes apart. ``to_row_major`` undoes it.
  """
  qweight: Int[Array, "..."]
  scales: Float[Array, "..."]
  zeros: Float[Array, "..."] | None
  perm: Int[Array, "K"] | None
  bits: int = dataclasses.field(metadata=dict(static=True), default=4)
  group_size: int = dataclasses.field(metadata=dict(static=True), default=128)
  sym: bool = dataclasses.field(metadata=dict(static=True), default=False)
  shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True), default=(0, 0))
  block_k: int = dataclasses.field(metadata=dict(static=True), default=512)
  tile_major: bool = dataclasses.field(metadata=dict(static=True), default=False)

  @property
  def per_channel(self) -> bool:
    return self.group_size >= self.shape[0]

  @property
  def padded_shape(self) -> tuple[int, int]:
    """``(Kp, Np)``."""
    return code_dims(self.qweight)[::-1]


def _round_up(a: int, b: int) -> int:
  return -(-a // b) * b


def mosaic_padded_k(k: int, group_size: int, block_k: int) -> int:
  """K rounded up to whole blocks of ``block_k`` rows and, when grouped, whole groups."""
  if group_size >= k:
    return _round_up(k, block_k)
  unit = max(block_k, group_size)          # one divides the other (checked by the config)
  return _round_up(k, unit)


def mosaic_tiles_groups(block_k: int, k: int, group_size: int) -> bool:
  """Whether planes of ``block_k / 4`` rows lie in one group each and blocks and groups nest."""
  span2 = block_k // PLANES
  if group_size >= k:
    return True
  return not (group_size % span2 or (group_size % block_k and block_k % group_size))


# Weights of at most this many elements take 256-row steps by default (see default_block_k).
SMALL_WEIGHT = 8192 * 8192
SPLIT_N = 2 * 132 * 64     # fewer outputs: < 2 warpgroup tiles per H200 SM, so K is split


def default_block_k(k: int, n: int, group_size: int) -> int:
  """The K step the planar layout is packed for (fixed at load time, so it cannot depend on M):
  the widest of 512 / 256 / 128 / 64 whose planes tile the groups, capped at 256 for weights of
  at most 8192 x 8192 and for weights with fewer than ``SPLIT_N`` outputs (the ones whose K the
  decode grid splits across the SMs). H200, g128: 256-row steps were 12-14% faster at 8192 x
  8192 for M = 1 and 16 (session 6), and, with the fused-lop3 dequant, 3% / 8% faster at M = 1 /
  16 on 28672 x 8192 (session 10, ``results/w4a16/2026-12-03_s10_stream_default.json``; session
  6, before the lop3, had them 1.5-3% slower at M = 1); at 8192 x 28672 (no K split, stream-K)
  512 stays 14% faster at M = 1."""
  bk = 256 if k * n <= SMALL_WEIGHT or n < SPLIT_N else BLOCK_K[-1]
  while bk > BLOCK_K[0] and not mosaic_tiles_groups(bk, k, group_size):
    bk //= 2
  return bk


def prepare_mosaic(qw: formats.QuantizedWeight, *, block_k: int | None = None,
                   tile_major: bool = False) -> MosaicWeight:
  """``QuantizedWeight`` -> ``MosaicWeight`` (planar, transposed, padded). Exact; jit-compatible.

  ``block_k`` (the kernel's K step, which the planes are laid out for): ``default_block_k``
  when None. ``tile_major``: store each TMA box contiguously (see ``MosaicWeight``).

  Raises NotImplementedError for codes wider than 4 bits (one nibble per code is assumed) or a
  ``block_k`` whose planes would straddle a group (``group_size % (block_k / 4)``, or neither of
  block_k and group_size dividing the other).

  Example:
    >>> mw = prepare_mosaic(quant.rtn(w, bits=4, group_size=128), block_k=512)
    >>> y = quant.matmul.mosaic.int4_matmul(x, mw, bias=None, config=None, interpret=False)
  """
  formats.check_quantized(qw)
  if qw.bits > 4:
    raise NotImplementedError(f"the Mosaic layout holds codes of <= 4 bits, got {qw.bits}")
  k, n = qw.shape
  gs = qw.group_size
  if block_k is None:
    block_k = default_block_k(k, n, gs)
  if block_k not in BLOCK_K:
    raise NotImplementedError(f"block_k must be one of {BLOCK_K}, got {block_k}")
  span2 = block_k // PLANES
  if not mosaic_tiles_groups(block_k, k, gs):
    raise NotImplementedError(f"block_k={block_k} cannot tile groups of {gs} rows (planes of "
                              f"{span2} rows must lie in one group)")
  kp, np_ = mosaic_padded_k(k, gs, block_k), _round_up(n, TILE_N)
  codes = qw.codes
  # A group whose scale is 0 dequantizes to 0 whatever its codes: store q = z there, so that
  # its (q - z) x is 0 as well (``MosaicConfig.scaled_acc`` keeps the unit of the last nonzero
  # scale and needs such a group to add nothing). Our quantizers never make a zero scale.
  # Per group ([G, gs, N] against [G, 1, N] rows), so that XLA fuses it into one elementwise
  # pass instead of materializing [K, N] gathers of the scales and zero points.
  groups = qw.scales.shape[0]
  if groups and groups * gs == k:
    dead = (qw.scales == 0)[:, None, :]
    zero = qw.zero_points.astype(codes.dtype)[:, None, :]
    codes = jnp.where(dead, zero, codes.reshape(groups, gs, n)).reshape(k, n)
  codes = jnp.pad(codes, ((0, kp - k), (0, np_ - n)))                    # [Kp, Np] stored order
  fields = codes.astype(jnp.uint16).reshape(kp // block_k, PLANES, span2, np_)
  fields = jnp.transpose(fields, (3, 0, 2, 1))                     # [Np, blocks, span2, planes]
  shifts = jnp.arange(PLANES, dtype=jnp.uint16) * 4
  packed = jnp.sum(fields << shifts, axis=-1, dtype=jnp.uint16)   # disjoint bits: sum == or
  elems = jax.lax.bitcast_convert_type(packed, jnp.int16).reshape(np_, kp // PLANES)
  gp = 1 if gs >= k else kp // gs
  pad_g = ((0, gp - qw.scales.shape[0]), (0, np_ - n))
  scales = jnp.pad(qw.scales, pad_g)
  zeros = None if qw.zeros is None else jnp.pad(qw.zeros, pad_g).astype(jnp.bfloat16)
  if tile_major:
    elems, scales = tile_codes(elems, span2), tile_rows(scales)
    zeros = None if zeros is None else tile_rows(zeros)
  return MosaicWeight(qweight=elems, scales=scales, zeros=zeros, perm=qw.perm, bits=qw.bits,
                      group_size=min(gs, k), sym=qw.sym, shape=(k, n), block_k=block_k,
                      tile_major=tile_major)


def tile_codes(codes: Int[Array, "Np Kp4"], span2: int) -> Int[Array, "T S 64 span2"]:
  """Row-major planar codes -> one contiguous ``[64, span2]`` block per (feature tile, step)."""
  np_, kp4 = codes.shape
  return codes.reshape(np_ // TILE_N, TILE_N, kp4 // span2, span2).transpose(0, 2, 1, 3)


def tile_rows(rows: Float[Array, "Gp Np"]) -> Float[Array, "T Gp 64"]:
  """Scale / zero rows ``[Gp, Np]`` -> ``[Np/64, Gp, 64]`` (a tile's groups contiguous)."""
  gp, np_ = rows.shape
  return rows.reshape(gp, np_ // TILE_N, TILE_N).transpose(1, 0, 2)


def untile_codes(codes: Int[Array, "T S 64 span2"]) -> Int[Array, "Np Kp4"]:
  """Inverse of ``tile_codes``; the identity on row-major (2-D) codes."""
  if codes.ndim == 2:
    return codes
  tiles, steps, rows, span2 = codes.shape
  return codes.transpose(0, 2, 1, 3).reshape(tiles * rows, steps * span2)


def untile_rows(rows: Float[Array, "T Gp 64"]) -> Float[Array, "Gp Np"]:
  """Inverse of ``tile_rows``; the identity on row-major (2-D) rows."""
  if rows.ndim == 2:
    return rows
  return rows.transpose(1, 0, 2).reshape(rows.shape[1], -1)


def code_dims(qweight: Int[Array, "..."]) -> tuple[int, int]:
  """``(Np, Kp)`` of planar codes in either storage (2-D row-major, 4-D tile-major)."""
  if qweight.ndim == 4:
    tiles, steps, rows, span2 = qweight.shape
    return tiles * rows, steps * span2 * PLANES
  return qweight.shape[0], qweight.shape[1] * PLANES


def to_row_major(mw: MosaicWeight) -> MosaicWeight:
  """A tile-major ``MosaicWeight`` in the row-major storage (the identity on a row-major one)."""
  if not mw.tile_major:
    return mw
  return dataclasses.replace(
      mw, qweight=untile_codes(mw.qweight), scales=untile_rows(mw.scales),
      zeros=None if mw.zeros is None else untile_rows(mw.zeros), tile_major=False)


def unpack_mosaic(qweight: Int[Array, "..."], block_k: int) -> Int[Array, "Np Kp"]:
  """Inverse of ``prepare_mosaic``'s packing: int16 ``[Np, Kp/4]`` (or its tile-major form)
  -> int32 codes ``[Np, Kp]`` (``W^T`` in stored row order, padding included)."""
  np_, kp = code_dims(qweight)
  u = jax.lax.bitcast_convert_type(untile_codes(qweight), jnp.uint16)
  shifts = jnp.arange(PLANES, dtype=jnp.uint16) * 4
  fields = (u[..., None] >> shifts) & jnp.uint16(0xF)                 # [Np, Kp/4, planes]
  fields = fields.reshape(np_, kp // block_k, block_k // PLANES, PLANES).transpose(0, 1, 3, 2)
  return fields.reshape(np_, kp).astype(jnp.int32)


def dense_transposed(qweight, scales, zeros, *, block_k: int, group_size: int,
                     bits: int) -> Float[Array, "Np Kp"]:
  """W^T in float32, ``[Np, Kp]`` in stored (padded, permuted) order, from a prepared weight's
  arrays in either storage: ``(q - z) * s`` per group (z = 2^(bits - 1) when symmetric). The
  Mosaic kernel's backward (dx = dy W^T) uses it; the kernel itself never builds it."""
  scales = untile_rows(scales)                    # [Gp, Np]
  zeros = None if zeros is None else untile_rows(zeros)
  kp = code_dims(qweight)[1]
  codes = unpack_mosaic(qweight, block_k).astype(jnp.float32)
  rows = jnp.arange(kp) // group_size if scales.shape[0] > 1 else jnp.zeros(kp, jnp.int32)
  z = (jnp.float32(2 ** (bits - 1)) if zeros is None else zeros.astype(jnp.float32).T[:, rows])
  return (codes - z) * scales.astype(jnp.float32).T[:, rows]


def to_quantized(mw: MosaicWeight) -> formats.QuantizedWeight:
  """Inverse of ``prepare_mosaic``: the same weight as a ``QuantizedWeight`` (exact; padding
  dropped; zero points back to int32). Lets the backends that read our packed format (Triton,
  XLA) serve a prepared weight where the Mosaic kernel declines (float32 x, not Hopper).
  Costs one XLA unpack / repack of the weight per call when used inside a jitted matmul.

  Example:
    >>> qw2 = to_quantized(prepare_mosaic(qw))   # qw2.codes == qw.codes, same scales / zeros
  """
  if not isinstance(mw, MosaicWeight):
    raise TypeError(f"expected a layout.MosaicWeight, got {type(mw).__name__}")
  mw = to_row_major(mw)
  k, n = mw.shape
  codes = unpack_mosaic(mw.qweight, mw.block_k)[:n, :k].T                # [K, N] stored order
  g = 1 if mw.per_channel else k // mw.group_size
  zeros = None if mw.zeros is None else mw.zeros[:g, :n].astype(jnp.int32)
  return formats.QuantizedWeight(
      qweight=formats.pack(codes, bits=mw.bits), scales=mw.scales[:g, :n], zeros=zeros,
      perm=mw.perm, bits=mw.bits, group_size=mw.group_size, sym=mw.sym, shape=(k, n))

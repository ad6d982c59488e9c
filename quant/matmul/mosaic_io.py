"""GMEM plumbing of the Mosaic GPU W4A16 kernels (``mosaic.py``, ``mosaic_stream.py``): where each
TMA box comes from in either weight storage, the kernels' input list, the x sums of
``MosaicConfig.late_zero``, and the shape checks of a prepared ``layout.MosaicWeight``.

Example:
  >>> codes, s_rows, z_rows = weight_boxes(qt_ref, s_ref, z_ref, feature0=n0, step=t, g0=g,
  ...                                      gps=4, span2=128)     # inside a kernel body
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from quant.matmul import layout

if TYPE_CHECKING:
  from quant.matmul.mosaic_common import Statics

PLANES = layout.PLANES
BN = layout.TILE_N


def weight_boxes(qt_ref, s_ref, z_ref, *, feature0, step, g0, gps: int, span2: int):
  """GMEM views of one warpgroup's TMA boxes at global step ``step``: the codes ``[64, span2]``
  and the scale / zero rows ``[gps, 64]`` (from group ``g0``) of features ``[feature0,
  feature0 + 64)``, in either storage of ``layout.MosaicWeight`` (tile-major: 4-D codes, each
  box one contiguous run of memory)."""
  if qt_ref.ndim == 4:
    tile, groups = feature0 // BN, pl.ds(g0, gps)
    return (qt_ref.at[tile, step], s_ref.at[tile, groups],
            None if z_ref is None else z_ref.at[tile, groups])
  rows, groups = pl.ds(feature0, BN), pl.ds(g0, gps)
  return (qt_ref.at[rows, pl.ds(step * span2, span2)], s_ref.at[groups, rows],
          None if z_ref is None else z_ref.at[groups, rows])


def scale_rows(s_ref) -> int:
  """``Gp``, the scale rows per feature (1 per-channel), of either storage."""
  return s_ref.shape[0] if s_ref.ndim == 2 else s_ref.shape[1]


def x_sums(xp, *, st: Statics):
  """x's column sums per piece of ``step_rows / groups_per_step`` rows (a group, or a step when
  a group spans several steps): float32 ``[Kp/piece, m_pad]`` from the padded ``[m_pad, Kp]``
  x (``Statics.late_zero``)."""
  piece = st.step_rows // st.groups_per_step
  m_pad, kp = xp.shape
  return jnp.sum(xp.astype(jnp.float32).reshape(m_pad, kp // piece, piece), axis=-1).T


def zero_offset(z_ring, xs_ring, slot, wg, g: int, st: Statics):
  """``(B + z_g) X_g`` as a float32 ``[64, m_pad]`` tile: what a wgmma over ``B + q`` adds on
  top of ``(q - z) x`` for group ``g`` of a ring slot (``Statics.late_zero``), with
  ``X_g[m] = sum_k x[m, k]`` over the group's rows of the step (``x_sums``). A rank-1 product
  of a per-feature row and a per-activation column: ~m_pad / 2 FMAs a thread per group, where
  the packed subtract it replaces is one bf16x2 op per two weights (block_k / 4 a thread)."""
  xs = plgpu.load(xs_ring.at[slot, g], (), layout=plgpu.Layout.WGMMA.reduce(0))
  xs = lax.broadcast_in_dim(xs, (BN, st.m_pad), [1])
  if st.sym:
    return jnp.float32(st.magic + st.zero) * xs
  z = plgpu.load(z_ring.at[slot, wg, g], (), layout=plgpu.Layout.WGMMA.reduce(1))
  return lax.broadcast_in_dim(z.astype(jnp.float32) + st.magic, (BN, st.m_pad), [0]) * xs


def xs_rows(st: Statics) -> int:
  """Rows of a ring slot of x sums: ``groups_per_step`` rounded up so that each slot is a
  multiple of 128 bytes, the alignment a TMA destination in SMEM needs (one [1, 8] float32 row
  is 32 bytes: unpadded, slot 1 was misaligned on the H200, CUDA_ERROR_MISALIGNED_ADDRESS)."""
  row_bytes = 4 * st.m_pad
  unit = 128 // math.gcd(128, row_bytes)
  return -(-st.groups_per_step // unit) * unit


def kernel_inputs(xt, qt, scales, zeros, xsum) -> tuple:
  """The kernels' GMEM inputs, leaving out the absent ones (zeros when symmetric, x sums unless
  ``late_zero``); ``split_refs`` names them again inside the kernel."""
  return tuple(a for a in (xt, qt, scales, zeros, xsum) if a is not None)


def split_refs(refs, st: Statics) -> tuple:
  """``(xt, qt, s, z, xs, o)`` refs of a kernel body from ``kernel_inputs`` + the output (None
  for the absent ones)."""
  refs = list(refs)
  xt_ref, qt_ref, s_ref = refs[:3]
  z_ref = None if st.sym else refs[3]
  xs_ref = refs[-2] if st.late_zero else None
  return xt_ref, qt_ref, s_ref, z_ref, xs_ref, refs[-1]


def check_prepared(x, mw: layout.MosaicWeight, bias) -> None:
  """Shape checks for a MosaicWeight (the public API only takes QuantizedWeight)."""
  k, n = mw.shape
  if mw.qweight.dtype != jnp.int16:
    raise TypeError(f"MosaicWeight qweight must be int16 (planar codes), got {mw.qweight.dtype}")
  kp = layout.mosaic_padded_k(k, mw.group_size, mw.block_k)
  np_ = -(-n // BN) * BN
  gp = 1 if mw.group_size >= k else kp // mw.group_size
  span2 = mw.block_k // PLANES
  if mw.tile_major:
    codes_shape = (np_ // BN, kp // mw.block_k, BN, span2)
    rows_shape = (np_ // BN, gp, BN)
  else:
    codes_shape, rows_shape = (np_, kp // PLANES), (gp, np_)
  if mw.qweight.shape != codes_shape:
    raise ValueError(f"MosaicWeight qweight shape {mw.qweight.shape} does not match shape "
                     f"{mw.shape} with block_k={mw.block_k} (expected {codes_shape})")
  if mw.scales.shape != rows_shape:
    raise ValueError(f"MosaicWeight scales shape {mw.scales.shape}, expected {rows_shape}")
  if mw.zeros is not None and mw.zeros.shape != rows_shape:
    raise ValueError(f"MosaicWeight zeros shape {mw.zeros.shape}, expected {rows_shape}")
  if not hasattr(x, "ndim") or x.ndim < 1 or x.shape[-1] != k:
    raise ValueError(f"x must be [..., K={k}], got shape {getattr(x, 'shape', type(x))}")
  if bias is not None and getattr(bias, "shape", None) != (n,):
    raise ValueError(f"bias must have shape {(n,)}, got {getattr(bias, 'shape', type(bias))}")


def check_supported(x, qw) -> None:
  """Raises NotImplementedError for valid calls the Mosaic kernel does not serve
  (shape-independent): x other than bf16 / f16 (wgmma operands), codes of more than 4 bits."""
  if x.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise NotImplementedError(f"mosaic int4_matmul takes bfloat16 or float16 x (wgmma operands), "
                              f"got {x.dtype}")
  if qw.bits > 4:
    raise NotImplementedError(f"mosaic int4_matmul supports bits <= 4, got {qw.bits}")


def on_hopper() -> bool:
  """Whether the first device is an sm90 GPU (H100 / H200)."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return False
  return dev.platform == "gpu" and getattr(dev, "compute_capability", "") == "9.0"

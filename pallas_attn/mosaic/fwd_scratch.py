"""Shared-memory buffers and barriers of the forward kernel (``kernels.fwd_kernel``), and the
bytes they take: the order of ``scratch_types``' entries is the order ``kernels._body``
unpacks them in."""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.mosaic import schedule
from pallas_attn.mosaic.operands import pv_swizzle
from pallas_attn.mosaic.ring import META_LEN

if TYPE_CHECKING:
  from pallas_attn.mosaic.kernels import Statics

O_CHUNK = 64             # columns of one O store slot (``Statics.o_chunked``): one swizzle row


def _tiled(row_elems: int, itemsize: int):
  """TMA / wgmma transforms of a tile whose rows hold ``row_elems`` elements: the widest
  swizzle (128 / 64 / 32 bytes) whose row of elements divides them."""
  sw = pv_swizzle(row_elems, itemsize)
  return plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw)


def scratch_types(*, st: Statics, head_dim: int, dtype, has_meta: bool, out_dtype=None):
  """Shared-memory buffers and barriers of ``fwd_kernel`` (order matters: see ``_body``).
  ``dtype``: of Q, K, V (and P); ``out_dtype`` (default ``dtype``): of O."""
  itemsize = jnp.dtype(dtype).itemsize
  out_dtype = dtype if out_dtype is None else out_dtype
  tiled = _tiled(head_dim, itemsize)                  # rows of H elements: Q, K
  out_tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))   # 16-bit O
  bq, bkv, stages, nc = st.block_q, st.block_kv, st.num_stages, st.consumers
  # V (the B operand of P V) and, in interpret mode, P (its A operand) share one swizzle. FP8
  # keeps V^T: rows of block_kv keys, like P's.
  pv_tiled = _tiled(bkv, itemsize)
  v_slot = (head_dim, bkv) if st.fp8 else (bkv, head_dim)
  queue = schedule.scratch_types(consumers=nc) if st.dynamic else (None, None, None)
  smem = (
      plgpu.SMEM((nc, bq, head_dim), dtype, transforms=tiled),                # Q (and O)
      # O of its own: persistent (Q's buffer holds the next tile's Q) or FP8 (Q's is 8-bit).
      (None if not (st.persistent or st.fp8) else
       plgpu.SMEM((nc, 2, bq, O_CHUNK), out_dtype, transforms=out_tiled) if st.o_chunked else
       plgpu.SMEM((nc, bq, head_dim), out_dtype, transforms=out_tiled)),
      plgpu.SMEM((stages, bkv, head_dim), dtype, transforms=tiled),           # K ring
      plgpu.SMEM((st.v_ring, *v_slot), dtype, transforms=pv_tiled),           # V ring
      plgpu.SMEM((nc, bq), jnp.float32),                                      # lse
      plgpu.SMEM((META_LEN,), jnp.int32) if has_meta else None,
      plgpu.SMEM((nc, bq), jnp.int32) if st.has_segments else None,           # q segment ids
      plgpu.SMEM((stages, bkv), jnp.int32) if st.has_segments else None,      # kv segment ring
      None if st.registers_pv else plgpu.SMEM((nc, bq, bkv), dtype, transforms=pv_tiled),
      queue[0],                                                               # next tiles
      plgpu.SMEM((nc, bq), jnp.float32) if st.fp8 else None,                  # q scales
      plgpu.SMEM((stages, bkv), jnp.float32) if st.fp8 else None,             # k scale ring
      plgpu.SMEM((nc, head_dim), jnp.float32) if st.fp8 else None,            # v scales
  )
  bars = (
      plgpu.Barrier(num_arrivals=2 if st.fp8 else 1, num_barriers=stages),  # k_ready (+ scales)
      plgpu.Barrier(num_barriers=st.v_ring),                              # v_ready
      plgpu.Barrier(num_barriers=stages),                                 # seg_ready
      plgpu.Barrier(num_barriers=(4 if st.fp8 else 2) * nc),    # q_ready (+ seg, q / v scales)
      plgpu.Barrier(num_barriers=1),                                      # meta_ready
      plgpu.Barrier(num_arrivals=nc, num_barriers=stages),                # k_free
      plgpu.Barrier(num_arrivals=nc, num_barriers=st.v_ring),             # v_free
      plgpu.Barrier(num_arrivals=nc),                                     # turns
      *queue[1:],                                                         # tile ready / free
  )
  return smem, bars


def smem_bytes(*, st: Statics, head_dim: int, itemsize: int) -> int:
  """Shared memory of one CTA (the H100/H200 limit is 227 KB). ``itemsize``: of Q, K, V."""
  rows = st.consumers * st.block_q
  tiles = rows * head_dim + (st.num_stages + st.v_ring) * st.block_kv * head_dim
  if not st.registers_pv:
    tiles += rows * st.block_kv
  extra = 0
  if st.persistent or st.fp8:                                    # O beside Q, 16-bit
    o_elems = st.consumers * 2 * st.block_q * O_CHUNK if st.o_chunked else rows * head_dim
    extra += o_elems * (2 if st.fp8 else itemsize)
  if st.fp8:                                            # q scales, k scale ring, v scales
    extra += rows * 4 + st.num_stages * st.block_kv * 4 + st.consumers * head_dim * 4
  return tiles * itemsize + extra + rows * 8 + st.num_stages * st.block_kv * 4 + 1024

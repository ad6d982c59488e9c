"""dK/dV for head dims whose two float32 accumulators do not fit one consumer (H = 256).

``backward.dkdv_kernel`` gives each consumer warpgroup ``block_kv`` keys and both of their
accumulators, dK and dV: at H = 256 that is 2 x 128 float32 registers a thread, more than a
thread has. Here the two consumers share the CTA's ``block_kv`` keys and split the work by role
instead (same recomputation as ``backward.py``, FA2 Alg. 2 in base 2):

* the dV side (consumer 0) holds K: S^T = K Q^T, P^T = 2^(S2^T - L2), dV += P^T dO; it hands
  G^T = P^T (1 - t^2 with a softcap, else P^T) to the other side through a double-buffered
  float16 slot (P is in [0, 1]: float16 keeps 11 bits where bfloat16 keeps 8);
* the dK side (consumer 1) holds V: dP^T = V dO^T, dS^T = G^T (dP^T - D), dK += dS^T Q.

Each side does two of the four matmuls and holds one [block_kv, H] accumulator (128 registers).
Masks only touch P^T (masked entries are 0, hence G^T and dS^T too), so only the dV side builds
them. Shared memory at H = 256, 64 keys, 64-row Q blocks, two stages: K, V 64 KB, the Q / dO
ring 128 KB, the hand-over 16 KB (209 KB). The producer streams Q, dO and L2 / D exactly as for
``dkdv_kernel`` (``backward.q_block_fetcher``); group heads are summed in a fixed order, so the
gradients are deterministic.

Both forms (compiled and interpret) run one synchronous wgmma at a time per consumer; the two
consumers overlap each other. Compiled, P^T and dS^T are register A operands; interpret mode
stages them through shared memory (its wgmma takes no register operands).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.mosaic.backward import (_TILED, _logits2, _matmul_acc, _product, _split_refs,
                                         _visit, dkdv_cta, producer_registers, q_block_fetcher,
                                         transposed_tile_mask)
from pallas_attn.mosaic.kernels import COMPUTE_WGS, Statics, produce, slot_releases

DV_SIDE, DK_SIDE = 0, 1
HANDOVER_DTYPE = jnp.float16


def dkdv_split_kernel(*refs, st: Statics, has_meta: bool, num_q_blocks: int):
  """refs: q, k, v, do, rows[, meta][, q_seg, kv_seg], dk, dv, smem, barriers. A CTA owns keys
  [tile * block_kv, (tile + 1) * block_kv) of one K/V head."""
  (q_ref, k_ref, v_ref, do_ref, rows_ref, meta_ref, q_seg_ref, kv_seg_ref), rest = _split_refs(
      refs, st, has_meta)
  dk_ref, dv_ref, smem, bars = rest
  (k_smem, v_smem, q_smem, do_smem, rows_smem, meta_smem, kvseg_smem, qseg_smem, g_smem,
   stage_smem) = smem
  q_ready, do_ready, rows_ready, kv_ready, meta_ready, q_free, do_free, g_ready, g_free = bars
  (release_q, release_do), waits = slot_releases((q_free, do_free), st)
  batch, kv_head, tile, wg, (lo, lo_full, hi_full, hi, kv_len) = dkdv_cta(
      meta_ref, meta_smem, meta_ready, num_q_blocks=num_q_blocks)
  bq, bkv, stages = st.block_q, st.block_kv, st.num_stages
  per_head = hi - lo                      # Q blocks visited for each head of the group
  steps = st.groups * per_head
  k_start = tile * bkv
  keys = pl.ds(k_start, bkv)
  shape = (bkv, bq)
  col = plgpu.Layout.WGMMA.reduce(0)

  def wait_inputs(slot):
    """Every ring barrier phase, on both sides (the interpreter checks that each waiter saw
    every phase)."""
    plgpu.barrier_wait(q_ready.at[slot])
    plgpu.barrier_wait(do_ready.at[slot])
    plgpu.barrier_wait(rows_ready.at[slot])
    if st.has_segments:
      plgpu.barrier_wait(rows_ready.at[stages + slot])

  def load_row(slot, which):
    return plgpu.load(rows_smem.at[slot, which], layout=col)

  def row(slot, which, early=None):
    """lse (0) / D (1) of the step's Q block as a column broadcast; ``early``: already read
    (``st.early_stats``: read before the product that it follows, so the load's latency
    overlaps the wgmma instead of stalling the first use; NOTES, session 30)."""
    return lax.broadcast_in_dim(load_row(slot, which) if early is None else early, shape, [1])

  def read_early(slot, which, masked: bool, name: str):
    return None if masked or name not in st.early_stats else load_row(slot, which)

  def finish(acc, scale, dst_smem, dst_ref):
    """The accumulator through this side's own input tile (no longer read by anyone)."""
    dst_smem[...] = (acc if scale is None else acc * scale).astype(dst_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dst_smem, dst_ref.at[batch, keys, kv_head])
    st.wait_stores()

  def accumulate(step):
    """One side's float32 [block_kv, H] accumulator over every (group head, Q block) step."""
    def per_group_head(n, acc):
      return _visit(lo, lo_full, hi_full, hi, lambda i, c, m: step(n, i, c, m), acc, st)
    zeros = plgpu.layout_cast(jnp.full((bkv, k_smem.shape[-1]), 0.0, jnp.float32),
                              plgpu.Layout.WGMMA)
    return lax.fori_loop(0, st.groups, per_group_head, zeros)

  @pl.when(wg == DV_SIDE)
  def _dv_side():
    plgpu.set_max_registers(st.consumer_registers, action="increase")
    plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_smem, kv_ready.at[0])
    plgpu.barrier_wait(kv_ready.at[0])
    kv_seg = None
    if st.has_segments:
      plgpu.copy_gmem_to_smem(kv_seg_ref.at[batch, keys], kvseg_smem, kv_ready.at[2])
      plgpu.barrier_wait(kv_ready.at[2])
      kv_seg = lax.broadcast_in_dim(
          plgpu.load(kvseg_smem, layout=plgpu.Layout.WGMMA.reduce(1)), shape, [0])

    def step(n, i, dv, masked: bool):
      s_no = n * per_head + (i - lo)
      slot = lax.rem(s_no, stages)
      wait_inputs(slot)
      lse = read_early(slot, 0, masked, "lse")
      s2, t = _logits2(_product(k_smem, q_smem.at[slot].transpose((1, 0)), shape), st)
      release_q(slot)                                    # S^T was Q's last use on this side
      pt = jnp.exp2(s2 - row(slot, 0, lse))
      if masked:
        mask = transposed_tile_mask(k_start=k_start, q_start=i * bq, kv_len=kv_len,
                                    qseg_ref=qseg_smem.at[slot] if st.has_segments else None,
                                    kv_seg=kv_seg, shape=shape, st=st)
        pt = jnp.where(mask, pt, 0.0)
      # Hand G^T over once the dK side has read what the slot held two steps ago.
      buf = lax.rem(s_no, 2)
      pl.when(s_no >= 2)(lambda: plgpu.barrier_wait(g_free.at[buf]))
      g_smem.at[buf][...] = (pt if t is None else pt * (1.0 - t * t)).astype(g_smem.dtype)
      plgpu.commit_smem()
      plgpu.barrier_arrive(g_ready.at[buf])
      dv = _matmul_acc(dv, pt.astype(k_smem.dtype), do_smem.at[slot],
                       None if stage_smem is None else stage_smem.at[DV_SIDE],
                       registers=st.registers_pv)
      release_do(slot)
      return dv

    dv = accumulate(step)
    for back in (2, 1):       # the last two hand-overs' ``g_free`` phases (one per slot)
      pl.when(steps >= back)(
          lambda b=back: plgpu.barrier_wait(g_free.at[lax.rem(steps - b, 2)]))
    finish(dv, None, k_smem, dv_ref)

  @pl.when(wg == DK_SIDE)
  def _dk_side():
    plgpu.set_max_registers(st.consumer_registers, action="increase")
    plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_smem, kv_ready.at[1])
    plgpu.barrier_wait(kv_ready.at[1])

    def step(n, i, dk, masked: bool):
      # (no mask here: G^T is already 0 wherever P^T was masked)
      s_no = n * per_head + (i - lo)
      slot = lax.rem(s_no, stages)
      wait_inputs(slot)
      delta = read_early(slot, 1, masked, "delta")
      dpt = _product(v_smem, do_smem.at[slot].transpose((1, 0)), shape)
      release_do(slot)
      buf = lax.rem(s_no, 2)
      plgpu.barrier_wait(g_ready.at[buf])
      g = plgpu.load(g_smem.at[buf], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
      plgpu.barrier_arrive(g_free.at[buf])
      dst = (g * (dpt - row(slot, 1, delta))).astype(k_smem.dtype)
      dk = _matmul_acc(dk, dst, q_smem.at[slot],
                       None if stage_smem is None else stage_smem.at[DK_SIDE],
                       registers=st.registers_pv)
      release_q(slot)
      return dk

    dk = accumulate(step)
    finish(dk, st.scale, v_smem, dk_ref)

  @pl.when(wg == COMPUTE_WGS)
  def _producer():
    plgpu.set_max_registers(producer_registers(st), action="decrease")
    fetch = q_block_fetcher((q_ref, do_ref, rows_ref, q_seg_ref),
                            (q_smem, do_smem, rows_smem, qseg_smem), (q_ready, do_ready, rows_ready),
                            batch=batch, kv_head=kv_head, lo=lo, per_head=per_head, st=st)
    produce(steps, stages, fetch, waits)


def split_scratch(*, st: Statics, head_dim: int, dtype, has_meta: bool):
  bq, bkv, stages = st.block_q, st.block_kv, st.num_stages
  smem = (
      plgpu.SMEM((bkv, head_dim), dtype, transforms=_TILED),                    # K, then dV
      plgpu.SMEM((bkv, head_dim), dtype, transforms=_TILED),                    # V, then dK
      plgpu.SMEM((stages, bq, head_dim), dtype, transforms=_TILED),             # Q ring
      plgpu.SMEM((stages, bq, head_dim), dtype, transforms=_TILED),             # dO ring
      plgpu.SMEM((stages, 2, bq), jnp.float32),                                 # L2, D ring
      plgpu.SMEM((8,), jnp.int32) if has_meta else None,
      plgpu.SMEM((bkv,), jnp.int32) if st.has_segments else None,
      plgpu.SMEM((stages, bq), jnp.int32) if st.has_segments else None,
      plgpu.SMEM((2, bkv, bq), HANDOVER_DTYPE, transforms=_TILED),              # G^T hand-over
      # Interpret mode: P^T / dS^T as wgmma A operands go through shared memory.
      None if st.registers_pv else plgpu.SMEM((COMPUTE_WGS, bkv, bq), dtype, transforms=_TILED),
  )
  bars = (
      plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=2 * stages),                                  # L2/D (+ q seg)
      plgpu.Barrier(num_barriers=3),                                           # K, V, kv seg
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),           # Q slot free
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),           # dO slot free
      plgpu.Barrier(num_arrivals=1, num_barriers=2),                          # G^T ready
      plgpu.Barrier(num_arrivals=1, num_barriers=2),                          # G^T free
  )
  return smem, bars


def split_smem_bytes(*, st: Statics, head_dim: int, itemsize: int = 2) -> int:
  """Shared memory of a split dK/dV CTA (compiled form)."""
  tiles = 2 * st.block_kv * head_dim + 2 * st.num_stages * st.block_q * head_dim
  handover = 2 * st.block_kv * st.block_q * jnp.dtype(HANDOVER_DTYPE).itemsize
  return tiles * itemsize + handover + st.num_stages * st.block_q * 12 + 2048

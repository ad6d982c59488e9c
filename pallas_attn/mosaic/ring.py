"""TMA rings of the Mosaic attention kernels: the producer loops that fill them, the consumers'
slot releases, the hardware (named) barriers they may use, and each CTA's range of K/V blocks.

Shared by the forward (``kernels.py``) and the backward kernels (``backward.py``,
``backward_split.py``, ``fused_dq.py``). A ring of ``stages`` slots is filled by the producer
warpgroup with one TMA copy per slot and step (an mbarrier ``ready`` per slot, one arrival per
copy); a consumer releases a slot once its wgmmas have read it (an mbarrier ``free`` per slot,
or with ``named_free`` a hardware barrier), and the producer refills the slot only then.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import masks

if TYPE_CHECKING:
  from pallas_attn.mosaic.kernels import Statics

WG_THREADS = 128
COMPUTE_WGS = 2          # consumer warpgroups per CTA; warpgroup COMPUTE_WGS is the producer
# First hardware (named) barrier of the ping-pong: Mosaic GPU keeps 0 for gpu.barrier and
# 1 + warpgroup index for its own warpgroup barriers (1..3 with three warpgroups).
SCHEDULE_BAR = 4
FREE_BAR = 6             # named_free: hardware barriers 6 .. 6 + 2 * num_stages - 1 (K, then V)
META_LEN = 8             # per-tile int32 metadata: lo, lo_full, hi_full, hi, kv_len, 0, 0, 0


def schedule_bar(consumers: int) -> int:
  """First hardware barrier of the forward's ping-pong (after Mosaic's 1 + warpgroups)."""
  return max(SCHEDULE_BAR, consumers + 2)


def free_bar(consumers: int) -> int:
  """First hardware barrier of ``named_free`` (after the ping-pong's, one per consumer)."""
  return max(FREE_BAR, schedule_bar(consumers) + consumers)


def consumer_turns(wg, local, last):
  """``Config.bwd_turns``: ``(begin, end)`` to put around a dK/dV consumer's issue of its
  step's first two products (S^T and dP^T) at step ``local`` of ``last + 1``.
  The two consumers then issue in turn (0, 1, 0, 1, ...), each waiting on its own hardware
  barrier (``schedule_bar(2)`` + its index) for the other's previous issue, so that one
  consumer's products reach the tensor cores ahead of the other's and its softmax can run while
  the other's products do (FA3 Section 3.1's ping-pong, applied to the backward). Consumer 0
  skips its first wait and consumer 1 its last signal: each barrier sees as many arrivals as
  waits. Both consumers must visit the same steps (they share the CTA's Q blocks). A CTA
  looping over tiles would have to count ``local`` across them: restarted per tile, consumer 0
  could signal twice in a row, which a hardware barrier counts as both consumers' arrival.
  Compiled only."""
  first, threads = schedule_bar(COMPUTE_WGS), COMPUTE_WGS * WG_THREADS

  def begin():
    pl.when((wg == 1) | (local > 0))(lambda: named_barrier("sync", first + wg, threads))

  def end():
    pl.when((wg == 0) | (local < last))(lambda: named_barrier("arrive", first + 1 - wg, threads))
  return begin, end


def tile_ranges(meta_ref, meta_smem, meta_ready, *, wg, batch, tile, full: int,
                producer: int = COMPUTE_WGS):
  """(lo, lo_full, hi_full, hi, kv_len) of this CTA: blocks [lo, hi) are visited, those in
  [lo_full, hi_full) need no mask. From the CTA's int32 record (the producer TMA-loads it into
  SMEM), or the whole span [0, full) with no kv_len when nothing is masked (``meta_ref`` None)."""
  if meta_ref is None:
    return jnp.int32(0), jnp.int32(0), jnp.int32(full), jnp.int32(full), None

  @pl.when(wg == producer)
  def _():
    plgpu.copy_gmem_to_smem(meta_ref.at[batch, tile], meta_smem, meta_ready.at[0])
  plgpu.barrier_wait(meta_ready.at[0])
  return tuple(meta_smem[i] for i in range(5))


def computed_tile_ranges(tile, st: Statics):
  """``tile_ranges`` for position-only masks, from the CTA's query tile index (no metadata
  load: the consumers can start as soon as Q and the first K block land). Same values as
  ``masks.kv_block_ranges`` for one tile of ``consumers * block_q`` rows (kv_len = S)."""
  cta_q = st.consumers * st.block_q
  q_first = tile * cta_q
  q_last = jnp.minimum(q_first + cta_q, st.seq_q) - 1
  lo, lo_full, hi_full, hi = masks.tile_block_range(q_first, q_last, spec=st.spec,
                                                     seq_k=st.seq_k, block_k=st.block_kv)
  return lo, lo_full, hi_full, hi, st.seq_k


def named_barrier(op: str, barrier_id, num_threads: int):
  """``bar.sync`` / ``bar.arrive`` on hardware barrier ``barrier_id`` (an int32 scalar) for
  ``num_threads`` threads. Compiled only: the Mosaic GPU interpreter cannot run PTX."""
  if op not in ("sync", "arrive"):
    raise ValueError(f"op must be 'sync' or 'arrive', got {op!r}")

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
  def _bar(_, bar):
    mgpu_utils.inline_ptx(f"bar.{op} $0, {num_threads};", bar.registers.item(),
                          has_side_effects=True, convergent=True)
  _bar(jnp.asarray(barrier_id, jnp.int32))


def kv_fetcher(gmem, smem, ready, *, batch, kv_head, first, st: Statics, k_scales=None):
  """``fetch(i[, slot])`` for ``produce``: TMA of K/V block ``first + i`` (and its segment ids)
  into ring slot ``slot`` (default ``i % num_stages``); ``gmem`` / ``smem`` / ``ready`` are the
  (K, V, kv segment ids) refs, ring buffers and ready barriers (the segment entries are None
  without segment ids). ``st.fp8``: V is read from its transpose [B, K, H, S] and
  ``k_scales`` = (the [B, K, S] key scales, their ring) go out on K's barrier (two arrivals)."""
  (k_ref, v_ref, seg_ref), (k_smem, v_smem, seg_smem), (k_ready, v_ready, seg_ready) = (
      gmem, smem, ready)

  def fetch(i, slot=None):
    slot = lax.rem(i, st.num_stages) if slot is None else slot
    keys = pl.ds((first + i) * st.block_kv, st.block_kv)
    plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_smem.at[slot], k_ready.at[slot])
    if st.fp8:
      ks_ref, ks_smem = k_scales
      plgpu.copy_gmem_to_smem(ks_ref.at[batch, kv_head, keys], ks_smem.at[slot], k_ready.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[batch, kv_head, :, keys], v_smem.at[slot],
                              v_ready.at[slot])
    else:
      plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_smem.at[slot], v_ready.at[slot])
    if st.has_segments:
      plgpu.copy_gmem_to_smem(seg_ref.at[batch, keys], seg_smem.at[slot], seg_ready.at[slot])
  return fetch


def slot_releases(free_barriers, st: Statics, stages: tuple[int, ...] | None = None):
  """``(releases, waits)``: per ring (e.g. K and V) a consumer's ``release(slot)`` and the
  producer's ``wait(slot)``. Mbarriers (``free_barriers``, one per slot; Pallas makes every
  thread of a consumer warpgroup arrive, a shared-memory atomic each), or with ``st.named_free``
  a hardware barrier per ring and slot: the consumers ``bar.arrive`` and the producer's
  ``bar.sync`` completes once every consumer and producer thread is in (ids from
  ``free_bar``). ``stages``: slots per ring (default ``st.num_stages`` each)."""
  stages = stages or (st.num_stages,) * len(free_barriers)
  if not st.named_free:
    return (tuple((lambda slot, b=b: plgpu.barrier_arrive(b.at[slot])) for b in free_barriers),
            tuple((lambda slot, b=b: plgpu.barrier_wait(b.at[slot])) for b in free_barriers))
  first, threads = free_bar(st.consumers), (st.consumers + 1) * WG_THREADS
  offsets = [first + sum(stages[:r]) for r in range(len(free_barriers))]
  ids = [lambda slot, o=o: o + slot for o in offsets]
  if first + sum(stages) > 16:
    raise NotImplementedError("named_free: more ring slots than hardware barriers")
  return (tuple((lambda slot, i=i: named_barrier("arrive", i(slot), threads)) for i in ids),
          tuple((lambda slot, i=i: named_barrier("sync", i(slot), threads)) for i in ids))


def split_kv_fetchers(gmem, smem, ready, *, batch, kv_head, first, st: Statics):
  """``(fetch_k, fetch_v)`` for ``produce_rings``: like ``kv_fetcher``, but K (with the segment
  ids) into slot ``i % st.num_stages`` of its ring and V into slot ``i % st.v_ring`` of its own
  (or into the ``slot`` given: the persistent forward counts ring positions across tiles)."""
  (k_ref, v_ref, seg_ref), (k_smem, v_smem, seg_smem), (k_ready, v_ready, seg_ready) = (
      gmem, smem, ready)

  def keys(i):
    return pl.ds((first + i) * st.block_kv, st.block_kv)

  def fetch_k(i, slot=None):
    slot = lax.rem(i, st.num_stages) if slot is None else slot
    plgpu.copy_gmem_to_smem(k_ref.at[batch, keys(i), kv_head], k_smem.at[slot], k_ready.at[slot])
    if st.has_segments:
      plgpu.copy_gmem_to_smem(seg_ref.at[batch, keys(i)], seg_smem.at[slot], seg_ready.at[slot])

  def fetch_v(i, slot=None):
    slot = lax.rem(i, st.v_ring) if slot is None else slot
    plgpu.copy_gmem_to_smem(v_ref.at[batch, keys(i), kv_head], v_smem.at[slot], v_ready.at[slot])
  return fetch_k, fetch_v


def produce_rings(num_steps, rings):
  """Producer loop over several TMA rings of different depths, fed in step order: ``rings`` is
  a sequence of ``(stages, fetch, wait)``. Step ``i`` of each ring waits for its slot's release
  by step ``i - stages``, then fetches; at the end the last releases are observed (as in
  ``produce``). With the dQ kernel's K ring at 2 slots and V at 1, K_{i+1} goes out when step
  i - 1 has released K (after its dQ wgmma) and V_{i+1} when step i has released V (after dP),
  so both loads overlap the consumers' work."""
  @pl.loop(0, num_steps)
  def _steps(i):
    for stages, fetch, wait in rings:
      pl.when(i >= stages)(lambda: wait(lax.rem(i, stages)))
      fetch(i)

  for stages, _, wait in rings:
    @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
    def _drain(i):
      wait(lax.rem(i, stages))


def produce(num_steps, stages: int, fetch, free_barriers):
  """Producer loop of a ``stages``-deep TMA ring: fill it, refill each slot once every consumer
  has released it, and at the end observe the last releases too, so that every barrier phase is
  waited on before the barriers go away (the interpreter checks this; on the GPU it is free).
  ``free_barriers``: mbarrier refs (one per slot each), or callables ``wait(slot)``."""
  def wait(slot):
    for bar in free_barriers:
      bar(slot) if callable(bar) else plgpu.barrier_wait(bar.at[slot])

  @pl.loop(0, jnp.minimum(num_steps, stages))
  def _prologue(i):
    fetch(i)

  @pl.loop(stages, jnp.maximum(num_steps, stages))
  def _steady(i):
    wait(lax.rem(i, stages))
    fetch(i)

  @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
  def _drain(i):
    wait(lax.rem(i, stages))

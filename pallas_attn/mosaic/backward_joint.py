"""The backward's two kernels in one launch (``Config.bwd_joint``): the dQ CTAs, then the dK/dV
CTAs, launched in that order.

Why: the dQ kernel pays for its last partial wave. At 4x4096x16x128 its 2048 CTAs make 15.5
waves on 132 SMs, and the dQ kernel's time follows its waves, not its work (H100, session 39:
the same time at 31.0 and 32 waves), so 64 SMs idle through the sixteenth, ~36 us of a
~3.7 ms fwd+bwd. In one launch the dK/dV CTAs start on those SMs as soon as they free up.

The dependency: each dK/dV CTA reads D = rowsum(dO * O) - dlse of its K/V head's query heads,
which the dQ CTAs compute (``Config.bwd_delta_in_dq``) and store with L2 in the ``rows``
record. Each dK/dV CTA has a GMEM semaphore (``pl.get_global``: one buffer shared by all CTAs;
kernel-scoped semaphores are per CTA) that every dQ consumer of its K/V head's group adds 1
to once its record has landed; the dK/dV producer waits for all ``groups * q_tiles * 2`` of
them before its first load and takes the count back to zero. The dQ CTAs come first in the
grid, and CTAs start in grid order, so every dQ CTA has an SM before any dK/dV CTA waits: no
deadlock. With the default order (batch fastest, then tile, then head) a dK/dV CTA's heads
were finished waves before it starts, so it should not wait in practice.

Memory order: a dQ consumer's record is a TMA store (async proxy), issued before its K/V
loop. Once dQ's own store is issued, the consumer waits for the record's bulk group only
(``wait_group 1``), then ``fence.proxy.async.global`` and ``fence.acq_rel.gpu`` order the
record before the relaxed adds, all while dQ's store is in flight; the dK/dV producer's wait
ends with an acquire fence, and another proxy fence orders that before its TMA loads of the
record.

Unmasked calls only (no metadata, segment ids or kv_lengths), the grid forms of both kernels
(not persistent, stream-tail, fused-dQ, split or self-fed); ``ops._backward`` checks. The
gradients are bitwise those of the two launches (the same kernel bodies).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.mosaic import backward, backward_dq
from pallas_attn.mosaic.kernels import COMPUTE_WGS, Statics


# Benchmark-only switches (``benchmarks/joint_variants.py``), read at trace time:
# _SIGNAL_OVERLAPS_DQ: the dQ consumers wait for their D record only, not for dQ's store too.
# _SYNC = False drops the semaphores: a race (dK/dV may read D before it lands), kept only to
# measure what the synchronisation costs. Never set it outside that benchmark.
_SIGNAL_OVERLAPS_DQ = True
_SYNC = True


def _proxy_fence():
  """``fence.proxy.async.global``: order TMA (async proxy) global accesses against this
  thread's generic ones (the semaphore's atomics). Compiled only."""
  @plgpu.inline_mgpu()
  def _fence(_):
    mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)
  _fence()


def _marker(name: str):
  """A PTX comment with side effects at the top of a branch, so that LLVM cannot hoist the two
  branches' identical first instructions above the branch. Offline SASS at 4x4096x16x128:
  the dK/dV step loop 375 -> 368 instructions, spills 16 / 64 -> 8 / 48 B (the loop is 349
  in its own launch). Compiled only."""
  @plgpu.inline_mgpu()
  def _m(_):
    mgpu_utils.inline_ptx(f"// joint: {name}", has_side_effects=True)
  _m()


def _signal_range(sems, first, count: int):
  """Adds 1 to semaphores ``first .. first + count - 1`` of ``sems``: one thread of the
  warpgroup, after a warpgroup barrier and one release fence (``semaphore_signal_parallel``
  fences and syncs the warpgroup once per semaphore). Compiled only."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT))
  def _signal(_, sems_ref, first_arr):
    base = mgpu_utils.memref_ptr(sems_ref)
    start = first_arr.registers.item()
    mgpu_utils.warpgroup_barrier()
    one = mgpu_utils.single_thread_predicate(mgpu_utils.ThreadSubset.WARPGROUP)
    mgpu_utils.inline_ptx("fence.acq_rel.gpu;", has_side_effects=True)
    for t in range(count):
      mgpu_utils.inline_ptx(
          "{ .reg .u64 a; mul.wide.u32 a, $1, 4; add.u64 a, $0, a; "
          f"@$2 red.relaxed.gpu.global.add.u32 [a+{4 * t}], 1; }}",
          base, start, one, has_side_effects=True)
  _signal(sems, jnp.asarray(first, jnp.int32))


def joint_kernel(q_ref, k_ref, v_ref, do_ref, rows_ref, o_ref, dq_ref, rows_out_ref, dk_ref,
                 dv_ref, *, st_dq: Statics, st_dkdv: Statics, heads: int,
                 kv_heads: int, q_tiles: int, kv_tiles: int, batch: int, num_q_blocks: int,
                 dq_scratch, dkdv_scratch, interpret: bool = False):
  """refs: q, k, v, do, rows (L2 and -dlse), o, then the outputs dq, rows_out (L2 and D),
  dk, dv. Grid rows [0, heads) run ``backward_dq.dq_kernel``, the rest
  ``backward.dkdv_kernel``, each in its own scoped scratch (the kernel's SMEM is the larger of
  the two). ``interpret``: no semaphores (the interpreter zeroes none and runs the CTAs in grid
  order anyway)."""
  kw = dict(locals())
  if interpret:
    _joint(None, **kw)
    return
  # One semaphore per dK/dV CTA, shared by all CTAs (``get_global``; kernel scratch would give
  # each CTA its own copy). Each dK/dV CTA takes its count back to zero (decrement), so the
  # semaphores start at zero on every launch whether or not Pallas zeroes them.
  _joint(pl.get_global(plgpu.SemaphoreType.REGULAR((batch * kv_heads * kv_tiles,))), **kw)


def _joint(ready_sems, *, q_ref, k_ref, v_ref, do_ref, rows_ref, o_ref, dq_ref, rows_out_ref,
           dk_ref, dv_ref, st_dq, st_dkdv, heads, kv_heads, q_tiles, kv_tiles, batch,
           num_q_blocks, dq_scratch, dkdv_scratch, interpret):
  # The grid is (heads + kv_heads, max(q_tiles, kv_tiles), batch), launched batch fastest, then
  # tile, then head (``ops._grid``): the dQ CTAs' heads first; with T != S the surplus tiles
  # of one kind exit at once.
  b, row, tile = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("seq")
  groups = heads // kv_heads
  signals = groups * q_tiles * COMPUTE_WGS          # dQ consumers per (batch, K/V head)

  @pl.when((row < heads) & (tile < q_tiles))
  def _dq():
    if not interpret:
      _marker("dq")
    head = row

    def done():                  # this consumer's D record has landed: tell the group's CTAs
      # Runs with the record's store (issued before the K/V loop) and dQ's (just issued) in
      # flight: wait for the record only, so the fences and adds overlap dQ's store.
      plgpu.wait_smem_to_gmem(1 if _SIGNAL_OVERLAPS_DQ else 0, wait_read_only=False)
      _proxy_fence()
      _signal_range(ready_sems, (b * kv_heads + lax.div(head, groups)) * kv_tiles, kv_tiles)

    pl.run_scoped(lambda smem, bars: backward_dq.dq_kernel(
        q_ref, k_ref, v_ref, do_ref, rows_ref, o_ref, dq_ref, rows_out_ref, smem, bars,
        st=st_dq, has_meta=False, coords=(b, head, tile),
        on_done=None if interpret or not _SYNC else done), *dq_scratch,
        collective_axes="wg")

  @pl.when((row >= heads) & (tile < kv_tiles))
  def _dkdv():
    if not interpret:
      _marker("dkdv")
    kv_head = row - heads

    def ready():                 # every dQ consumer of this K/V head's group has signalled
      plgpu.semaphore_wait(ready_sems.at[(b * kv_heads + kv_head) * kv_tiles + tile], signals,
                           memory_scope="gpu")
      _proxy_fence()

    pl.run_scoped(lambda smem, bars: backward.dkdv_kernel(
        q_ref, k_ref, v_ref, do_ref, rows_out_ref, dk_ref, dv_ref, smem, bars, st=st_dkdv,
        has_meta=False, num_q_blocks=num_q_blocks, coords=(b, kv_head, tile),
        before_loads=None if interpret or not _SYNC else ready), *dkdv_scratch,
        collective_axes="wg")

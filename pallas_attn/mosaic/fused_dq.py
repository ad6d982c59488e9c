"""The fused dQ of the Mosaic dK/dV kernel (FA3 Section 3.3): dQ_i += dS_i K without a dQ kernel.

The two-kernel backward recomputes S and dP in a separate dQ kernel (7 matmuls per block pair
instead of 5). Fused, the dK/dV CTA that owns keys [k0, k0 + 2 * block_kv) already holds every
dS_i^T of those keys; it adds ``dS_i K`` (float32, [block_q, H]) into a global accumulator:

    dQ[i] = scale * sum over K/V tiles t of dS_{i,t} K_t        (summed by TMA reduce-add)

so the order of the additions varies from run to run (not bitwise deterministic). Three forms
(``Config.bwd_fused_dq`` / ``bwd_dq_writer`` / ``bwd_dq_lag``), all keeping dS^T of both
consumers in a double-buffered SMEM slot ``ds[step % 2, consumer]``:

* rendezvous (``rendezvous_step``): both consumers meet every step, then consumer w computes the
  w-th H/2 columns over both consumers' keys (at H = 64 they take whole steps in turn);
* writer (``hand_over`` + ``writer_loop``): the producer warpgroup computes dQ from the slots;
* lag (``hand_over`` + ``lagged``): consumer w computes its columns for the step before, whose
  dS^T both finished a step ago, so the consumers never meet inside the loop.

Interpret mode (its TMA has no reductions) writes each K/V tile's partial to its own slice of a
``[tiles, B, T, N, H]`` output, summed outside (``ops._backward``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.mosaic.kernels import COMPUTE_WGS, SCHEDULE_BAR, WG_THREADS, Statics, named_barrier

DQ_SYNC_BAR = SCHEDULE_BAR   # the rendezvous on a hardware barrier (named_free); no ping-pong here


def dq_width(head_dim: int) -> int:
  """Columns of dQ one consumer computes per step: H/2 where that is whole 64-column swizzle
  rows of K (H >= 128), else all of them (H = 64: the consumers alternate steps)."""
  return head_dim // COMPUTE_WGS if head_dim % (64 * COMPUTE_WGS) == 0 else head_dim


@dataclasses.dataclass(frozen=True)
class FusedDQ:
  """A dK/dV CTA's side of the fused dQ: its refs and tile coordinates (traced values).

  ``sink``: "reduce" (compiled: ``sink_ref`` is the float32 [B, T, N, H] accumulator) or
  "partials" (interpret: ``sink_ref`` is [tiles, B, T, N, H]). ``ds_smem`` [2, consumers,
  block_kv, block_q] holds dS^T; ``dqt_smem`` the fp32 partials on their way to the TMA unit.
  Step s of the CTA visits group head ``s // per_head`` and Q block ``lo + s % per_head``.
  """
  st: Statics
  sink: str
  sink_ref: Any
  k_smem2: Any
  ds_smem: Any
  dqt_smem: Any
  dq_sync: Any
  ds_ready: Any
  ds_free: Any
  batch: Any
  kv_head: Any
  tile: Any
  wg: Any
  lo: Any
  per_head: Any

  # -- shared pieces ---------------------------------------------------------------------------

  def _columns(self):
    hd = self.k_smem2.shape[-1]
    width = dq_width(hd)
    split = width != hd
    return split, width, pl.ds(self.wg * width if split else 0, width)

  def _coords(self, step):
    """(head, rows) of step ``step``."""
    per = jnp.maximum(self.per_head, 1)
    head = self.kv_head * self.st.groups + lax.div(step, per)
    return head, pl.ds((self.lo + lax.rem(step, per)) * self.st.block_q, self.st.block_q)

  def _products(self, acc_ref, buf, cols):
    """acc += dS_buf K[:, cols] over both consumers' keys (A: the transposed dS^T slots)."""
    for w in range(COMPUTE_WGS):
      plgpu.wgmma(acc_ref, self.ds_smem.at[buf, w].transpose((1, 0)),
                  self.k_smem2.at[w, :, cols])

  def send(self, part, slot, step, cols):
    """Hands a float32 partial of step ``step`` to the TMA unit through SMEM ``slot`` (whose
    previous reduction must have read it: the caller waits)."""
    slot[...] = part
    plgpu.commit_smem()
    head, rows = self._coords(step)
    if self.sink == "reduce":
      plgpu.copy_smem_to_gmem(slot, self.sink_ref.at[self.batch, rows, head, cols],
                              reduction_op="add")
    else:
      plgpu.copy_smem_to_gmem(slot, self.sink_ref.at[self.tile, self.batch, rows, head, cols])

  def meet(self):
    """Both consumers at the same point: a 256-thread hardware barrier with ``named_free``,
    else an mbarrier rendezvous."""
    if self.st.named_free:
      named_barrier("sync", DQ_SYNC_BAR, COMPUTE_WGS * WG_THREADS)
    else:
      plgpu.barrier_arrive(self.dq_sync)
      plgpu.barrier_wait(self.dq_sync)

  # -- consumer side ---------------------------------------------------------------------------

  def rendezvous_step(self, step, dst):
    """Rendezvous form: dS^T into its slot, meet (both written, and two steps ago read by the
    other side), then this consumer's columns of dQ over the CTA's 2 * block_kv keys."""
    buf = lax.rem(step, 2)
    self.ds_smem.at[buf, self.wg][...] = dst
    plgpu.commit_smem()
    self.meet()
    split, width, cols = self._columns()

    def compute():
      def body(acc_ref):
        self._products(acc_ref, buf, cols)
        return acc_ref[...]
      part = pl.run_scoped(body, plgpu.ACC((self.st.block_q, width), jnp.float32))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # last partial has left SMEM
      self.send(part, self.dqt_smem.at[self.wg], step, cols)
    if split:
      compute()
    else:
      pl.when(buf == self.wg)(compute)

  def hand_over(self, step, dst):
    """Writer and lag forms: dS^T of ``step`` into its slot once the dQ wgmmas of two steps
    ago have read it (``ds_free``), then signal ``ds_ready``."""
    buf = lax.rem(step, 2)
    pl.when(step >= 2)(lambda: plgpu.barrier_wait(self.ds_free.at[buf]))
    self.ds_smem.at[buf, self.wg][...] = dst
    plgpu.commit_smem()
    plgpu.barrier_arrive(self.ds_ready.at[buf])

  def lagged(self, prev, issue_dk=None):
    """Lag form: this consumer's dQ columns of step ``prev`` (one behind): it waits only for
    the other's dS^T of that step. ``issue_dk`` (compiled) puts this step's dK += dS^T Q on the
    tensor cores behind the dQ wgmmas, so it runs while the partial is stored and reduced."""
    buf = lax.rem(prev, 2)
    plgpu.barrier_wait(self.ds_ready.at[buf])
    split, width, cols = self._columns()

    def compute():
      def body(acc_ref):
        self._products(acc_ref, buf, cols)
        if issue_dk is None:
          return acc_ref[...]
        issue_dk()
        return plgpu.wgmma_accumulator_load(acc_ref, wait_n=1)   # dK stays in flight
      part = pl.run_scoped(body, plgpu.ACC((self.st.block_q, width), jnp.float32))
      plgpu.barrier_arrive(self.ds_free.at[buf])   # the wgmmas reading slot ``buf`` retired
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      self.send(part, self.dqt_smem.at[self.wg], prev, cols)

    def skip():                    # H = 64: the other consumer computes this step's dQ
      if issue_dk is not None:
        issue_dk()
      plgpu.barrier_arrive(self.ds_free.at[buf])
    if split:
      compute()
    else:
      pl.when(buf == self.wg)(compute)
      pl.when(buf != self.wg)(skip)

  def step(self, step, dst, issue_dk=None):
    """A consumer's fused-dQ work after dS^T of ``step`` is formed. ``issue_dk`` (compiled):
    this step's dK wgmma, issued here (the lag form puts it behind its dQ wgmmas)."""
    if self.st.dq_lag and not self.st.dq_writer:
      self.hand_over(step, dst)
      pl.when(step >= 1)(lambda: self.lagged(step - 1, issue_dk))
      if issue_dk is not None:
        pl.when(step == 0)(issue_dk)
      return
    if issue_dk is not None:
      issue_dk()
    if self.st.dq_writer:
      self.hand_over(step, dst)
    else:
      self.rendezvous_step(step, dst)            # waits for every wgmma in flight

  def finish(self, steps):
    """After the consumer's loop, before dK overwrites its K tile (which the dQ wgmmas read):
    the lag form's last step, then (writer, lag) the two ``ds_free`` phases not yet waited
    (one per slot), or (rendezvous) one more meeting."""
    if self.st.dq_writer or self.st.dq_lag:
      if not self.st.dq_writer:
        pl.when(steps >= 1)(lambda: self.lagged(steps - 1))
      for back in (2, 1):
        pl.when(steps >= back)(
            lambda b=back: plgpu.barrier_wait(self.ds_free.at[lax.rem(steps - b, 2)]))
    else:
      self.meet()

  # -- producer side (writer form) -------------------------------------------------------------

  def writer_loop(self, fetch, waits, total, stages: int):
    """The producer warpgroup as FA3's dQ side, without its per-step meeting of the consumers:
    besides refilling the Q/dO ring (``fetch``, ``waits``), for each step it waits for both
    consumers' dS^T (``ds_ready``), computes dQ_i = dS_i K over the CTA's keys in 64-column
    chunks, frees the slot (``ds_free``) and sends each chunk, alternating between two SMEM
    slots so a chunk's store waits only for the reduction two chunks back."""
    chunks = self.k_smem2.shape[-1] // 64

    @pl.loop(0, jnp.minimum(total, stages))
    def _prologue(s):
      fetch(s)

    @pl.loop(0, total)
    def _step(s):
      buf = lax.rem(s, 2)
      plgpu.barrier_wait(self.ds_ready.at[buf])
      # Refill first: this slot was released right after dS^T was handed over, and the
      # consumers need it two steps on; dQ has a step's slack.
      for wait in waits:
        wait(lax.rem(s, stages))
      pl.when(s + stages < total)(lambda: fetch(s + stages))
      for c in range(chunks):
        cols = pl.ds(64 * c, 64)

        def body(acc_ref):
          self._products(acc_ref, buf, cols)
          return acc_ref[...]
        part = pl.run_scoped(body, plgpu.ACC((self.st.block_q, 64), jnp.float32))
        if c == chunks - 1:      # every wgmma reading slot ``buf`` (and K) has retired
          plgpu.barrier_arrive(self.ds_free.at[buf])
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)     # the slot's last reduction read it
        self.send(part, self.dqt_smem.at[lax.rem(s * chunks + c, 2)], s, cols)
    plgpu.wait_smem_to_gmem(0)


def visited_parts(meta, *, kv_tiles: int, b: int, tq: int, bq: int):
  """[tiles, B, T, 1, 1] mask: row block i of batch b was visited by K/V tile j (its Q block
  range [lo, hi) from the metadata; every block when there is none)."""
  if meta is None:
    return jnp.ones((kv_tiles, b, tq, 1, 1), bool)
  blk = jnp.arange(tq) // bq                                   # [T]
  lo = jnp.moveaxis(meta[..., 0], 1, 0)[..., None]             # [tiles, B, 1]
  hi = jnp.moveaxis(meta[..., 3], 1, 0)[..., None]
  return ((blk >= lo) & (blk < hi))[..., None, None]

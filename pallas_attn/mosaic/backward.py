"""FlashAttention backward on Pallas Mosaic GPU: a dQ kernel and a dK/dV kernel, with wgmma.

Same recomputation as FA2 Alg. 2 / FA3 Section 3.3, in base 2 (L2 = lse * log2 e, +inf for rows
that see nothing, so their P is 0), with D = rowsum(dO * O) - dlse precomputed:
  P = 2^(S2 - L2),  dP = dO V^T,  dS = P * (dP - D) * (1 - t^2 if softcap),
  dQ = scale * dS K,  dK = scale * dS^T Q,  dV = P^T dO.

* dQ kernel (``backward_dq.py``): two consumer warpgroups (``block_q`` query rows each) and a
  producer streaming the K/V blocks the tile can see through a TMA ring (as the forward).
* dK/dV kernel: two consumers (``block_kv`` keys each) and a producer streaming, for every query
  head of the K/V head's group and every visible Q block, Q, dO and the L2 / D vectors. The
  group's heads are summed in a fixed order: deterministic GQA/MQA gradients, no atomics.
* Fused dQ (``fused_dq.py``, FA3 Section 3.3) and the joint launch of both kernels
  (``backward_joint.py``): see there.

Compiled, the consumers take ``Config.bwd_registers`` registers and keep their wgmmas in
flight: S and dP issued together, P computed while dP runs, dV += P^T dO issued before dS^T is
formed (FA3 Section 3.3's overlap of the softmax with the matmuls). Interpret mode (no register
wgmma operands in JAX 0.11.2's interpreter) stages P^T / dS through shared memory.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import masks
from pallas_attn.mosaic import stream_tail
from pallas_attn.mosaic.fused_dq import FusedDQ, dq_width
from pallas_attn.mosaic.kernels import (COMPUTE_WGS, LOG2E, Statics, produce, slot_releases,
                                        tile_ranges)
from pallas_attn.mosaic.persistent import (_decode_tile, persistent_consumer_loop,
                                           persistent_tile_count)
from pallas_attn.mosaic.ring import consumer_turns

_TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_TILED_F32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))



def _logits2(s, st: Statics):
  """q.k -> (base-2 logits, tanh of the softcap or None)."""
  if st.softcap is None:
    return s * (st.scale * LOG2E), None
  t = jnp.tanh(s * (st.scale / st.softcap))
  return t * (st.softcap * LOG2E), t


def _grad_logits(p, dp, delta, t, mask, dtype):
  """dS = P (dP - D) (1 - t^2 with a softcap), zero where masked, in the matmul dtype.
  ``delta``: broadcast to the tile (rows for dS, columns for dS^T); None: ``dp`` is dP - D."""
  ds = p * (dp if delta is None else dp - delta)
  if t is not None:
    ds = ds * (1.0 - t * t)
  if mask is not None:
    ds = jnp.where(mask, ds, 0.0)
  return ds.astype(dtype)


def _tile_mask(q_pos, k_pos, kv_len, q_seg, kv_seg, st: Statics):
  mask = masks.position_mask(q_pos, k_pos, st.spec)
  if st.has_kv_len:
    mask = masks.and_masks(mask, k_pos < kv_len)
  if st.has_segments:
    mask = masks.and_masks(mask, q_seg == kv_seg)
  return mask


def transposed_tile_mask(*, k_start, q_start, kv_len, qseg_ref, kv_seg, shape, st: Statics):
  """Visibility of a transposed [keys, queries] tile (the dK/dV kernels' S^T) in the wgmma
  accumulator layout; ``qseg_ref``: the Q block's segment ids in SMEM (or None), ``kv_seg``:
  the keys' ids already broadcast to the tile."""
  k_pos = k_start + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
  q_pos = q_start + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
  seg_q = None
  if qseg_ref is not None:
    seg_q = lax.broadcast_in_dim(plgpu.load(qseg_ref, layout=plgpu.Layout.WGMMA.reduce(0)),
                                 shape, [1])
  return _tile_mask(q_pos, k_pos, kv_len, seg_q, kv_seg, st)


def _half_rows(half: int, rows: int):
  """Query half ``half`` (0 or 1) of a ``rows``-query block, as a slice."""
  return pl.ds(half * (rows // 2), rows // 2)


def _matmul_acc(acc, a, b_ref, a_smem, *, registers: bool):
  """acc + a @ b (a: registers, bf16/f16; b: SMEM ref) with wgmma, in place when compiled."""
  if registers:
    def body(acc_ref):
      plgpu.wgmma(acc_ref, a, b_ref)
    return pl.run_state(body)(plgpu.ACC.init(acc))
  a_smem[...] = a
  plgpu.commit_smem()

  def body(acc_ref):
    plgpu.wgmma(acc_ref, a_smem, b_ref)
    return acc_ref[...]
  return acc + pl.run_scoped(body, plgpu.ACC(acc.shape, jnp.float32))


def _product(a_ref, b_ref, shape):
  """a @ b for two SMEM refs into a fresh float32 accumulator."""
  def body(acc_ref):
    plgpu.wgmma(acc_ref, a_ref, b_ref)
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


# Registers a thread of a 384-thread CTA is launched with (65536 / 384, rounded down to 8). The
# warpgroups' ``setmaxnreg`` only move registers inside this pool, and an increase blocks until
# the pool can give them, so 2 * consumer + producer must stay <= 3 * 168 = 504.
LAUNCH_REGISTERS = 168


def producer_registers(st: Statics) -> int:
  """Registers of the producer warpgroup: what two consumers at ``st.consumer_registers``
  leave of the launch pool (40 at 232, 24 at 240, FA3's split), at most 40. (A first version
  counted 512 a thread-slot: at 240 it gave the producer 32, the consumers' increase could never
  be granted, and the kernel hung on the H200, session 9.)"""
  left = 3 * LAUNCH_REGISTERS - 2 * st.consumer_registers
  # The dQ writer (``st.dq_writer``) holds a [block_q, 64] fp32 accumulator (32 registers a
  # thread) next to the ring's bookkeeping: it takes the whole rest (56 at 224, 40 at 232). At
  # either split ptxas found too few and serialised every wgmma of the kernel (session 13).
  return left if st.dq_writer else min(40, left)


def _split_refs(refs, st: Statics, has_meta: bool):
  """(q, k, v, do, rows, meta | None, q_seg | None, kv_seg | None), then the remaining refs."""
  refs = list(refs)
  inputs, pos = refs[:5], 5
  meta = q_seg = kv_seg = None
  if has_meta:
    meta, pos = refs[pos], pos + 1
  if st.has_segments:
    q_seg, kv_seg, pos = refs[pos], refs[pos + 1], pos + 2
  return (*inputs, meta, q_seg, kv_seg), refs[pos:]


# ----------------------------------------------------------------------------------------------
# dK, dV
# ----------------------------------------------------------------------------------------------

def dkdv_kernel(*refs, st: Statics, has_meta: bool, num_q_blocks: int, dq_sink: str = "",
                num_ctas: int = 0, grid_tiles: tuple[int, int, int] = (0, 0, 0),
                self_fed: bool = False, main_tiles: int = 0,
                tail: stream_tail.Tail | None = None, fold_tiles: int = 0, coords=None,
                before_loads=None):
  """refs: q, k, v, do, rows[, meta][, q_seg, kv_seg][, dq_acc], dk, dv[, dq_parts], smem,
  barriers.

  ``self_fed`` (``Config.bwd_self_fed``; grid form without the fused dQ): launched with the two
  consumer warpgroups only. Consumer 0 fills the Q / dO / stats ring itself (the first
  ``num_stages`` steps before its loop; at step s, once both consumers have released step
  s - 1's slot, step s - 1 + num_stages into it), so no producer warpgroup holds registers and
  ptxas may give each consumer thread up to 255 instead of 240.

  ``num_ctas`` > 0: the persistent form (``Config.bwd_persistent``; unmasked calls without the
  fused dQ): ``num_ctas`` CTAs loop over the (K/V head, K/V tile, batch) tiles of
  ``grid_tiles``, tiles fastest (``_decode_tile``), round-robin. The producer's Q/dO ring runs
  on across tiles, so the next tile's first blocks arrive while this tile ends, and each
  consumer keeps two K/V buffers: the next tile's K and V load while this one computes, and
  its dK and dV leave through the buffer it read K and V from.

  Here ``st.block_q`` is the streamed Q block and ``st.block_kv`` the keys of one consumer.
  ``dq_sink`` (the fused dQ of FA3 Section 3.3, ``fused_dq.py``): "" = no dQ here (the dQ
  kernel computes it); "reduce" = fp32 partials added into the mutable ``dq_acc`` [B, T, N, H]
  input by TMA reductions (compiled); "partials" = each K/V tile's partial written to its own
  slice of ``dq_parts`` [tiles, B, T, N, H] and summed outside (interpret mode, whose TMA has
  no reductions).

  Stream-K for the last partial wave (``Config.bwd_stream_tail``, unmasked grid form; see
  ``stream_tail.py``): ``main_tiles`` > 0: the grid's CTAs from flat index ``main_tiles`` on
  (``_decode_tile``'s numbering) do nothing. ``tail``: the persistent form runs only those
  tiles, each CTA its one or two parts (Q blocks [lo, hi) of every head of the group), and
  writes float32 partials (dK already scaled) to ``dk`` / ``dv`` [num_ctas, 2, keys, H]
  instead of dK, dV; ``stream_tail.merge_sum`` adds them in query order.

  ``coords`` = (batch, K/V head, K/V tile) replaces the grid's indices and the producer runs
  ``before_loads()`` before its first load (the joint launch, ``backward_joint.py``).
  """
  (q_ref, k_ref, v_ref, do_ref, rows_ref, meta_ref, q_seg_ref, kv_seg_ref), rest = _split_refs(
      refs, st, has_meta)
  dq_sink_ref = None
  if dq_sink == "reduce":
    dq_sink_ref, dk_ref, dv_ref, smem, bars = rest
  elif dq_sink == "partials":
    dk_ref, dv_ref, dq_sink_ref, smem, bars = rest
  else:
    dk_ref, dv_ref, smem, bars = rest
  (k_smem2, v_smem2, q_smem, do_smem, rows_smem, meta_smem, kvseg_smem2, qseg_smem,
   pt_smem2, ds_smem, dqt_smem) = smem
  q_ready, do_ready, rows_ready, kv_ready, meta_ready, q_free, do_free, dq_sync, ds_ready, ds_free = (
      bars)
  (release_q, release_do), waits = slot_releases((q_free, do_free), st)

  persist = num_ctas > 0
  if persist:
    # Unmasked: every tile visits all Q blocks of every head of its group.
    wg, cta = lax.axis_index("wg"), lax.axis_index("cta")
    lo, lo_full, hi_full, hi, kv_len = 0, 0, num_q_blocks, num_q_blocks, None
    batch = kv_head = tile = None
    my_tiles = persistent_tile_count(cta, num_ctas, grid_tiles)
    if tail is not None:
      my_tiles, tail_item = stream_tail.tail_items(cta, tail)
  else:
    batch, kv_head, tile, wg, (lo, lo_full, hi_full, hi, kv_len) = dkdv_cta(
        meta_ref, meta_smem, meta_ready, num_q_blocks=num_q_blocks,
        loader=0 if self_fed else COMPUTE_WGS, coords=coords)
  kv_batch = batch
  if fold_tiles:
    # (Config.bwd_fold_batch) K, V, dK, dV are [1, B * S], ``tile`` runs over every batch's
    # tiles, and only the producer's Q / dO fetch derives the batch.
    kv_batch, batch = 0, lax.div(tile, fold_tiles)
  bq, bkv, stages = st.block_q, st.block_kv, st.num_stages
  per_head = hi - lo                      # Q blocks visited for each head of the group
  tile_steps = st.groups * per_head       # ring steps of one tile
  # Config.bwd_free_first: the ring visits each head's blocks from lo_full on, wrapping round
  free_first = st.free_first and st.any_mask and not persist and not dq_sink
  rotate = lo_full - lo if free_first else None

  decode = functools.partial(_decode_tile, grid_tiles=grid_tiles)
  fdq = None if not dq_sink else FusedDQ(
      st=st, sink=dq_sink, sink_ref=dq_sink_ref, k_smem2=k_smem2, ds_smem=ds_smem,
      dqt_smem=dqt_smem, dq_sync=dq_sync, ds_ready=ds_ready, ds_free=ds_free, batch=batch,
      kv_head=kv_head, tile=tile, wg=wg, lo=lo, per_head=per_head)

  def tile_keys(tile):
    return pl.ds(tile * (COMPUTE_WGS * bkv) + wg * bkv, bkv)

  self_fetch = None
  if self_fed:
    self_fetch = q_block_fetcher(
        (q_ref, do_ref, rows_ref, q_seg_ref), (q_smem, do_smem, rows_smem, qseg_smem),
        (q_ready, do_ready, rows_ready), batch=batch, kv_head=kv_head, lo=lo, per_head=per_head,
        st=st, rotate=rotate)

  def refill(step_no):
    """Self-fed ring: consumer 0 waits until both consumers released step ``step_no - 1``'s
    slot, then loads step ``step_no - 1 + stages`` into it (``ring.produce``'s steady state,
    one step at a time inside the consumer loop)."""
    if not self_fed:
      return
    nxt = step_no - 1 + stages

    @pl.when((wg == 0) & (step_no >= 1) & (nxt < tile_steps))
    def _():
      for wait in waits:
        wait(lax.rem(step_no - 1, stages))
      self_fetch(nxt)

  def drain_ring():
    """Self-fed ring: consumer 0 observes the releases no refill waited for (the last
    ``stages`` steps), so that every barrier phase is waited on (``ring.produce``'s drain)."""
    if not self_fed:
      return

    @pl.when(wg == 0)
    def _():
      @pl.loop(jnp.maximum(tile_steps - stages, 0), tile_steps)
      def _drain(i):
        for wait in waits:
          wait(lax.rem(i, stages))

  def consume(batch, kv_head, tile, k_smem, v_smem, base, span=None, part=None):
    """One K/V tile of this consumer (K, V in ``k_smem``, ``v_smem``): every Q block of every
    head of its group, ring steps from ``base`` on; then dK, dV out through the same buffers
    (TMA stores issued, not waited for). ``span`` = (lo, hi): only Q blocks [lo, hi) (a tail
    part, unmasked), its float32 partials stored from registers to slot ``part``."""
    lo_, lo_full_, hi_full_, hi_ = (lo, lo_full, hi_full, hi) if span is None else (
        span[0], span[0], span[1], span[1])
    per_head_ = hi_ - lo_
    if free_first and span is None:   # block i's place in the rotated order (_visit's)
      pos = lambda i: jnp.where(i >= lo_full_, i - lo_full_, i - lo_ + (hi_ - lo_full_))
    else:
      pos = lambda i: i - lo_
    keys = tile_keys(tile)
    k_start = tile * (COMPUTE_WGS * bkv) + wg * bkv
    col = plgpu.Layout.WGMMA.reduce(0)
    shape = (bkv, bq)
    half_shape = (bkv, bq // 2)
    defer = st.defer_wait and not dq_sink and not persist   # (the fused dQ waits for all)
    # Masked 128-query steps as two 64-query halves (``Config.bwd_masked_halves``); not with
    # the fused dQ (one dS^T a step), the deferred wait or P^T through SMEM.
    halves = (st.masked_halves and bq == 128 and st.any_mask and not dq_sink and not defer
              and not (st.registers_pv and st.pt_smem))
    # (Config.bwd_turns) the grid kernel: both consumers take the CTA's steps, masked or not,
    # in the same order (one turn a step, so not with the halves' two S^T issues a step)
    turns = st.turns and not halves and not dq_sink and not self_fed and not persist
    kv_seg = kv_seg_half = None
    if st.has_segments:
      plgpu.copy_gmem_to_smem(kv_seg_ref.at[batch, keys], kvseg_smem2.at[wg],
                              kv_ready.at[3 * wg + 2])
      plgpu.barrier_wait(kv_ready.at[3 * wg + 2])
      kv_seg_vec = plgpu.load(kvseg_smem2.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
      kv_seg = lax.broadcast_in_dim(kv_seg_vec, shape, [0])
      if halves:
        kv_seg_half = lax.broadcast_in_dim(kv_seg_vec, half_shape, [0])
    pt_smem = None if pt_smem2 is None else pt_smem2.at[wg]
    # ``st.kv_regs``: this consumer's K and / or V tile (the same for every Q block) as the
    # register A operand of S^T = K Q^T / dP^T = V dO^T (H / 2 registers a thread each), which
    # takes 16 KB a step off the SMEM reads (operands.q_operands says why that can matter).
    k_op = k_smem[...] if "k" in st.kv_regs else k_smem
    v_op = v_smem[...] if "v" in st.kv_regs else v_smem

    def row_stat(slot, which: int, half=None):
      """lse (0) or D (1) of the step's Q block (or of query half ``half``): one value per
      column of the transposed tile, read from the stats ring (16 registers a thread)."""
      ref = rows_smem.at[slot, which]
      return plgpu.load(ref if half is None else ref.at[_half_rows(half, bq)], layout=col)

    def probs_t(s, i, slot, masked: bool, lse=None, half=None):
      """k.q (transposed tile) -> (P^T, G^T): P^T is exactly 0 where the mask hides a logit,
      and G^T is the factor of dS^T = G^T (dP^T - D): P^T, or with a softcap P^T (1 - t^2)
      formed here, so that tanh's tile t does not stay live until dS^T (32 registers a
      thread: the causal softcap consumer spilled 652 bytes with it; NOTES, session 28).
      ``lse``: the step's lse when already read (``st.early_stats``). ``half``: the tile is
      query half 0 or 1 of the step (``st.masked_halves``)."""
      tshape = shape if half is None else half_shape
      s2, t = _logits2(s, st)
      lse = row_stat(slot, 0, half) if lse is None else lse
      lse2 = lax.broadcast_in_dim(lse, tshape, [1])
      pt = jnp.exp2(s2 - lse2)
      if masked:
        qseg_ref = qseg_smem.at[slot] if st.has_segments else None
        if half is not None and qseg_ref is not None:
          qseg_ref = qseg_ref.at[_half_rows(half, bq)]
        mask = transposed_tile_mask(
            k_start=k_start, q_start=i * bq + (0 if half is None else half * (bq // 2)),
            kv_len=kv_len, qseg_ref=qseg_ref, kv_seg=kv_seg if half is None else kv_seg_half,
            shape=tshape, st=st)
        pt = jnp.where(mask, pt, 0.0)
      return pt, (pt if t is None else pt * (1.0 - t * t))

    def grad_logits_t(gt, dpt, slot, delta=None, half=None, centred=False):
      """dS^T = G^T (dP^T - D) in the matmul dtype. D (16 registers a thread as a column
      broadcast) is read from SMEM here, after dP^T, rather than beside lse: live across the
      dV issue it pushed the consumer over its registers. And no mask: G^T is already 0
      wherever it would hide dS^T (dP^T and D are finite). Both cut ptxas's spills at H = 128
      (1x1024x2x128, CUDA 13.0): full 52 -> 16 bytes, causal 456 -> 164 (NOTES, session 28).
      ``delta``: D when already read (``st.early_stats``); ``centred``: ``dpt`` is dP^T - D."""
      if not centred:
        delta = row_stat(slot, 1, half) if delta is None else delta
        delta = lax.broadcast_in_dim(delta, shape if half is None else half_shape, [1])
      return _grad_logits(gt, dpt, None if centred else delta, None, None, k_smem.dtype)

    def wait_inputs(slot):
      plgpu.barrier_wait(q_ready.at[slot])
      plgpu.barrier_wait(rows_ready.at[slot])
      if st.has_segments:
        plgpu.barrier_wait(rows_ready.at[stages + slot])   # every phase, masked step or not

    def step(n, i, carry, masked: bool):
      """Interpret form: one synchronous wgmma at a time, P^T and dS^T staged through SMEM
      (a masked step with ``halves``: each 64-query half in turn)."""
      dk, dv = carry
      refill(base + n * per_head_ + pos(i))
      slot = lax.rem(base + n * per_head_ + pos(i), stages)
      wait_inputs(slot)
      for h in ((0, 1) if masked and halves else (None,)):
        q_op, do_op = (r.at[slot] if h is None else r.at[slot, _half_rows(h, bq)]
                       for r in (q_smem, do_smem))
        staging = pt_smem if h is None else pt_smem.at[:, _half_rows(0, bq)]
        pt, gt = probs_t(_product(k_smem, q_op.transpose((1, 0)),
                                  shape if h is None else half_shape), i, slot, masked, half=h)
        if h != 1:
          plgpu.barrier_wait(do_ready.at[slot])
        dv = _matmul_acc(dv, pt.astype(k_smem.dtype), do_op, staging, registers=st.registers_pv)
        dpt = _product(v_smem, do_op.transpose((1, 0)), shape if h is None else half_shape)
        if h != 0:
          release_do(slot)
        dst = grad_logits_t(gt, dpt, slot, half=h)
        dk = _matmul_acc(dk, dst, q_op, staging, registers=st.registers_pv)
        if fdq is not None:
          fdq.step(n * per_head_ + (i - lo_), dst)
      release_q(slot)
      return dk, dv

    def step_async(n, i, accs, masked: bool):
      """Compiled form: S^T = K Q^T and dP^T = V dO^T issued back to back and P^T computed
      while the tensor cores run dP^T; then dV += P^T dO is issued before dS^T is computed, and
      dK += dS^T Q after it, so the ALU work of each half hides behind a matmul (FA3 Section
      3.3). The accumulators stay in place across the loop."""
      dk_acc, dv_acc = accs
      step_no = base + n * per_head_ + pos(i)
      slot = lax.rem(step_no, stages)
      wait_inputs(slot)
      plgpu.barrier_wait(do_ready.at[slot])
      # (bwd_turns) the wait stays between the accumulators' zeros and the wgmmas: moved
      # before the zeros (349 instructions a step against 366, no spills) the dK/dV kernel was
      # 1-2% slower (H100, session 47), the zeros and lse loads then following the wait.
      turn_begin, turn_end = (consumer_turns(wg, step_no, tile_steps - 1) if turns
                              else (lambda: None, lambda: None))

      def scores(s_acc, dp_acc, half=None):
        """S^T, P^T, dV's issue, dP^T -> dS^T of the step, or of its query half ``half``."""
        q_op, do_op = operands(half)
        early = "" if masked else st.early_stats
        # "lse_pre": lse read before S^T is issued, so its loads do not queue behind the
        # operand reads of S^T and dP^T, which take the SMEM pipe's whole rate (the first FFMA
        # waited on them: Nsight Compute, session 42). "lse_pre+delta_acc": -D written into
        # dP^T's accumulator there too, so the wgmma returns dP^T - D (FA2 Algorithm 2 line
        # 16) and no FADD waits on D; before S^T's issue, as after it ptxas waited for S^T
        # (C7517: the registers were the previous step's dP^T, defined by a wgmma).
        lse = row_stat(slot, 0) if early.startswith("lse_pre") else None
        centred = early == "lse_pre+delta_acc"
        if centred:
          dp_acc[...] = lax.broadcast_in_dim(-row_stat(slot, 1), shape, [1])
        turn_begin()
        plgpu.wgmma(s_acc, k_op, q_op.transpose((1, 0)))
        plgpu.wgmma(dp_acc, v_op, do_op.transpose((1, 0)))
        turn_end()
        if not defer and half != 1:
          refill(step_no)             # (self-fed) while this step's S^T and dP^T run
        # "lse": read while S^T is in flight. After the wait, the FFMA of s * c - lse stalled
        # on each load (19% of the consumer's stall samples: Nsight Compute, session 30).
        if lse is None and "lse" in early:
          lse = row_stat(slot, 0)
        # (half 1: waits for half 0's dK as well, the last reader of its dS^T registers)
        s = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)
        if defer:     # the previous step's dV and dK wgmmas (older than S^T) are done too
          pl.when(step_no > 0)(lambda: release_step(lax.rem(step_no - 1, stages)))
          refill(step_no)             # (self-fed) after this consumer's own release of s - 1
        pt, gt = probs_t(s, i, slot, masked, lse, half)
        # "lse+delta_early": D read before dV's issue (ptxas had put it amid dV's wgmmas).
        delta = row_stat(slot, 1) if early.endswith("delta_early") else None
        if st.pt_smem:
          # P^T through SMEM: its 16 bf16 registers a thread are free again at once, where as
          # a register operand they stay live until this wgmma retires, across the dS^T maths
          # (the dK/dV consumer spilled there: benchmarks/NOTES.md, session 9). The previous
          # step's dV wgmma, the last reader of this tile, was retired before S^T was loaded.
          pt_smem[...] = pt.astype(k_smem.dtype)
          plgpu.commit_smem()
          plgpu.wgmma(dv_acc, pt_smem, do_op)
        else:
          plgpu.wgmma(dv_acc, pt.astype(k_smem.dtype), do_op)
        # dP^T was issued before dV: waiting down to one group in flight finishes it.
        if delta is None and early in ("lse+delta", "lse+delta_early"):
          delta = row_stat(slot, 1)
        dpt = plgpu.wgmma_accumulator_load(dp_acc, wait_n=1)
        return grad_logits_t(gt, dpt, slot, delta, half, centred=centred)

      def operands(half):
        """The step's Q and dO tiles, or their query half ``half``."""
        return tuple(r.at[slot] if half is None else r.at[slot, _half_rows(half, bq)]
                     for r in (q_smem, do_smem))
      if masked and halves:
        # Two 64-query halves (``st.masked_halves``): the 64-wide kernel's step twice, so the
        # masked steps need the registers of that kernel (S^T, dP^T [64, 64], not [64, 128]).
        for h in range(2):
          acc = plgpu.ACC(half_shape, jnp.float32)
          dst = pl.run_scoped(functools.partial(scores, half=h), acc, acc)
          plgpu.wgmma(dk_acc, dst, operands(h)[0])
        plgpu.wgmma_wait(1)                     # dV done: dO's slot can be refilled
        release_do(slot)
        plgpu.wgmma_wait(0)
        release_q(slot)
        return accs
      acc = plgpu.ACC(shape, jnp.float32)
      dst = pl.run_scoped(scores, acc, acc)
      issue_dk = lambda: plgpu.wgmma(dk_acc, dst, q_smem.at[slot])
      if fdq is None:
        issue_dk()
      else:
        fdq.step(step_no, dst, issue_dk)
      if not defer:
        plgpu.wgmma_wait(1)                     # dV done: dO's slot can be refilled
        release_do(slot)
        plgpu.wgmma_wait(0)
        release_q(slot)
      return accs

    def release_step(slot):
      release_do(slot)
      release_q(slot)

    if st.registers_pv:
      def run(dk_acc, dv_acc):
        def per_group_head(n, accs):
          return _visit(lo_, lo_full_, hi_full_, hi_, lambda i, c, m: step_async(n, i, c, m), accs,
                        st, free_first and span is None)
        lax.fori_loop(0, st.groups, per_group_head, (dk_acc, dv_acc))
        if defer:
          plgpu.wgmma_wait(0)
          steps = st.groups * per_head_
          pl.when(steps > 0)(lambda: release_step(lax.rem(steps - 1, stages)))
        return dk_acc[...], dv_acc[...]
      acc = plgpu.ACC((bkv, k_smem.shape[-1]), jnp.float32)
      dk, dv = pl.run_scoped(run, acc, acc)
    else:
      zeros = plgpu.layout_cast(jnp.full((bkv, k_smem.shape[-1]), 0.0, jnp.float32),
                                plgpu.Layout.WGMMA)

      def per_group_head(n, carry):
        return _visit(lo_, lo_full_, hi_full_, hi_, lambda i, c, m: step(n, i, c, m), carry, st,
                      free_first and span is None)
      dk, dv = lax.fori_loop(0, st.groups, per_group_head, (zeros, zeros))
    if fdq is not None:
      fdq.finish(st.groups * per_head_)
    drain_ring()
    if part is not None:
      own = pl.ds(wg * bkv, bkv)
      dk_ref.at[cta, part, own][...] = dk * st.scale
      dv_ref.at[cta, part, own][...] = dv
      return
    k_smem[...] = (dk * st.scale).astype(k_smem.dtype)
    v_smem[...] = dv.astype(v_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[batch, keys, kv_head])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[batch, keys, kv_head])

  live = True
  if main_tiles:          # (bwd_stream_tail) the grid's tail CTAs: a separate launch runs them
    heads, kv_tiles, _ = grid_tiles
    live = tile + kv_tiles * (kv_head + heads * batch) < main_tiles     # _decode_tile's order

  @pl.when((wg < COMPUTE_WGS) & live)
  def _consumer():
    if not self_fed:
      plgpu.set_max_registers(st.consumer_registers, action="increase")
    else:                       # two warpgroups, ptxas's own allocation (<= 255); fill the ring
      @pl.when(wg == 0)
      def _prologue():
        @pl.loop(0, jnp.minimum(tile_steps, stages))
        def _fill(i):
          self_fetch(i)
    if not persist:
      k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
      plgpu.copy_gmem_to_smem(k_ref.at[kv_batch, tile_keys(tile), kv_head], k_smem,
                              kv_ready.at[3 * wg])
      plgpu.copy_gmem_to_smem(v_ref.at[kv_batch, tile_keys(tile), kv_head], v_smem,
                              kv_ready.at[3 * wg + 1])
      plgpu.barrier_wait(kv_ready.at[3 * wg])
      plgpu.barrier_wait(kv_ready.at[3 * wg + 1])
      consume(kv_batch, kv_head, tile, k_smem, v_smem, 0)
      st.wait_stores()
      return

    def load_kv(t, buf):
      b, h, kt = decode(t)
      for j, (src, dst) in enumerate(((k_ref, k_smem2), (v_ref, v_smem2))):
        plgpu.copy_gmem_to_smem(src.at[b, tile_keys(kt), h], dst.at[buf, wg],
                                kv_ready.at[4 * wg + 2 * buf + j])

    def wait_kv(buf):
      plgpu.barrier_wait(kv_ready.at[4 * wg + 2 * buf])
      plgpu.barrier_wait(kv_ready.at[4 * wg + 2 * buf + 1])
    if tail is not None:
      # The tail's parts: as persistent_consumer_loop, over Q block spans of their own.
      pl.when(my_tiles > 0)(lambda: load_kv(tail_item(0)[0], 0))

      def part_body(j, base):
        flat, lo_j, hi_j, part = tail_item(j)
        buf = lax.rem(j, 2)
        wait_kv(buf)
        pl.when(j + 1 < my_tiles)(lambda: load_kv(tail_item(j + 1)[0], 1 - buf))
        consume(*decode(flat), k_smem2.at[buf, wg], v_smem2.at[buf, wg], base,
                span=(lo_j, hi_j), part=part)
        return base + st.groups * (hi_j - lo_j)
      lax.fori_loop(0, my_tiles, part_body, jnp.int32(0))
      st.wait_stores()
      return
    persistent_consumer_loop(
        cta=cta, num_ctas=num_ctas, my_tiles=my_tiles, load=load_kv, wait=wait_kv,
        consume=lambda t, buf, it: consume(*decode(t), k_smem2.at[buf, wg], v_smem2.at[buf, wg],
                                           it * tile_steps))
    st.wait_stores()

  if self_fed:                  # (no producer warpgroup in the launch)
    return

  @pl.when((wg == COMPUTE_WGS) & live)
  def _producer():
    plgpu.set_max_registers(producer_registers(st), action="decrease")
    if before_loads is not None:
      before_loads()
    locate = None
    if persist and tail is not None:
      # Ring step -> (batch, K/V head, step within the part, its first Q block, its blocks).
      span = lambda j: tail_item(j)[2] - tail_item(j)[1]
      first = st.groups * span(0)
      parts_steps = (jnp.where(my_tiles > 0, first, 0)
                     + jnp.where(my_tiles > 1, st.groups * span(1), 0))

      def locate(step):
        j = (step >= first).astype(jnp.int32)
        flat, lo_j, hi_j, _ = tail_item(j)
        b, h, _ = decode(flat)
        return b, h, step - j * first, lo_j, hi_j - lo_j
    elif persist:
      def locate(step):      # ring step -> (batch, K/V head, step within the tile)
        b, h, _ = decode(cta + lax.div(step, tile_steps) * num_ctas)
        return b, h, lax.rem(step, tile_steps)
    fetch = q_block_fetcher((q_ref, do_ref, rows_ref, q_seg_ref),
                            (q_smem, do_smem, rows_smem, qseg_smem), (q_ready, do_ready, rows_ready),
                            batch=batch, kv_head=kv_head, lo=lo, per_head=per_head, st=st,
                            locate=locate, rotate=rotate)
    if persist and tail is not None:
      produce(parts_steps, stages, fetch, waits)
    elif persist:
      produce(my_tiles * tile_steps, stages, fetch, waits)
    elif st.dq_writer and fdq is not None:
      fdq.writer_loop(fetch, waits, st.groups * per_head, stages)
    else:
      produce(st.groups * per_head, stages, fetch, waits)


# ----------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------

def dkdv_cta(meta_ref, meta_smem, meta_ready, *, num_q_blocks: int, loader: int = COMPUTE_WGS,
             coords=None):
  """(batch, K/V head, K/V tile, warpgroup, (lo, lo_full, hi_full, hi, kv_len)) of a dK/dV
  CTA on the (heads, kv_seq, batch) grid (or at ``coords``): its Q blocks [lo, hi) per group
  head. ``loader``: the warpgroup that loads the CTA's record (the producer; consumer 0 when
  self-fed)."""
  batch, kv_head, tile = coords or (lax.axis_index("batch"), lax.axis_index("heads"),
                                    lax.axis_index("kv_seq"))
  wg = lax.axis_index("wg")
  ranges = tile_ranges(meta_ref, meta_smem, meta_ready, wg=wg, batch=batch, tile=tile,
                       full=num_q_blocks, producer=loader)
  return batch, kv_head, tile, wg, ranges


def q_block_fetcher(gmem, smem, ready, *, batch, kv_head, lo, per_head, st: Statics,
                    locate=None, rotate=None):
  """A dK/dV producer's ``fetch(step)``: step s visits group head ``s // per_head`` and Q block
  ``lo + s % per_head``; it TMA-loads that block's Q, dO, its L2 / D record ([2, block_q], one
  copy) and, with segment ids, its query segment ids into ring slot ``s % num_stages``.
  ``locate(s) -> (batch, kv_head, step within the tile)`` (the persistent form) replaces the
  fixed ``batch`` and ``kv_head``; with two more entries, (first Q block, blocks per head) of
  a tail part replace ``lo`` and ``per_head``. ``rotate``: a head's blocks visited from
  ``lo + rotate`` on, wrapping round (``Config.bwd_free_first``)."""
  q_ref, do_ref, rows_ref, q_seg_ref = gmem
  q_smem, do_smem, rows_smem, qseg_smem = smem
  q_ready, do_ready, rows_ready = ready
  stages, bq = st.num_stages, st.block_q

  def fetch(step):
    slot = lax.rem(step, stages)
    where = (batch, kv_head, step) if locate is None else locate(step)
    b, kvh, local = where[:3]
    first, blocks = (lo, per_head) if len(where) == 3 else where[3:]   # (a tail part's own)
    head = kvh * st.groups + lax.div(local, jnp.maximum(blocks, 1))
    within = lax.rem(local, jnp.maximum(blocks, 1))
    if rotate is not None:
      within = lax.rem(within + rotate, jnp.maximum(blocks, 1))
    rows = pl.ds((first + within) * bq, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, head], q_smem.at[slot], q_ready.at[slot])
    plgpu.copy_gmem_to_smem(do_ref.at[b, rows, head], do_smem.at[slot], do_ready.at[slot])
    plgpu.copy_gmem_to_smem(rows_ref.at[b, head, :, rows], rows_smem.at[slot],
                            rows_ready.at[slot])
    if st.has_segments:
      plgpu.copy_gmem_to_smem(q_seg_ref.at[b, rows], qseg_smem.at[slot],
                              rows_ready.at[stages + slot])
  return fetch


def _visit(lo, lo_full, hi_full, hi, step, carry, st: Statics, free_first: bool = False):
  """Masked blocks at both ends of [lo, hi), mask-free ones in [lo_full, hi_full); with
  ``free_first`` the mask-free ones, the masked high end, then the masked low end (the order
  [lo, hi) rotated by lo_full - lo: ``q_block_fetcher``'s ``rotate``)."""
  if not st.any_mask:
    return lax.fori_loop(lo, hi, lambda j, c: step(j, c, False), carry)
  if free_first:
    carry = lax.fori_loop(lo_full, hi_full, lambda j, c: step(j, c, False), carry)
    carry = lax.fori_loop(hi_full, hi, lambda j, c: step(j, c, True), carry)
    return lax.fori_loop(lo, lo_full, lambda j, c: step(j, c, True), carry)
  carry = lax.fori_loop(lo, lo_full, lambda j, c: step(j, c, True), carry)
  carry = lax.fori_loop(lo_full, hi_full, lambda j, c: step(j, c, False), carry)
  return lax.fori_loop(hi_full, hi, lambda j, c: step(j, c, True), carry)


def dkdv_scratch(*, st: Statics, head_dim: int, dtype, has_meta: bool, fused_dq: bool = False,
                 persistent: bool = False):
  bq, bkv, stages = st.block_q, st.block_kv, st.num_stages
  writer = fused_dq and st.dq_writer
  lag = fused_dq and st.dq_lag and not writer
  kv = (2, COMPUTE_WGS, bkv, head_dim) if persistent else (COMPUTE_WGS, bkv, head_dim)
  smem = (
      plgpu.SMEM(kv, dtype, transforms=_TILED),                                 # K, then dK
      plgpu.SMEM(kv, dtype, transforms=_TILED),                                 # V, then dV
      plgpu.SMEM((stages, bq, head_dim), dtype, transforms=_TILED),             # Q ring
      plgpu.SMEM((stages, bq, head_dim), dtype, transforms=_TILED),             # dO ring
      plgpu.SMEM((stages, 2, bq), jnp.float32),                                 # L2, D ring
      plgpu.SMEM((8,), jnp.int32) if has_meta else None,
      plgpu.SMEM((COMPUTE_WGS, bkv), jnp.int32) if st.has_segments else None,
      plgpu.SMEM((stages, bq), jnp.int32) if st.has_segments else None,
      None if st.registers_pv and not st.pt_smem else plgpu.SMEM((COMPUTE_WGS, bkv, bq), dtype,
                                                                 transforms=_TILED),  # P^T
      # Fused dQ: dS^T of both consumers, double-buffered, and each consumer's fp32 partial.
      plgpu.SMEM((2, COMPUTE_WGS, bkv, bq), dtype, transforms=_TILED) if fused_dq else None,
      # (the dQ writer's two chunk slots have the same shape: [block_q, 64] each)
      plgpu.SMEM((COMPUTE_WGS, bq, 64 if writer else dq_width(head_dim)), jnp.float32,
                 transforms=_TILED_F32) if fused_dq else None,
  )
  bars = (
      plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=2 * stages),                                  # L2/D (+ q seg)
      # per-WG K, V, seg; persistent: K, V of each of the two buffers
      plgpu.Barrier(num_barriers=(4 if persistent else 3) * COMPUTE_WGS),
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=COMPUTE_WGS) if fused_dq and not writer else None,  # rendezvous
      # dS^T ready / free (the writer; or the consumers' lagged dQ, each reading both buffers)
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=2) if writer or lag else None,
      plgpu.Barrier(num_arrivals=COMPUTE_WGS if lag else 1, num_barriers=2)
      if writer or lag else None,
  )
  return smem, bars

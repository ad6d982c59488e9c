"""FlashAttention-3 forward kernel body for the Pallas Mosaic GPU backend (Hopper, sm90).

One CTA computes ``2 * block_q`` query rows of one (batch, head) with three warpgroups
(FA3, Shah et al. 2024, Section 3.1):

* warpgroup 2, the *producer*, issues TMA copies of the K/V blocks the tile can see into a ring of
  ``num_stages`` shared-memory slots; a slot is refilled once both consumers have released it
  (``k_free`` / ``v_free`` barriers, two arrivals each);
* warpgroups 0 and 1, the *consumers*, each own ``block_q`` rows. Per K/V block: S = Q K^T with
  wgmma (Q and K in SMEM), mask, online softmax in registers (exp2 with the scale folded in), then
  O += P V with wgmma. A shared ``turns`` barrier makes the two consumers take turns on the
  tensor cores, so one warpgroup's softmax overlaps the other's matmuls (FA3 "ping-pong",
  Section 3.1, Fig. 1).

Online softmax (FA2 Alg. 1 / FA3 Alg. 1), base 2: with s = log2(e) * scale * q.k,
  m_j = max(m_{j-1}, rowmax(S_j)),  P_j = 2^(S_j - m_j),  l_j = 2^(m_{j-1} - m_j) l_{j-1} + rowsum(P_j),
  O_j = 2^(m_{j-1} - m_j) O_{j-1} + P_j V_j;  out = O / l,  lse = (m + log2 l) ln 2.
Normalisation is deferred to the end; rows that see no key give out = 0 and lse = -inf.

Two forms of the P V step (``Statics.registers_pv``):
* compiled (True): P stays in registers as wgmma's A operand and O is rescaled and accumulated in
  place in the wgmma accumulator (``pl.run_state`` with ``plgpu.ACC.init``), as FA3 does;
* interpret mode (False): JAX 0.11.2's Mosaic GPU interpreter has neither register operands for
  wgmma nor ``run_state`` accumulators, so P goes through shared memory and each block's P V
  lands in a fresh accumulator that is added to O in registers. Same maths, same masks, same
  pipeline and barriers; only where P and O live differs.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import masks
from pallas_attn.mosaic import fastexp, overlap, schedule, stream_tail
from pallas_attn.mosaic.operands import p_as_8bit_operand, q_operands
# The rings, their producer loops, the hardware barriers and the tile ranges live in ring.py
# (shared with the backward kernels); re-exported here, where they were first written.
from pallas_attn.mosaic.ring import (  # noqa: F401  pylint: disable=unused-import
    COMPUTE_WGS, FREE_BAR, META_LEN, SCHEDULE_BAR, WG_THREADS, computed_tile_ranges, free_bar,
    kv_fetcher, named_barrier, produce, produce_rings, schedule_bar, slot_releases,
    split_kv_fetchers, tile_ranges)
# The forward's shared-memory buffers and barriers (and their byte count) live in
# fwd_scratch.py; re-exported here for ops.py and the tests.
from pallas_attn.mosaic.fwd_scratch import (  # noqa: F401  pylint: disable=unused-import
    O_CHUNK, scratch_types, smem_bytes)

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# setmaxnreg split of the forward per number of consumers: (consumer, producer) registers a
# thread. The launch gives every thread 65536 / threads (168 with 3 warpgroups, 128 with 4,
# rounded down to 8), and the split must stay within that pool: 2 x 232 + 40 = 3 x 168;
# 3 x 160 + 32 = 4 x 128 (FA3's split for three consumer warpgroups).
FWD_REGISTERS = {2: (232, 40), 3: (160, 32)}


@dataclasses.dataclass(frozen=True)
class Statics:
  """Static parameters of one forward kernel (hashable)."""
  scale: float
  softcap: float | None
  spec: masks.MaskSpec
  has_kv_len: bool
  has_segments: bool
  groups: int                   # query heads per K/V head
  block_q: int                  # rows per consumer warpgroup
  block_kv: int
  num_stages: int
  num_kv_blocks: int            # padded S / block_kv
  registers_pv: bool
  overlap: bool = False         # intra-warpgroup overlap (FA3 Section 3.2); needs registers_pv
  fold_scale: bool = False      # max on raw logits, one FMA per element for 2^(c s - m)
  named_barriers: bool = False  # ping-pong on hardware named barriers; compiled only
  early_k_wait: bool = False    # wait for the next K block inside the P V wgmma scope
  pin_softmax: bool = False     # optimization_barrier: softmax + O rescale before the turn
  named_free: bool = False      # K/V slot releases on hardware barriers (compiled only)
  computed_ranges: bool = False  # [lo, hi) from the tile index (position-only masks), no TMA
  seq_q: int = 0                # real T and S (computed_ranges only)
  seq_k: int = 0
  persistent: bool = False      # num_ctas CTAs loop over the num_tiles (batch, head, q) tiles
  num_ctas: int = 0
  num_tiles: int = 0
  dynamic: bool = False         # persistent: tiles claimed from a global counter (schedule.py)
  atomic_counter: bool = False  # dynamic: the counter's fetch-add (compiled); else round-robin
  defer_wait: bool = False      # backward (compiled): a step's last wgmma is waited in the next
  consumer_registers: int = 232  # backward: registers a consumer thread takes (setmaxnreg); the
                                 # producer gets what is left (40 at 232, 24 at 240)
  pt_smem: bool = False         # dK/dV (compiled): dV += P^T dO reads P^T from SMEM, not registers
  dq_writer: bool = False       # fused dQ: the producer warpgroup computes dQ from the consumers'
                                # dS^T (no consumer rendezvous); consumers at 224 registers
  dq_lag: bool = False          # fused dQ: each consumer's dQ runs one step behind (no meeting)
  consumers: int = COMPUTE_WGS  # forward: consumer warpgroups (2, or 3: 192-row CTA tiles)
  poly_cols: int = 0            # forward: unmasked blocks' columns exponentiated on the FMA pipe
  sum_in_pv: bool = False       # forward: P's row sum computed after the P V wgmma is issued
  o_chunked: bool = False       # persistent forward: O stored through two [block_q, 64] slots
                                # per consumer instead of a whole [block_q, H] buffer
  stream_tail: bool = False     # persistent unmasked forward: the last partial wave's tiles cut
                                # along the keys (stream_tail.py)
  q_regs_cols: int = 0          # forward (compiled): Q's first this many columns are S = Q K^T's
                                # A operand from registers (loaded once per tile), not SMEM
  qdo_regs: bool = False        # dQ kernel (compiled): Q and dO as register A operands of S, dP
  kv_regs: str = ""             # dK/dV kernel (compiled): "k", "v" or "kv" as register A operands
  early_stats: str = ""         # dK/dV kernel (compiled): Config.bwd_early_stats
  masked_halves: bool = False   # dK/dV kernel: masked 128-query steps as two 64-query halves
  free_first: bool = False      # dK/dV grid kernel: a tile's mask-free Q blocks visited first
  v_stages: int = 0             # V ring depth where it differs from K's (0: the same): the dQ
                                # kernel's shallower V ring, the forward's ``Config.v_stages``
  dq_serial: bool = False       # dQ kernel (compiled): S waited for, P computed, then dP issued
  dq_delta_acc: bool = False    # dQ kernel (compiled): dP's accumulator starts from -D
  delta_in_dq: bool = False     # dQ kernel: D = rowsum(dO * O) for its rows, written with lse
  exit_read_only: bool = False  # compiled: the final TMA-store wait is for SMEM reads only
  turns: bool = False           # grid dK/dV (compiled, unmasked): S^T, dP^T issued in turn

  def wait_stores(self) -> None:
    """The kernel's last wait for its TMA stores (``Config.exit_read_only``)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=self.exit_read_only)
  lazy_rescale: float = 0.0     # forward: keep stale row maxima until one grows by more (FA4)
  fp8: bool = False             # forward: Q, K, P and V (given transposed, [B, K, H, S]) in
                                # float8_e4m3fn, with per-query and per-key float32 scales
  fp8_k_block: bool = False     # FP8: the key scales are equal within each K block (block
                                # quantisation): one per block, read as a scalar

  @property
  def v_ring(self) -> int:
    """Slots of the V ring (the dQ kernel and the forward may run a V ring of another depth
    than the K ring's ``num_stages``)."""
    return self.v_stages or self.num_stages

  @property
  def any_mask(self) -> bool:
    return (not self.spec.is_trivial) or self.has_kv_len or self.has_segments


def heavy_first_tile(tile, *, n_tiles: int, st: Statics):
  """Query tile ``tile`` of a grid launch renumbered heaviest first. Under causal-like masks (a
  right bound) the last query tiles see the most keys; the grid launches its tiles in order,
  so starting those first lets the short tiles fill the grid's tail instead of a long one
  running alone at the end (forward: session 3; the dQ kernel: session 29, -4..-8% on long
  causal rows)."""
  return n_tiles - 1 - tile if st.spec.right is not None else tile


def _logits2(s, st: Statics):
  """q.k -> (x, c) with base-2 logits c * x: the scale (and softcap) folded into c.

  With ``st.fold_scale`` (and c > 0, so that max(c x) = c max(x)) the multiply by c is left to
  the softmax, where it fuses with the max subtraction into one FMA per element
  (2^(c x - m), FA3 Section 3.1: the non-matmul FLOPs are what the tensor cores wait for);
  otherwise x is returned already scaled and c is None.
  """
  if st.softcap is None:
    x, c = s, st.scale * LOG2E
  else:
    x, c = jnp.tanh(s * (st.scale / st.softcap)), st.softcap * LOG2E
  if st.fold_scale and c > 0:
    return x, c
  return x * c, None


def _mask(q_start, k_start, kv_len, q_seg, kv_seg, st: Statics):
  """Visibility of a [block_q, block_kv] tile, in the wgmma accumulator layout."""
  shape = (st.block_q, st.block_kv)
  q_pos = q_start + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
  k_pos = k_start + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
  mask = masks.position_mask(q_pos, k_pos, st.spec)
  if st.has_kv_len:
    mask = masks.and_masks(mask, k_pos < kv_len)
  if st.has_segments:
    mask = masks.and_masks(mask, lax.broadcast_in_dim(q_seg, shape, [0])
                           == lax.broadcast_in_dim(kv_seg, shape, [1]))
  return mask


def fwd_kernel(*refs, st: Statics, has_meta: bool):
  """Kernel body; ``refs`` = inputs (q, k, v[, meta][, q_seg, kv_seg][, q_scale, k_scale,
  v_scale]), outputs (o, lse), scratch."""
  refs = list(refs)
  q_ref, k_ref, v_ref = refs[:3]
  pos = 3
  meta_ref = q_seg_ref = kv_seg_ref = None
  if has_meta:
    meta_ref, pos = refs[pos], pos + 1
  if st.has_segments:
    q_seg_ref, kv_seg_ref, pos = refs[pos], refs[pos + 1], pos + 2
  scale_refs = None
  if st.fp8:
    scale_refs, pos = tuple(refs[pos:pos + 3]), pos + 3
  counter_ref = None
  if st.dynamic:
    counter_ref, pos = refs[pos], pos + 1
  o_ref, lse_ref = refs[pos], refs[pos + 1]
  parts_refs = None
  if st.stream_tail:                  # the tail parts' workspace (O_p, lse_p)
    parts_refs, pos = (refs[pos + 2], refs[pos + 3]), pos + 2
  smem, bars = refs[pos + 2], refs[pos + 3]
  _body(q_ref, k_ref, v_ref, meta_ref, q_seg_ref, kv_seg_ref, counter_ref, o_ref, lse_ref, smem,
        bars, st, scale_refs, parts_refs)


def _body(q_ref, k_ref, v_ref, meta_ref, q_seg_ref, kv_seg_ref, counter_ref, o_ref, lse_ref, smem,
          bars, st: Statics, scale_refs=None, parts_refs=None):
  (q_smem2, o_smem2, k_smem, v_smem, lse_smem2, meta_smem, qseg_smem2, kvseg_smem, p_smem2,
   sched_smem, qscale_smem2, kscale_smem, vscale_smem2) = smem
  (k_ready, v_ready, seg_ready, q_ready, meta_ready, k_free, v_free, turns, tile_ready,
   tile_free) = bars
  qs_ref, ks_ref, vs_ref = scale_refs or (None, None, None)
  wg = lax.axis_index("wg")
  bq, bkv, stages, v_ring = st.block_q, st.block_kv, st.num_stages, st.v_ring
  nc = st.consumers                    # consumer warpgroups; warpgroup nc is the producer
  n_tiles = -(-q_ref.shape[1] // (nc * bq))           # Q may end inside its last tile
  num_heads = q_ref.shape[2]

  def heavy_first(tile):
    return heavy_first_tile(tile, n_tiles=n_tiles, st=st)

  # Persistent launches number the tiles ("flat" indices) and give each CTA a sequence of them:
  # ``flat_of(i)`` is local tile i of a static deal, ``coords(flat)`` its (batch, head, tile).
  cta = lax.axis_index("sm") if st.persistent else None
  if st.persistent and st.spec.is_trivial:
    # One CTA per SM walks the (batch, head, tile) space with stride num_ctas, tile fastest, so
    # that the CTAs running together read the same heads' K/V (L2 reuse). Between tiles the
    # producer runs ahead into the next tile's K/V and the consumers prefetch the next Q while
    # they write O: no CTA launch, Q latency or pipeline fill per tile.
    num_local = lax.div(st.num_tiles - 1 - cta, jnp.int32(st.num_ctas)) + 1
    flat_of = lambda i: cta + i * st.num_ctas
    if st.stream_tail:    # whole tiles for R rounds, then one or two parts of the tail
      num_local, tail_item = stream_tail.kernel_items(cta, stream_tail.Tail(
          st.num_tiles, st.num_ctas, st.num_kv_blocks))
      flat_of = lambda i: tail_item(i)[0]

    def coords(flat):
      bh, tile = lax.div(flat, jnp.int32(n_tiles)), lax.rem(flat, jnp.int32(n_tiles))
      return lax.div(bh, jnp.int32(num_heads)), lax.rem(bh, jnp.int32(num_heads)), tile
  elif st.persistent:
    # Masked: tiles differ in length (up to n_tiles-fold for causal). Number them batch
    # slowest, then rank (heaviest first), head fastest (not the grid's launch order, which is
    # batch fastest, then tiles, then heads: ops._grid), so that the tiles running together
    # read one batch's K/V from L2. (Rank before batch spread each wave over every batch's
    # K/V, more than L2 holds at 16x1024x16x128.)
    # ``st.dynamic``: each CTA claims its next tile from a global counter (schedule.py).
    # Otherwise deal each round of num_ctas tiles in alternating directions ("snake"), so every
    # CTA's total stays close; a static deal still leaves SMs idle.
    ctas = st.num_ctas
    rounds, rest = divmod(st.num_tiles, ctas)
    extra = cta < rest if rounds % 2 == 0 else cta >= ctas - rest
    num_local = rounds + extra.astype(jnp.int32)
    flat_of = lambda i: i * ctas + jnp.where(lax.rem(i, 2) == 0, cta, ctas - 1 - cta)
    per_batch = n_tiles * num_heads

    def coords(flat):
      batch, r = lax.div(flat, jnp.int32(per_batch)), lax.rem(flat, jnp.int32(per_batch))
      return (batch, lax.rem(r, jnp.int32(num_heads)),
              heavy_first(lax.div(r, jnp.int32(num_heads))))
  else:
    num_local = flat_of = None
    coords = lambda _: (lax.axis_index("batch"), lax.axis_index("heads"),
                        heavy_first(lax.axis_index("q_seq")))
  queue = dict(slots=sched_smem, ready=tile_ready, free=tile_free)

  def tile_loop(tile_body):
    """Runs ``tile_body(i, flat, base) -> (base, next_flat)`` over this CTA's tiles; ``base``
    counts the K/V blocks consumed before tile i (the ring position). Returns the final base
    and the number of tiles run."""
    if not st.persistent:
      return tile_body(0, jnp.int32(0), jnp.int32(0))[0], 1
    if st.dynamic:
      def body(carry):
        i, flat, base = carry
        base, nxt = tile_body(i, flat, base)
        return i + 1, nxt, base
      i, _, base = lax.while_loop(lambda c: c[1] < st.num_tiles, body,
                                  (jnp.int32(0), cta, jnp.int32(0)))
      return base, i
    base = lax.fori_loop(0, num_local, lambda i, base: tile_body(i, flat_of(i), base)[0],
                         jnp.int32(0))
    return base, num_local

  def ranges(batch, tile, i=None):
    """(lo, lo_full, hi_full, hi, kv_len): blocks [lo, hi) are visited, [lo_full, hi_full)
    need no mask (masks.kv_block_ranges on the CTA's 2 * block_q rows). ``st.stream_tail``:
    local item ``i``'s key span (the whole row, or a tail part's; nothing is masked)."""
    if st.stream_tail:
      _, lo, hi, _ = tail_item(i)
      return lo, lo, hi, hi, None
    if st.computed_ranges:
      return computed_tile_ranges(tile, st)
    return tile_ranges(meta_ref, meta_smem, meta_ready, wg=wg, batch=batch, tile=tile,
                       full=st.num_kv_blocks, producer=nc)

  def schedule_barrier():
    plgpu.barrier_arrive(turns)
    plgpu.barrier_wait(turns)

  # The consumers' turns on the tensor cores. ``turn_end`` after issuing Q K^T, ``turn_begin``
  # before issuing P V. Named hardware barriers (FA3 Section 3.1): a consumer signals the next
  # one's barrier (``bar.arrive``, non-blocking; consumer nc - 1 signals consumer 0) and waits
  # on its own (``bar.sync``), so none waits for another to reach the same point; the mbarrier
  # fallback is a symmetric rendezvous of two. ``turn_begin(wait_v)`` also waits for the V block
  # (``wait_v``) before the turn starts. Consumers 1 .. nc - 1 start one turn late (each waits
  # for the one before it), and consumers 0 .. nc - 2 end with one signal more than they
  # wait, so every barrier sees as many arrives as syncs.
  sched = schedule_bar(nc)
  if st.named_barriers:
    turn_end = lambda: named_barrier("arrive", sched + lax.rem(wg + 1, nc), 2 * WG_THREADS)
    sync = lambda: named_barrier("sync", sched + wg, 2 * WG_THREADS)

    def turn_begin(wait_v):
      wait_v()
      sync()
    first_turn_wait, last_turn_signal = sync, turn_end
  elif nc != 2:
    # No ping-pong (interpret mode, or named_barriers off, with three consumers): the turns
    # only order the tensor-core work, the results do not depend on them.
    turn_end = first_turn_wait = last_turn_signal = lambda: None
    turn_begin = lambda wait_v: wait_v()
  else:
    turn_end = schedule_barrier

    def turn_begin(wait_v):
      plgpu.barrier_arrive(turns)
      wait_v()
      plgpu.barrier_wait(turns)
    first_turn_wait = last_turn_signal = schedule_barrier
  early_k_wait = st.early_k_wait and not st.overlap

  (release_k, release_v), (wait_k_free, wait_v_free) = slot_releases(
      (k_free, v_free), st, stages=(stages, v_ring))

  consumer_regs, producer_regs = FWD_REGISTERS[nc]

  @pl.when(wg < nc)
  def _consumer():
    plgpu.set_max_registers(consumer_regs, action="increase")
    q_smem = q_smem2.at[wg]
    # Without persistence O is staged in Q's buffer (Q is dead by then; saves SMEM at H=256).
    o_smem = q_smem if o_smem2 is None else o_smem2.at[wg]

    def load_q(flat):
      batch, head, tile = coords(flat)
      q_start = tile * (nc * bq) + wg * bq
      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_start, bq), head], q_smem, q_ready.at[wg])
      if st.fp8:      # the rows' scales travel with Q (prefetched a tile ahead when persistent)
        plgpu.copy_gmem_to_smem(qs_ref.at[batch, head, pl.ds(q_start, bq)], qscale_smem2.at[wg],
                                q_ready.at[2 * nc + wg])
    load_q(cta)

    def tile_body(i, flat, base):
      """Local tile i (``flat`` in the persistent numbering); ``base`` = K/V blocks this CTA
      consumed before it (ring position). Returns the new base and the next tile's number."""
      batch, head, tile = coords(flat)
      lo, lo_full, hi_full, hi, kv_len = ranges(batch, tile, i)
      q_start = tile * (nc * bq) + wg * bq
      q_seg = None
      if st.has_segments:
        plgpu.copy_gmem_to_smem(q_seg_ref.at[batch, pl.ds(q_start, bq)], qseg_smem2.at[wg],
                                q_ready.at[nc + wg])
        plgpu.barrier_wait(q_ready.at[nc + wg])
        q_seg = plgpu.load(qseg_smem2.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
      q_scale = None
      if st.fp8:
        # V's per-channel scales of this tile's K/V head, for O at the end: copied now, waited
        # for after the loop (the previous tile's epilogue read the buffer before its
        # commit_smem, which orders those reads before this copy).
        plgpu.copy_gmem_to_smem(vs_ref.at[batch, lax.div(head, jnp.int32(st.groups))],
                                vscale_smem2.at[wg], q_ready.at[3 * nc + wg])
        # FP8: the rows' dequantisation scales (one per query row), folded into S below; copied
        # with Q by load_q (issued here instead, they cost a TMA round trip at every tile's
        # start).
        plgpu.barrier_wait(q_ready.at[2 * nc + wg])
        q_scale = plgpu.load(qscale_smem2.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
      plgpu.barrier_wait(q_ready.at[wg])
      # Ring positions count every K/V block this CTA consumed; K and V may differ in depth.
      slot_of = lambda j: lax.rem(base + j - lo, stages)
      v_slot_of = lambda j: lax.rem(base + j - lo, v_ring)
      q_parts = q_operands(q_smem, st.q_regs_cols)

      row = plgpu.layout_cast(jnp.full((bq,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      acc = plgpu.layout_cast(jnp.full((bq, q_smem.shape[-1]), 0.0, jnp.float32),
                              plgpu.Layout.WGMMA)
      carry = (acc, row - jnp.inf, row)

      # Consumer w > 0 starts one turn after consumer w - 1: from then on they take turns on
      # the tensor cores.
      pl.when(wg > 0)(first_turn_wait)
      if early_k_wait:
        # The first K block; each later one is waited inside the previous step's P V scope.
        @pl.when(hi > lo)
        def _():
          plgpu.barrier_wait(k_ready.at[slot_of(lo)])

      def logits(s, j, slot, masked: bool):
        """Base-2 logits (x, c) of K/V block j (ring slot ``slot``) with its mask applied."""
        fold_q, row_scale = False, q_scale
        if st.fp8:
          # S = (Q8 K8^T) * s_q s_k on the e4m3 codes (FA3 Section 3.3; the key scales came
          # with K). With c > 0 folded into the softmax's FMA, s_q > 0 joins c (c_i = c s_q,i).
          if st.fp8_k_block:            # one key scale a block: a factor per row, s_q,i s_k
            row_scale = q_scale * kscale_smem[slot, 0]
          else:
            k_scale = plgpu.load(kscale_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
            s = s * lax.broadcast_in_dim(k_scale, s.shape, [1])
          fold_q = st.fold_scale and st.softcap is None and st.scale > 0
          if not fold_q:
            s = s * lax.broadcast_in_dim(row_scale, s.shape, [0])
        s, c = _logits2(s, st)
        if fold_q:
          c = row_scale * c                             # a row vector: see _times_c
        if st.has_segments:
          # Waited on every step, masked or not: a barrier's phase advances once per fill.
          plgpu.barrier_wait(seg_ready.at[slot])
        if masked:
          kv_seg = None
          if st.has_segments:
            kv_seg = plgpu.load(kvseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
          mask = _mask(q_start, j * bkv, kv_len, q_seg, kv_seg, st)
          s = jnp.where(mask, s, -jnp.inf)
        return s, c

      def step(j, carry, masked: bool):
        acc, m_prev, l_prev = carry
        slot, v_slot = slot_of(j), v_slot_of(j)
        if not early_k_wait:
          plgpu.barrier_wait(k_ready.at[slot])

        # Computed outside the wgmma scope: a concrete value (hi is a constant when nothing is
        # masked) closed over by that scope would reach the lowering as a bare literal.
        next_slot, has_next = slot_of(j + 1), j + 1 < hi

        def wait_next_k():
          if early_k_wait:
            @pl.when(has_next)
            def _():
              plgpu.barrier_wait(k_ready.at[next_slot])

        def qk(acc_ref):
          for q_op, cols in q_parts:
            plgpu.wgmma(acc_ref, q_op, k_smem.at[slot, :, cols].transpose((1, 0)))
          turn_end()                              # let the other consumer issue its matmuls
          return acc_ref[...]
        s, c = logits(pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32)), j, slot, masked)
        release_k(slot)

        # Unmasked blocks hold only finite scores: part of their 2^x can go to the FMA pipe.
        poly = 0 if masked else st.poly_cols
        if st.sum_in_pv:
          # The row sum of P waits for the P V issue (below), so its FADDs run while the
          # tensor cores multiply instead of lengthening the softmax before the turn.
          p, alpha, m_new = _exp_block(s, m_prev, c, poly_cols=poly)
          p16, l_new = p.astype(q_smem.dtype), None
        elif st.lazy_rescale:
          p, alpha, m_new, rescale = _exp_block_lazy(s, m_prev, c, st.lazy_rescale,
                                                     poly_cols=poly)
          p16, l_new = p.astype(q_smem.dtype), l_prev * alpha + p.sum(axis=1)
        else:
          p16, alpha, m_new, l_new = _softmax(s, m_prev, l_prev, q_smem.dtype, c, poly_cols=poly)
        if st.fp8 and st.registers_pv:
          # Config.fp8_p_registers: P as the 8-bit A operand (V's keys were permuted to match).
          p16 = p_as_8bit_operand(p16)
        row_sum = lambda: l_prev * alpha + p.sum(axis=1)
        alpha_o = lax.broadcast_in_dim(alpha, acc.shape, [0])
        if st.lazy_rescale and st.registers_pv:
          # alpha is exactly 1 on every row unless ``rescale``: skip O's multiply then (a
          # warpgroup-uniform branch). Interpret mode multiplies by the ones (same values).
          acc = lax.cond(rescale, lambda: acc * alpha_o, lambda: acc)
          alpha_o = None
        if st.pin_softmax and st.registers_pv:
          # All of the softmax, the row sum and O's rescale before the turn is taken (the
          # compiler may otherwise sink them past the barrier into the other consumer's turn).
          acc = acc if alpha_o is None else acc * alpha_o
          acc, p16, m_new, l_new = lax.optimization_barrier((acc, p16, m_new, l_new))
          alpha_o = None

        # Softmax done: wait for V and for our tensor-core turn.
        turn_begin(lambda: plgpu.barrier_wait(v_ready.at[v_slot]))
        if st.registers_pv:
          def pv(refs):
            acc_ref, l_ref = refs if st.sum_in_pv else (refs, None)
            v_op = v_smem.at[v_slot]
            plgpu.wgmma(acc_ref, p16, v_op.transpose((1, 0)) if st.fp8 else v_op)
            if st.sum_in_pv:
              l_ref[...] = row_sum()
            # (early_k_wait) the next K block is waited for while this P V runs: the wgmma is
            # waited on only when the scope closes.
            wait_next_k()
          init = plgpu.ACC.init(acc if alpha_o is None else acc * alpha_o)
          if st.sum_in_pv:
            acc, l_new = pl.run_state(pv)((init, l_prev))
          else:
            acc = pl.run_state(pv)(init)
        else:
          p_smem = p_smem2.at[wg]
          p_smem[...] = p16
          plgpu.commit_smem()                     # make the register stores visible to wgmma

          def pv(acc_ref):
            # FP8 wgmma reads only K-major operands: V^T's slot [H, block_kv], seen as V.
            v_op = v_smem.at[v_slot]
            plgpu.wgmma(acc_ref, p_smem, v_op.transpose((1, 0)) if st.fp8 else v_op)
            return acc_ref[...]
          acc = acc * alpha_o + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
          l_new = row_sum() if st.sum_in_pv else l_new
          wait_next_k()
        release_v(v_slot)
        return acc, m_new, l_new

      if st.overlap:
        # Named barriers: the overlapped turns are (sync own, issue, arrive next) like the plain
        # loop's, so the start / end offsets above keep the counts balanced.
        named = (sync, turn_end) if st.named_barriers else None
        carry = overlap.overlapped_loop(
            carry, lo=lo, lo_full=lo_full, hi_full=hi_full, hi=hi, logits=logits,
            softmax=_softmax, schedule_barrier=schedule_barrier, q_smem=q_smem, k_smem=k_smem,
            v_smem=v_smem, bars=(k_ready, v_ready, k_free, v_free), st=st, named=named,
            p_operand=p_as_8bit_operand if st.fp8 else lambda p: p)
      elif st.any_mask:
        carry = lax.fori_loop(lo, lo_full, lambda j, c: step(j, c, True), carry)
        carry = lax.fori_loop(lo_full, hi_full, lambda j, c: step(j, c, False), carry)
        carry = lax.fori_loop(hi_full, hi, lambda j, c: step(j, c, True), carry)
      else:
        carry = lax.fori_loop(lo, hi, lambda j, c: step(j, c, False), carry)
      acc, m, l = carry
      nxt = None
      if st.persistent:
        # Every Q K^T of this tile has been waited on: Q's buffer is free for the next tile.
        if st.dynamic:
          nxt = schedule.take(i + 1, **queue)
          has_next = nxt < st.num_tiles
        else:
          nxt, has_next = flat_of(i + 1), i + 1 < num_local
        pl.when(has_next)(lambda: load_q(nxt))
        # The previous tile's O / lse stores must have read their buffers before we refill them.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      # Keep the schedule balanced: each consumer but the last signals the next one once more
      # (the turn that one skipped at the start).
      pl.when(wg < nc - 1)(last_turn_signal)

      seen = l > 0
      l_safe = jnp.where(seen, l, 1.0)
      out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
      if st.fp8:      # O was accumulated in V's per-channel units: out = (P8 V8 / l) * s_v
        plgpu.barrier_wait(q_ready.at[3 * nc + wg])
        v_scale = plgpu.load(vscale_smem2.at[wg], layout=plgpu.Layout.WGMMA.reduce(0))
        out = out * lax.broadcast_in_dim(v_scale, acc.shape, [1])
      o_rows = o_ref.at[batch, pl.ds(q_start, bq), head]
      if st.o_chunked:
        # 64 columns at a time through two slots: a slot is refilled once the store issued from
        # it two chunks ago has read it (at most one other store pending). The stores of the
        # previous tile were all waited for above.
        for c in range(out.shape[1] // O_CHUNK):
          if c >= 2:
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
          slot = o_smem.at[c % 2]
          slot[...] = out[:, c * O_CHUNK:(c + 1) * O_CHUNK].astype(slot.dtype)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(slot, o_rows.at[:, pl.ds(c * O_CHUNK, O_CHUNK)])
      else:
        o_smem[...] = out.astype(o_smem.dtype)
      lse_smem2.at[wg][...] = jnp.where(seen, m * LN2 + jnp.log(l_safe), -jnp.inf)
      plgpu.commit_smem()
      lse_rows = lse_ref.at[batch, head, pl.ds(q_start, bq)]
      if st.stream_tail:
        # A tail part goes to its workspace slot (stream_tail.merge combines the parts).
        part = tail_item(i)[3]
        o_parts, lse_parts = parts_refs
        own, slot = pl.ds(wg * bq, bq), jnp.maximum(part, 0)
        for is_part, o_dst, lse_dst in (
            (False, o_rows, lse_rows),
            (True, o_parts.at[cta, slot, own], lse_parts.at[cta, slot, own])):
          @pl.when((part >= 0) == is_part)
          def _store(o_dst=o_dst, lse_dst=lse_dst):
            plgpu.copy_smem_to_gmem(o_smem, o_dst)
            plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_dst)
        return base + (hi - lo), nxt
      if not st.o_chunked:
        plgpu.copy_smem_to_gmem(o_smem, o_rows)
      plgpu.copy_smem_to_gmem(lse_smem2.at[wg], lse_rows)
      return base + (hi - lo), nxt

    tile_loop(tile_body)
    st.wait_stores()

  @pl.when(wg == nc)
  def _producer():
    plgpu.set_max_registers(producer_regs, action="decrease")

    def fetcher(flat, i=None):
      batch, head, tile = coords(flat)
      lo, _, _, hi, _ = ranges(batch, tile, i)
      gmem, smem_refs, ready = ((k_ref, v_ref, kv_seg_ref), (k_smem, v_smem, kvseg_smem),
                                (k_ready, v_ready, seg_ready))
      kv_head = lax.div(head, jnp.int32(st.groups))
      if v_ring == stages:
        fetch = kv_fetcher(gmem, smem_refs, ready, batch=batch, kv_head=kv_head, first=lo, st=st,
                           k_scales=(ks_ref, kscale_smem))
      else:
        fetch = split_kv_fetchers(gmem, smem_refs, ready, batch=batch, kv_head=kv_head,
                                  first=lo, st=st)
      return fetch, hi - lo

    if not st.persistent:
      fetch, num_steps = fetcher(0)
      if v_ring == stages:
        produce(num_steps, stages, fetch, (wait_k_free, wait_v_free))
      else:
        # K and V rings of different depths (``Config.v_stages``), fed in step order: K_j goes
        # out once step j - stages released K, V_j once step j - v_ring released V.
        fetch_k, fetch_v = fetch
        produce_rings(num_steps, ((stages, fetch_k, wait_k_free), (v_ring, fetch_v, wait_v_free)))
      return

    def tile_body(i, flat, base):
      nxt = None
      if st.dynamic:              # claim the next tile first: its latency hides behind this one
        nxt = schedule.publish(i + 1, flat, counter_ref=counter_ref, num_ctas=st.num_ctas,
                               compiled=st.atomic_counter, **queue)
      fetch, num_steps = fetcher(flat, i)

      @pl.loop(0, num_steps)
      def _(j):
        slot, v_slot = lax.rem(base + j, stages), lax.rem(base + j, v_ring)
        if v_ring == stages:
          @pl.when(base + j >= stages)
          def _():                                # the slot's previous block was released
            wait_k_free(slot)
            wait_v_free(slot)
          fetch(j, slot)
        else:
          fetch_k, fetch_v = fetch
          pl.when(base + j >= stages)(lambda: wait_k_free(slot))
          fetch_k(j, slot)
          pl.when(base + j >= v_ring)(lambda: wait_v_free(v_slot))
          fetch_v(j, v_slot)
      return base + num_steps, nxt

    total, num_run = tile_loop(tile_body)
    if st.dynamic:
      schedule.drain(num_run, free=tile_free)

    # Observe the last releases (see ``produce``).
    for depth, wait in ((stages, wait_k_free), (v_ring, wait_v_free)):
      @pl.loop(jnp.maximum(total - depth, 0), total)
      def _drain(g):
        wait(lax.rem(g, depth))


def _softmax(s, m_prev, l_prev, dtype, c: float | None = None, *, poly_cols: int = 0):
  """One online-softmax step (FA2 Alg. 1 lines 8-10, base 2) on a block of logits ``c * s``.

  ``c`` None means ``s`` is already scaled. ``poly_cols``: see ``_exp_block``. Returns P in
  ``dtype``, alpha = 2^(m_prev - m_new), m_new and l_new = alpha l_prev + rowsum(P) (m in
  scaled units).
  """
  p, alpha, m_new = _exp_block(s, m_prev, c, poly_cols=poly_cols)
  return p.astype(dtype), alpha, m_new, l_prev * alpha + p.sum(axis=1)


def _exp_block(s, m_prev, c: float | None = None, *, poly_cols: int = 0):
  """The softmax step without its row sum: (P in float32, alpha, m_new).

  With c > 0, max(c s) = c max(s): the row max is scaled once per row and c s - m is one FMA
  per element. Rows that have seen no visible key keep m = -inf: they subtract 0 (no -inf -
  -inf), so P = 0 and alpha = 0 there. ``poly_cols``: the first columns' 2^x come from
  ``fastexp.exp2_poly`` (FMA pipe) instead of MUFU; only for blocks with no masked score.
  """
  row_max = s.max(axis=1) if c is None else s.max(axis=1) * c
  m_new = jnp.maximum(m_prev, row_max)
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m_prev - m_use)
  m_b = lax.broadcast_in_dim(m_use, s.shape, [0])
  p = fastexp.exp2_split(s - m_b if c is None else _times_c(s, c) - m_b, poly_cols)
  return p, alpha, m_new


def _times_c(s, c):
  """``s * c``: c a scalar, or one factor per row of s (FP8's row scales folded in)."""
  return s * c if jnp.ndim(c) == 0 else s * lax.broadcast_in_dim(c, s.shape, [0])


def _exp_block_lazy(s, m_prev, c: float | None, tau: float, *, poly_cols: int = 0):
  """``_exp_block`` with FA4's conditional rescaling: (P, alpha, m_kept, rescale).

  ``rescale`` (a warpgroup-wide scalar) is whether some row's max grew by more than ``tau``
  over the max it runs with (a row that saw its first visible key grew by +inf). If so, every
  row takes its new max (alpha = 2^(m_prev - m_new), as ``_exp_block``); if not, every row
  keeps ``m_prev``: alpha = 2^0 = 1 exactly and P = 2^(c s - m_prev) <= 2^tau. Rows that
  have seen no key keep m = -inf either way (P = 0, alpha = 0).
  """
  row_max = s.max(axis=1) if c is None else s.max(axis=1) * c
  m_new = jnp.maximum(m_prev, row_max)
  grown = jnp.where(m_new == -jnp.inf, 0.0,
                    jnp.where(m_prev == -jnp.inf, jnp.inf, m_new - m_prev))
  rescale = jnp.max(grown) > tau
  m_kept = lax.cond(rescale, lambda: m_new, lambda: m_prev)   # no implicit scalar broadcast
  m_use = jnp.where(m_kept == -jnp.inf, 0.0, m_kept)
  alpha = jnp.exp2(m_prev - m_use)
  m_b = lax.broadcast_in_dim(m_use, s.shape, [0])
  p = fastexp.exp2_split(s - m_b if c is None else _times_c(s, c) - m_b, poly_cols)
  return p, alpha, m_kept, rescale

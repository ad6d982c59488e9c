"""The dQ kernel of the Mosaic GPU backward (see ``backward.py`` for the maths and the dK/dV
kernel): a CTA = two consumer warpgroups (``block_q`` query rows each) and one producer that
streams the K/V blocks the tile can see through a TMA ring, as the forward does; each consumer
accumulates dQ = scale * dS K for its rows over those blocks (FA2 Alg. 2 / FA3 Section 3.3,
recomputing S and dP).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.mosaic import stream_tail
from pallas_attn.mosaic.backward import (_TILED, _grad_logits, _logits2, _matmul_acc,
                                         _product, _split_refs, _tile_mask, _visit,
                                         producer_registers)
from pallas_attn.mosaic.persistent import (_decode_tile, persistent_consumer_loop,
                                           persistent_tile_count)
from pallas_attn.mosaic.kernels import (COMPUTE_WGS, Statics, heavy_first_tile, kv_fetcher,
                                        produce, produce_rings, slot_releases, split_kv_fetchers,
                                        tile_ranges)


def dq_kernel(*refs, st: Statics, has_meta: bool, num_ctas: int = 0,
              grid_tiles: tuple[int, int, int] = (0, 0, 0), main_tiles: int = 0,
              tail: stream_tail.Tail | None = None, coords=None, on_done=None):
  """refs: q, k, v, do, rows[, meta][, q_seg, kv_seg][, o], dq[, rows_out], smem, barriers.

  ``rows`` is [B, N, 2, T] float32: L2 and D side by side, one TMA per tile. With
  ``st.delta_in_dq`` its second row holds -dlse only: the consumers add rowsum(dO * O) from
  ``o`` and write the finished record to ``rows_out`` for the dK/dV kernel.
  ``num_ctas`` > 0: the persistent form (``Config.bwd_persistent``, unmasked calls), as in
  ``dkdv_kernel``: CTAs loop over the (head, Q tile, batch) tiles of ``grid_tiles``, the K/V
  ring runs on across tiles and each consumer double-buffers its Q, dO, L2/D (and O) tiles.

  Stream-K for the last partial wave (``Config.bwd_stream_tail``, unmasked grid form, as in
  ``dkdv_kernel``): ``main_tiles`` > 0: the grid's CTAs from flat index ``main_tiles`` on
  (``_decode_tile``'s numbering) do nothing. ``tail``: a launch of ``tail.num_ctas`` CTAs
  ("cta") runs only those tiles, each CTA its one or two parts (K/V blocks [lo, hi)) one
  after the other (the persistent form's second buffers do not fit next to O's at H = 128),
  writing float32 partials (already scaled) to ``dq`` [num_ctas, 2, rows, H] and the tiles'
  finished L2 / D records to ``rows_out`` (every part of a tile writes the same values).

  ``coords`` = (batch, head, Q tile) replaces the grid's indices and ``on_done()`` runs in
  each consumer once its dQ store is issued, before the kernel's last wait: two bulk store
  groups may be in flight then, the L2 / D record (older) and dQ (the joint launch,
  ``backward_joint.py``).
  """
  (q_ref, k_ref, v_ref, do_ref, rows_ref, meta_ref, q_seg_ref, kv_seg_ref), rest = _split_refs(
      refs, st, has_meta)
  if st.delta_in_dq:
    o_ref, dq_ref, rows_out_ref, smem, bars = rest
  else:
    (dq_ref, smem, bars), o_ref, rows_out_ref = rest, None, None
  (q_smem2, do_smem2, rows_smem2, k_smem, v_smem, meta_smem, qseg_smem2, kvseg_smem,
   ds_smem2, o_smem2) = smem
  k_ready, v_ready, seg_ready, q_ready, meta_ready, k_free, v_free = bars
  bq, bkv, stages, v_ring = st.block_q, st.block_kv, st.num_stages, st.v_ring
  (release_k, release_v), waits = slot_releases((k_free, v_free), st, stages=(stages, v_ring))
  wg = lax.axis_index("wg")
  persist = num_ctas > 0 and tail is None
  if tail is not None:
    cta = lax.axis_index("cta")
    batch = head = tile = kv_len = None
    lo, lo_full, hi_full, hi = 0, 0, st.num_kv_blocks, st.num_kv_blocks
    my_tiles, tail_item = stream_tail.tail_items(cta, tail)
  elif persist:
    cta = lax.axis_index("cta")
    batch = head = tile = kv_len = None
    lo, lo_full, hi_full, hi = 0, 0, st.num_kv_blocks, st.num_kv_blocks
    my_tiles = persistent_tile_count(cta, num_ctas, grid_tiles)
  else:
    batch, head, raw = coords or (lax.axis_index("batch"), lax.axis_index("heads"),
                                  lax.axis_index("q_seq"))
    # Heaviest Q tiles first under causal-like masks (without it they ran last: ~6% of the
    # kernel in a list-scheduling model of 2048 CTAs on 132 SMs).
    n_tiles = -(-q_ref.shape[1] // (COMPUTE_WGS * bq))     # Q may end inside its last tile
    tile = heavy_first_tile(raw, n_tiles=n_tiles, st=st)
    lo, lo_full, hi_full, hi, kv_len = tile_ranges(meta_ref, meta_smem, meta_ready, wg=wg,
                                                   batch=batch, tile=tile,
                                                   full=st.num_kv_blocks)
  tile_steps = hi - lo
  decode = functools.partial(_decode_tile, grid_tiles=grid_tiles)

  def qbuf(ref, buf):
    """This consumer's [block_q, ...] tile of a per-consumer buffer (of buffer ``buf`` in the
    persistent form, whose Q, dO, L2/D and O buffers come in pairs)."""
    return ref.at[buf, wg] if persist else ref.at[wg]

  def bar(i, buf):    # the persistent form's second buffers load on barriers 5 * CW further on
    return q_ready.at[i + 5 * COMPUTE_WGS * buf] if persist else q_ready.at[i]

  def load_q(batch, head, tile, buf):
    """TMA of this consumer's Q, dO, L2/D record (and O) rows of ``tile`` into buffer ``buf``."""
    rows = pl.ds(tile * (COMPUTE_WGS * bq) + wg * bq, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], qbuf(q_smem2, buf), bar(3 * wg, buf))
    plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], qbuf(do_smem2, buf),
                            bar(3 * wg + 1, buf))
    plgpu.copy_gmem_to_smem(rows_ref.at[batch, head, :, rows], qbuf(rows_smem2, buf),
                            bar(3 * wg + 2, buf))
    if st.delta_in_dq:
      plgpu.copy_gmem_to_smem(o_ref.at[batch, rows, head], qbuf(o_smem2, buf),
                              bar(4 * COMPUTE_WGS + wg, buf))

  def consume(batch, head, tile, buf, base, span=None, part=None):
    """One Q tile of this consumer (loaded into buffer ``buf``): every K/V block, ring steps
    from ``base`` on; then dQ out through Q's buffer (the TMA store issued, not waited for).
    ``span`` = (lo, hi): only K/V blocks [lo, hi) (a tail part, unmasked), its float32
    partial stored from registers to slot ``part``."""
    lo_, lo_full_, hi_full_, hi_ = (lo, lo_full, hi_full, hi) if span is None else (
        span[0], span[0], span[1], span[1])
    q_start = tile * (COMPUTE_WGS * bq) + wg * bq
    rows = pl.ds(q_start, bq)
    q_smem, do_smem, rows_smem = qbuf(q_smem2, buf), qbuf(do_smem2, buf), qbuf(rows_smem2, buf)
    for i in range(3):
      plgpu.barrier_wait(bar(3 * wg + i, buf))
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    if st.delta_in_dq:
      # D = rowsum(dO * O) - dlse for this consumer's rows, once per tile; the dK/dV kernel
      # reads it from the record written here (it runs after this kernel).
      plgpu.barrier_wait(bar(4 * COMPUTE_WGS + wg, buf))
      do_o = (plgpu.load(do_smem, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
              * plgpu.load(qbuf(o_smem2, buf), (), layout=plgpu.Layout.WGMMA).astype(jnp.float32))
      delta = do_o.sum(axis=1) + plgpu.load(rows_smem.at[1], layout=row_layout)
      rows_smem.at[1][...] = delta
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(rows_smem, rows_out_ref.at[batch, head, :, rows])
    # ``st.qdo_regs``: Q and dO, the same for every K/V block, as register A operands of S and
    # dP (H / 2 registers a thread each): the step's SMEM reads drop from 80 to 48 KB a consumer
    # (operands.q_operands says why that matters).
    q_op, do_op = (q_smem[...], do_smem[...]) if st.qdo_regs else (q_smem, do_smem)
    lse2 = plgpu.load(rows_smem.at[0], layout=row_layout)
    if not st.delta_in_dq:
      delta = plgpu.load(rows_smem.at[1], layout=row_layout)
    q_seg = None
    if st.has_segments:
      plgpu.copy_gmem_to_smem(q_seg_ref.at[batch, rows], qseg_smem2.at[wg],
                              q_ready.at[3 * COMPUTE_WGS + wg])
      plgpu.barrier_wait(q_ready.at[3 * COMPUTE_WGS + wg])
      q_seg = plgpu.load(qseg_smem2.at[wg], layout=row_layout)
    shape = (bq, bkv)

    def mask_of(j, masked: bool):
      if not masked:
        return None
      q_pos = q_start + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
      k_pos = j * bkv + plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
      seg_q = seg_k = None
      if st.has_segments:
        seg_k = lax.broadcast_in_dim(
            plgpu.load(kvseg_smem.at[lax.rem(j - lo_, stages)],
                       layout=plgpu.Layout.WGMMA.reduce(0)), shape, [1])
        seg_q = lax.broadcast_in_dim(q_seg, shape, [0])
      return _tile_mask(q_pos, k_pos, kv_len, seg_q, seg_k, st)

    def probs(s, j, masked: bool):
      """q.k -> (P, tanh of the softcap | None, mask | None)."""
      s2, t = _logits2(s, st)
      p = jnp.exp2(s2 - lax.broadcast_in_dim(lse2, shape, [0]))
      mask = mask_of(j, masked)
      if mask is not None:
        p = jnp.where(mask, p, 0.0)
      return p, t, mask

    def grad_logits(p, dp, t, mask, centred=False):
      """dS; ``centred``: ``dp`` is dP - D already (``st.dq_delta_acc``)."""
      d = None if centred else lax.broadcast_in_dim(delta, shape, [0])
      return _grad_logits(p, dp, d, t, mask, q_smem.dtype)

    def step(j, dq, masked: bool):
      """Interpret form: one synchronous wgmma at a time, dS staged through SMEM."""
      slot, v_slot = lax.rem(base + j - lo_, stages), lax.rem(base + j - lo_, v_ring)
      plgpu.barrier_wait(k_ready.at[slot])
      if st.has_segments:
        plgpu.barrier_wait(seg_ready.at[slot])
      p, t, mask = probs(_product(q_smem, k_smem.at[slot].transpose((1, 0)), shape), j, masked)
      plgpu.barrier_wait(v_ready.at[v_slot])
      dp = _product(do_smem, v_smem.at[v_slot].transpose((1, 0)), shape)
      release_v(v_slot)
      ds = grad_logits(p, dp, t, mask)
      dq = _matmul_acc(dq, ds, k_smem.at[slot], None if ds_smem2 is None else ds_smem2.at[wg],
                       registers=st.registers_pv)
      release_k(slot)
      return dq

    def step_async(j, dq_acc, masked: bool):
      """Compiled form: S = Q K^T and dP = dO V^T issued back to back, P computed while the
      tensor cores run dP (FA3 Section 3.3's overlap of softmax and matmul), dQ += dS K
      accumulated in place."""
      slot, v_slot = lax.rem(base + j - lo_, stages), lax.rem(base + j - lo_, v_ring)
      # A shallower V ring (``st.v_stages``) fills V later than K: S is issued before V is
      # waited for. With equal rings the two waits come first (the kernel as measured).
      split_rings = v_ring != stages
      plgpu.barrier_wait(k_ready.at[slot])
      if not split_rings:
        plgpu.barrier_wait(v_ready.at[v_slot])
      if st.has_segments:
        plgpu.barrier_wait(seg_ready.at[slot])

      def scores(s_acc, dp_acc):
        if st.dq_delta_acc:   # before S's issue: after it, ptxas would wait for S (C7517)
          dp_acc[...] = lax.broadcast_in_dim(-delta, shape, [0])
        plgpu.wgmma(s_acc, q_op, k_smem.at[slot].transpose((1, 0)))
        if st.dq_serial:
          # S's accumulator is read (and P computed) before dP's is in flight.
          s = plgpu.wgmma_accumulator_load(s_acc, wait_n=0)
          if st.defer_wait:   # the previous step's dQ wgmma (older than S) is done too
            pl.when(j > lo_)(lambda: release_k(lax.rem(j - 1 - lo_, stages)))
          p, t, mask = probs(s, j, masked)
          if split_rings:
            plgpu.barrier_wait(v_ready.at[v_slot])
          plgpu.wgmma(dp_acc, do_op, v_smem.at[v_slot].transpose((1, 0)))
          return p, t, mask, plgpu.wgmma_accumulator_load(dp_acc, wait_n=0)
        if split_rings:
          plgpu.barrier_wait(v_ready.at[v_slot])
        plgpu.wgmma(dp_acc, do_op, v_smem.at[v_slot].transpose((1, 0)))
        s = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)
        if st.defer_wait:     # the previous step's dQ wgmma (older than S) is done too
          pl.when(j > lo_)(lambda: release_k(lax.rem(j - 1 - lo_, stages)))
        p, t, mask = probs(s, j, masked)
        return p, t, mask, plgpu.wgmma_accumulator_load(dp_acc, wait_n=0)
      acc = plgpu.ACC(shape, jnp.float32)
      p, t, mask, dp = pl.run_scoped(scores, acc, acc)
      release_v(v_slot)
      plgpu.wgmma(dq_acc, grad_logits(p, dp, t, mask, centred=st.dq_delta_acc), k_smem.at[slot])
      if not st.defer_wait:
        plgpu.wgmma_wait(0)
        release_k(slot)
      return dq_acc

    if st.registers_pv:
      def run(dq_acc):
        _visit(lo_, lo_full_, hi_full_, hi_, step_async, dq_acc, st)
        if st.defer_wait:
          plgpu.wgmma_wait(0)
          pl.when(hi_ > lo_)(lambda: release_k(lax.rem(hi_ - 1 - lo_, stages)))
        return dq_acc[...]
      dq = pl.run_scoped(run, plgpu.ACC((bq, q_smem.shape[-1]), jnp.float32))
    else:
      dq = plgpu.layout_cast(jnp.full((bq, q_smem.shape[-1]), 0.0, jnp.float32),
                             plgpu.Layout.WGMMA)
      dq = _visit(lo_, lo_full_, hi_full_, hi_, step, dq, st)
    if part is not None:
      dq_ref.at[cta, part, pl.ds(wg * bq, bq)][...] = dq * st.scale
      return
    q_smem[...] = (dq * st.scale).astype(q_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[batch, rows, head])

  live = True
  if main_tiles:          # (bwd_stream_tail) the grid's tail CTAs: a separate launch runs them
    heads, q_tiles, _ = grid_tiles
    live = lax.axis_index("q_seq") + q_tiles * (head + heads * batch) < main_tiles

  @pl.when((wg < COMPUTE_WGS) & live)
  def _consumer():
    # Register reallocation as in the forward: without it each of the 3 x 128 threads gets at most
    # 168 registers, too few for a consumer's fp32 accumulator(s) next to S and dP.
    plgpu.set_max_registers(st.consumer_registers, action="increase")
    if tail is not None:
      def part_body(j, base):             # the parts one after the other, one buffer set
        flat, lo_j, hi_j, part = tail_item(j)
        # The previous part's L2 / D record store has read its buffer.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        load_q(*decode(flat), 0)
        consume(*decode(flat), 0, base, span=(lo_j, hi_j), part=part)
        return base + hi_j - lo_j
      lax.fori_loop(0, my_tiles, part_body, jnp.int32(0))
      st.wait_stores()
      return
    if not persist:
      load_q(batch, head, tile, 0)
      consume(batch, head, tile, 0, 0)
      if on_done is not None:
        on_done()
      st.wait_stores()
      return
    persistent_consumer_loop(                # (consume waits for its own loads)
        cta=cta, num_ctas=num_ctas, my_tiles=my_tiles,
        load=lambda t, buf: load_q(*decode(t), buf), wait=lambda buf: None,
        consume=lambda t, buf, it: consume(*decode(t), buf, it * tile_steps))
    st.wait_stores()

  @pl.when((wg == COMPUTE_WGS) & live)
  def _producer():
    plgpu.set_max_registers(producer_registers(st), action="decrease")
    rings = ((k_ref, v_ref, kv_seg_ref), (k_smem, v_smem, kvseg_smem),
             (k_ready, v_ready, seg_ready))
    if tail is not None:
      span = lambda j: tail_item(j)[2] - tail_item(j)[1]
      first = span(0)

      def fetch(step):     # ring step -> K/V block of part 0, then of part 1
        j = (step >= first).astype(jnp.int32)
        flat, lo_j, _, _ = tail_item(j)
        b, h, _ = decode(flat)
        kv_fetcher(*rings, batch=b, kv_head=lax.div(h, jnp.int32(st.groups)), first=lo_j,
                   st=st)(step - j * first, slot=lax.rem(step, stages))
      produce(jnp.where(my_tiles > 0, first, 0) + jnp.where(my_tiles > 1, span(1), 0), stages,
              fetch, waits)
      return
    if persist:
      def fetch(step):     # ring step -> K/V block of this CTA's tile step // tile_steps
        b, h, _ = decode(cta + lax.div(step, tile_steps) * num_ctas)
        kv_fetcher(*rings, batch=b, kv_head=lax.div(h, jnp.int32(st.groups)), first=0, st=st)(
            lax.rem(step, tile_steps), slot=lax.rem(step, stages))
      produce(my_tiles * tile_steps, stages, fetch, waits)
      return
    where = dict(batch=batch, kv_head=lax.div(head, jnp.int32(st.groups)), first=lo, st=st)
    if v_ring == stages:
      produce(hi - lo, stages, kv_fetcher(*rings, **where), waits)
    else:
      fetch_k, fetch_v = split_kv_fetchers(*rings, **where)
      produce_rings(hi - lo, ((stages, fetch_k, waits[0]), (v_ring, fetch_v, waits[1])))


def dq_scratch(*, st: Statics, head_dim: int, dtype, has_meta: bool, persistent: bool = False):
  bq, bkv, stages, v_ring = st.block_q, st.block_kv, st.num_stages, st.v_ring
  per_wg = (2, COMPUTE_WGS) if persistent else (COMPUTE_WGS,)    # two sets: persistent
  smem = (
      plgpu.SMEM((*per_wg, bq, head_dim), dtype, transforms=_TILED),            # Q, then dQ
      plgpu.SMEM((*per_wg, bq, head_dim), dtype, transforms=_TILED),            # dO
      plgpu.SMEM((*per_wg, 2, bq), jnp.float32),                                # L2, D
      plgpu.SMEM((stages, bkv, head_dim), dtype, transforms=_TILED),            # K ring
      plgpu.SMEM((v_ring, bkv, head_dim), dtype, transforms=_TILED),            # V ring
      plgpu.SMEM((8,), jnp.int32) if has_meta else None,
      plgpu.SMEM((COMPUTE_WGS, bq), jnp.int32) if st.has_segments else None,
      plgpu.SMEM((stages, bkv), jnp.int32) if st.has_segments else None,
      None if st.registers_pv else plgpu.SMEM((COMPUTE_WGS, bq, bkv), dtype, transforms=_TILED),
      plgpu.SMEM((*per_wg, bq, head_dim), dtype, transforms=_TILED) if st.delta_in_dq
      else None,                                                                # O
  )
  bars = (
      plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=v_ring),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=(10 if persistent else 5) * COMPUTE_WGS),     # per-WG loads
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
      plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=v_ring),
  )
  return smem, bars

"""Intra-warpgroup overlap of the FA3 forward's consumer loop (FA3 Section 3.2, Algorithm 2).

Compiled form only (P stays in registers as wgmma's A operand). Measured slower than the plain
loop on the H200 (register pressure), so ``Config.overlap`` is off by default; kept for A/B.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def overlapped_loop(carry, *, lo, lo_full, hi_full, hi, logits, softmax, schedule_barrier,
                    q_smem, k_smem, v_smem, bars, st, named=None, p_operand=lambda p: p):
  """The consumer's K/V loop with intra-warpgroup overlap (FA3 Section 3.2, Algorithm 2).

  The softmax of block j + 1 runs while the tensor cores still compute P_j V_j: each turn issues
  S_{j+1} = Q K_{j+1}^T and then O += P_j V_j (two wgmma groups), waits only for the first
  (``wgmma_wait(1)``), and does the masking and online softmax of S_{j+1} before the second is
  waited for. P_j stays in registers, so this is the compiled form only (``registers_pv``).
  The two consumers still take turns on the tensor cores: by default one ``schedule_barrier``
  (an mbarrier rendezvous of both) before and one after each turn's issues. ``named``:
  ``(sync_own, arrive_next)`` on hardware named barriers instead (FA3 Section 3.1), the plain
  loop's protocol: the first turn only hands over (its issue is Q K^T alone), every later turn
  is sync - issue - arrive, and the last one (P V alone) does not hand over, so each consumer
  syncs and arrives once per K/V block, and the caller's one-turn offset (consumer 1 syncs
  first, consumer 0 arrives last) balances the two barriers. Returns (O, m, l) like the plain
  loop. ``p_operand``: P (the softmax's cast) as wgmma's A operand; FP8 regroups it into the
  8-bit operand layout (``operands.p_as_8bit_operand``) and reads V's slot as V^T.
  """
  k_ready, v_ready, k_free, v_free = bars
  bq, bkv, stages = st.block_q, st.block_kv, st.num_stages
  dtype = q_smem.dtype
  acc, m, l = carry
  if named is None:
    begin = end = schedule_barrier
    lead_in = last_handover = True
  else:
    begin, end = named
    lead_in = last_handover = False
  wgmma_tile = lambda x, dt: plgpu.layout_cast(jnp.zeros((bq, bkv), dt) + x, plgpu.Layout.WGMMA)
  # Loop state: O before block j's rescale, m_j, l_j, P_j (registers, wgmma's A operand), alpha_j.
  state = (acc, m, l, p_operand(wgmma_tile(0, dtype)), l * 0.0)
  # FP8 wgmma reads only K-major operands: V^T's slot [H, block_kv], seen as V.
  v_operand = lambda slot: v_smem.at[slot].transpose((1, 0)) if st.fp8 else v_smem.at[slot]
  def softmax_op(*args):
    p, *rest = softmax(*args)
    return (p_operand(p), *rest)
  bcast = lambda row, like: lax.broadcast_in_dim(row, like.shape, [0])

  def first(state):                     # block lo: S_lo and its softmax, nothing to multiply yet
    acc, m, l, _, _ = state
    if lead_in:
      begin()
    plgpu.barrier_wait(k_ready.at[0])

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, q_smem, k_smem.at[0].transpose((1, 0)))
      end()
      return acc_ref[...]
    s, c = logits(pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32)), lo, 0, st.any_mask)
    plgpu.barrier_arrive(k_free.at[0])
    p16, alpha, m, l = softmax_op(s, m, l, dtype, c)
    return acc, m, l, p16, alpha

  def step(jn, state, masked: bool):    # issue S_jn and P_{jn-1} V_{jn-1}; softmax of S_jn
    acc, m, l, p16, alpha = state
    slot_n, slot_c = lax.rem(jn - lo, stages), lax.rem(jn - 1 - lo, stages)
    begin()                             # our turn on the tensor cores
    plgpu.barrier_wait(k_ready.at[slot_n])
    plgpu.barrier_wait(v_ready.at[slot_c])

    def turn(refs):
      o_ref, s_ref, m_ref, l_ref, p_ref, a_ref = refs
      plgpu.wgmma(s_ref, q_smem, k_smem.at[slot_n].transpose((1, 0)))
      plgpu.wgmma(o_ref, p16, v_operand(slot_c))
      end()                             # the other consumer's turn
      plgpu.wgmma_wait(1)               # S_jn is done; P V may still run
      s, c = logits(plgpu.wgmma_accumulator_load(s_ref, wait_n=None), jn, slot_n, masked)
      plgpu.barrier_arrive(k_free.at[slot_n])
      p_ref[...], a_ref[...], m_ref[...], l_ref[...] = softmax_op(s, m_ref[...], l_ref[...],
                                                                   dtype, c)

    acc, _, m, l, p16, alpha = pl.run_state(turn)(
        (plgpu.ACC.init(acc * bcast(alpha, acc)), plgpu.ACC.init(wgmma_tile(0, jnp.float32)),
         m, l, p16, alpha))
    plgpu.barrier_arrive(v_free.at[slot_c])
    return acc, m, l, p16, alpha

  def last(state):                      # P_{hi-1} V_{hi-1}
    acc, m, l, p16, alpha = state
    slot_c = lax.rem(hi - 1 - lo, stages)
    begin()
    plgpu.barrier_wait(v_ready.at[slot_c])

    def pv(o_ref):
      plgpu.wgmma(o_ref, p16, v_operand(slot_c))
      if last_handover:
        end()
    acc = pl.run_state(pv)(plgpu.ACC.init(acc * bcast(alpha, acc)))
    plgpu.barrier_arrive(v_free.at[slot_c])
    return acc, m, l, p16, alpha

  nonempty = hi > lo
  state = lax.cond(nonempty, first, lambda x: x, state)
  a = lo + 1
  if st.any_mask:
    r1, r2 = jnp.maximum(a, lo_full), jnp.maximum(a, hi_full)
    state = lax.fori_loop(a, r1, lambda j, c: step(j, c, True), state)
    state = lax.fori_loop(r1, r2, lambda j, c: step(j, c, False), state)
    state = lax.fori_loop(r2, hi, lambda j, c: step(j, c, True), state)
  else:
    state = lax.fori_loop(a, hi, lambda j, c: step(j, c, False), state)
  state = lax.cond(nonempty, last, lambda x: x, state)
  acc, m, l, _, _ = state
  return acc, m, l

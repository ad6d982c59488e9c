"""Kernel bodies of FlashAttention-2 (Dao, 2023) for the Pallas Triton backend.

Refs first, keyword-only statics after; the ``pallas_call`` wrappers live in ``ops.py``.
Notation (paper, Algorithm 1/2): S = Q K^T (scaled), P = exp(S - L), O = P V, L = log-sum-exp.
Everything runs in base 2: logits are pre-multiplied by log2(e) (folded into the scale), so
``exp`` becomes the cheaper ``exp2`` and L is kept as ``L2 = L * log2(e)``.

A K/V block is processed by one of two loop bodies: a mask-free body for blocks that every query
of the tile fully sees, and a masked body for the diagonal/boundary blocks. Blocks nobody sees are
never visited (the loop bounds come from ``masks.kv_block_ranges``).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn import masks

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Statics:
  """Static parameters shared by the three kernels (hashable)."""
  scale: float                 # softmax scale (natural units)
  softcap: float | None
  spec: masks.MaskSpec         # positional mask (window/causal), bottom-right aligned
  has_kv_len: bool             # keys >= kv_len[b] hidden (user kv_lengths and/or padding of S)
  has_segments: bool
  groups: int                  # N // K
  precision: lax.Precision | None

  @property
  def any_mask(self) -> bool:
    return (not self.spec.is_trivial) or self.has_kv_len or self.has_segments


def _logits2(qk, st: Statics):
  """Scaled logits in base 2, and the softcap's tanh (for its derivative) or None."""
  if st.softcap is None:
    return qk * (st.scale * LOG2E), None
  t = jnp.tanh(qk * (st.scale / st.softcap))
  return t * (st.softcap * LOG2E), t


def _tile_mask(q_start, k_start, *, block_q, block_k, st: Statics, kv_len, q_seg, kv_seg):
  q_pos = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  k_pos = k_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
  mask = masks.position_mask(q_pos, k_pos, st.spec)
  if st.has_kv_len:
    mask = masks.and_masks(mask, k_pos < kv_len)
  if st.has_segments:
    mask = masks.and_masks(mask, q_seg[:, None] == kv_seg[None, :])
  return mask


def _visit(lo, hi, body, carry, masked: bool):
  return lax.fori_loop(lo, hi, lambda j, c: body(j, c, masked), carry)


def _visit_blocks(ranges_ref, num_blocks: int, body, carry, st: "Statics"):
  """Runs ``body(j, carry, masked)`` over the blocks to visit: masked ones at the two ends of
  ``[lo, hi)``, mask-free ones in ``[lo_full, hi_full)``; every block, mask-free, without masks."""
  if not st.any_mask:
    return _visit(0, num_blocks, body, carry, masked=False)
  lo, lo_full, hi_full, hi = ranges_ref[0], ranges_ref[1], ranges_ref[2], ranges_ref[3]
  carry = _visit(lo, lo_full, body, carry, masked=True)
  carry = _visit(lo_full, hi_full, body, carry, masked=False)
  return _visit(hi_full, hi, body, carry, masked=True)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------

def fwd_kernel(ranges_ref, kv_len_ref, q_seg_ref, kv_seg_ref, q_ref, k_ref, v_ref,
               o_ref, lse_ref, *, block_q: int, block_k: int, num_k_blocks: int, st: Statics):
  """One program: a [block_q, H] tile of queries of one (batch, head) against its K/V blocks."""
  q_start = pl.program_id(0) * block_q
  q = q_ref[...]
  kv_len = kv_len_ref[0] if st.has_kv_len else None
  q_seg = q_seg_ref[...] if st.has_segments else None

  def body(j, carry, masked):
    acc, m_prev, l_prev = carry
    k_start = j * block_k
    k = k_ref[pl.ds(k_start, block_k), :]
    v = v_ref[pl.ds(k_start, block_k), :]
    s, _ = _logits2(plgpu.dot(q, k, trans_b=True, precision=st.precision), st)
    if masked:
      kv_seg = kv_seg_ref[pl.ds(k_start, block_k)] if st.has_segments else None
      mask = _tile_mask(q_start, k_start, block_q=block_q, block_k=block_k, st=st,
                        kv_len=kv_len, q_seg=q_seg, kv_seg=kv_seg)
      s = jnp.where(mask, s, -jnp.inf)
      if st.has_kv_len:
        # Keys past the valid length may be garbage (NaN): 0 * NaN would leak through P V.
        v = jnp.where((k_start + lax.broadcasted_iota(jnp.int32, v.shape, 0)) < kv_len, v, 0)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
    # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead (no -inf - -inf).
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_prev - m_use)                         # rescale of the running sums (Eq. 5)
    p = jnp.exp2(s - m_use[:, None])
    l_new = alpha * l_prev + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=st.precision)
    return acc, m_new, l_new

  # *_like keeps q's varying mesh axes, so the loop carries type-check inside shard_map.
  acc0 = jnp.zeros_like(q, dtype=jnp.float32)
  row0 = jnp.sum(acc0, axis=1)
  carry = (acc0, row0 - jnp.inf, row0)
  acc, m, l = _visit_blocks(ranges_ref, num_k_blocks, body, carry, st)
  # Deferred normalisation (FA2 Section 3.1.1): divide once at the end; empty rows give 0.
  seen = l > 0
  o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) / LOG2E, -jnp.inf)


# ----------------------------------------------------------------------------------------------
# Backward (FA2 Algorithm 2, split in a K/V-outer kernel for dK, dV and a Q-outer one for dQ)
# ----------------------------------------------------------------------------------------------

def _probs_and_dlogits(q, k, v, do, lse2, delta, mask, st: Statics):
  """P (recomputed from L2) and dS = P * (dP - D), as d(q.k) (scale and softcap folded in)."""
  s, t = _logits2(plgpu.dot(q, k, trans_b=True, precision=st.precision), st)
  p = jnp.exp2(s - lse2[:, None])
  if mask is not None:
    p = jnp.where(mask, p, 0.0)
  dp = plgpu.dot(do, v, trans_b=True, precision=st.precision)
  ds = p * (dp - delta[:, None])
  if t is not None:
    ds = ds * (1.0 - t * t)          # d softcap*tanh(x/softcap) / dx
  if mask is not None:
    ds = jnp.where(mask, ds, 0.0)    # hidden keys may hold NaN: keep it out of dQ and dK
  return p, ds


def dkdv_kernel(ranges_ref, kv_len_ref, q_seg_ref, kv_seg_ref, q_ref, k_ref, v_ref, do_ref,
                lse2_ref, delta_ref, dk_ref, dv_ref, *, block_q: int, block_k: int,
                num_q_blocks: int, st: Statics):
  """One program: dK, dV of a [block_k, H] tile of one (batch, K/V head), summed over its group.

  ``ranges_ref`` holds the (lo, lo_full, hi_full, hi) Q-block ranges seen from this K/V block.
  """
  k_start = pl.program_id(0) * block_k
  kv_head = pl.program_id(2)
  k = k_ref[...]
  v = v_ref[...]
  kv_len = kv_len_ref[0] if st.has_kv_len else None
  kv_seg = kv_seg_ref[...] if st.has_segments else None
  if st.has_kv_len:
    valid = (k_start + lax.broadcasted_iota(jnp.int32, k.shape, 0)) < kv_len
    k = jnp.where(valid, k, 0)
    v = jnp.where(valid, v, 0)

  def body(i, carry, masked, head):
    dk, dv = carry
    q_start = i * block_q
    q = q_ref[pl.ds(q_start, block_q), head, :]
    do = do_ref[pl.ds(q_start, block_q), head, :]
    lse2 = lse2_ref[head, pl.ds(q_start, block_q)]
    delta = delta_ref[head, pl.ds(q_start, block_q)]
    mask = None
    if masked:
      q_seg = q_seg_ref[pl.ds(q_start, block_q)] if st.has_segments else None
      mask = _tile_mask(q_start, k_start, block_q=block_q, block_k=block_k, st=st,
                        kv_len=kv_len, q_seg=q_seg, kv_seg=kv_seg)
    p, ds = _probs_and_dlogits(q, k, v, do, lse2, delta, mask, st)
    dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=st.precision)
    dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True, precision=st.precision)
    return dk, dv

  def per_head(g, carry):
    head = kv_head * st.groups + g
    step = lambda i, c, masked: body(i, c, masked, head)
    return _visit_blocks(ranges_ref, num_q_blocks, step, carry, st)

  zeros = jnp.zeros_like(k, dtype=jnp.float32)
  dk, dv = lax.fori_loop(0, st.groups, per_head, (zeros, zeros))
  dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def dq_kernel(ranges_ref, kv_len_ref, q_seg_ref, kv_seg_ref, q_ref, k_ref, v_ref, do_ref,
              lse2_ref, delta_ref, dq_ref, *, block_q: int, block_k: int, num_k_blocks: int,
              st: Statics):
  """One program: dQ of a [block_q, H] tile of one (batch, head), looping over K/V blocks."""
  q_start = pl.program_id(0) * block_q
  q = q_ref[...]
  do = do_ref[...]
  lse2 = lse2_ref[...]
  delta = delta_ref[...]
  kv_len = kv_len_ref[0] if st.has_kv_len else None
  q_seg = q_seg_ref[...] if st.has_segments else None

  def body(j, dq, masked):
    k_start = j * block_k
    k = k_ref[pl.ds(k_start, block_k), :]
    v = v_ref[pl.ds(k_start, block_k), :]
    mask = None
    if masked:
      kv_seg = kv_seg_ref[pl.ds(k_start, block_k)] if st.has_segments else None
      mask = _tile_mask(q_start, k_start, block_q=block_q, block_k=block_k, st=st,
                        kv_len=kv_len, q_seg=q_seg, kv_seg=kv_seg)
      if st.has_kv_len:
        valid = (k_start + lax.broadcasted_iota(jnp.int32, k.shape, 0)) < kv_len
        k = jnp.where(valid, k, 0)
        v = jnp.where(valid, v, 0)
    _, ds = _probs_and_dlogits(q, k, v, do, lse2, delta, mask, st)
    return dq + plgpu.dot(ds.astype(k.dtype), k, precision=st.precision)

  dq = jnp.zeros_like(q, dtype=jnp.float32)
  dq = _visit_blocks(ranges_ref, num_k_blocks, body, dq, st)
  dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def delta_kernel(do_ref, o_ref, dlse_ref, delta_ref):
  """Backward pre-pass D_i = sum_h dO_ih O_ih - dlse_i for a [block_q, H] tile (FA2 Alg. 2 l. 4).

  A kernel rather than an XLA einsum so that the reduction order is fixed by this code: XLA picks
  other reduction tilings for other batch shapes, which broke vmap == unbatched (bitwise).
  """
  prod = do_ref[...].astype(jnp.float32) * o_ref[...].astype(jnp.float32)
  delta_ref[...] = jnp.sum(prod, axis=1) - dlse_ref[...].astype(jnp.float32)

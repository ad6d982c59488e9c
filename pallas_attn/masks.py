"""Mask logic shared by every backend: which key each query sees, and which blocks can be skipped.

Positions are bottom-right aligned like FlashAttention >= 2.1: with ``offset = S - T``, query ``i``
sits at key position ``i + offset``. Causal means ``j <= i + offset``; a window ``(left, right)``
means ``i + offset - left <= j <= i + offset + right`` (``None`` = unbounded on that side).
Causal is canonicalised into the window's right side (``right = min(right, 0)``), so kernels only
ever see a window.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class MaskSpec:
  """Static description of the structured (position-only) part of a mask.

  Attributes:
    left: keys more than ``left`` positions before the query's diagonal are hidden; None = none.
    right: keys more than ``right`` positions after the diagonal are hidden; None = none.
      Causal attention is ``right=0``.
    offset: ``S - T``, the bottom-right alignment shift.
  """
  left: int | None
  right: int | None
  offset: int

  @property
  def is_trivial(self) -> bool:
    return self.left is None and self.right is None


def canonical_window(*, causal: bool, window: tuple[int | None, int | None] | None
                     ) -> tuple[int | None, int | None]:
  left, right = (None, None) if window is None else window
  if causal:
    right = 0 if right is None else min(right, 0)
  return left, right


def position_mask(q_pos: jax.Array, k_pos: jax.Array, spec: MaskSpec) -> jax.Array | None:
  """Boolean visibility from positions (broadcasting); None when nothing is hidden."""
  mask = None
  diag = q_pos + spec.offset
  if spec.right is not None:
    mask = k_pos <= diag + spec.right
  if spec.left is not None:
    lo = k_pos >= diag - spec.left
    mask = lo if mask is None else jnp.logical_and(mask, lo)
  return mask


def and_masks(*masks: jax.Array | None) -> jax.Array | None:
  out = None
  for m in masks:
    if m is None:
      continue
    out = m if out is None else jnp.logical_and(out, m)
  return out


def _key_spans(q_first, q_last, *, spec: MaskSpec, seq_k: int):
  """Keys [lo_key, hi_key) visible to some query in [q_first, q_last] and [lo_all, hi_all)
  visible to all of them (position mask only); every bound clipped to [0, seq_k]."""
  # q_first * 0 rather than zeros_like: under a mesh context zeros_like emits a `reshard` of a
  # literal, which the Mosaic GPU lowering cannot take (this also runs inside kernels).
  zero = q_first * 0
  lo_key = lo_all = zero
  hi_key = hi_all = zero + seq_k                         # exclusive
  if spec.left is not None:
    lo_key = jnp.clip(q_first + spec.offset - spec.left, 0, seq_k)
    lo_all = jnp.clip(q_last + spec.offset - spec.left, 0, seq_k)
  if spec.right is not None:
    hi_key = jnp.clip(q_last + spec.offset + spec.right + 1, 0, seq_k)
    hi_all = jnp.clip(q_first + spec.offset + spec.right + 1, 0, seq_k)
  return lo_key, hi_key, lo_all, hi_all


def _to_blocks(lo_key, hi_key, lo_all, hi_all, block_k: int):
  """Key spans -> (lo, lo_full, hi_full, hi) in blocks of ``block_k``; bounds are >= 0, so
  truncating division is floor division (no floor_divide, which kernels may not lower)."""
  empty = hi_key <= lo_key
  lo = jnp.where(empty, 0, lax.div(lo_key, block_k))
  hi = jnp.where(empty, 0, lax.div(hi_key + (block_k - 1), block_k))
  lo_full = jnp.clip(lax.div(lo_all + (block_k - 1), block_k), lo, hi)
  hi_full = jnp.clip(lax.div(hi_all, block_k), lo_full, hi)
  return lo, lo_full, hi_full, hi


def tile_block_range(q_first, q_last, *, spec: MaskSpec, seq_k: int, block_k: int):
  """``kv_block_ranges`` of one query tile [q_first, q_last] under the position mask alone
  (no kv_lengths, no segment ids); works on traced scalars, e.g. inside a kernel."""
  return _to_blocks(*_key_spans(q_first, q_last, spec=spec, seq_k=seq_k), block_k)


def kv_block_ranges(
    *,
    spec: MaskSpec,
    seq_q: int,
    seq_k: int,
    block_q: int,
    block_k: int,
    batch: int,
    kv_lengths: jax.Array | None = None,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Per (batch, q block): the K/V blocks to visit, split into masked and mask-free parts.

  Returns int32 ``[batch, num_q_blocks, 4]`` holding ``(lo, lo_full, hi_full, hi)``: blocks in
  ``[lo, hi)`` may hold a visible key (the rest are skipped, never computed); blocks in
  ``[lo_full, hi_full)`` are fully visible to every real query of the block (no mask needed);
  ``lo <= lo_full <= hi_full <= hi``. Only real positions (``< seq_q``, ``< seq_k``) count.
  Segment ids shrink ``[lo, hi)`` to the span of keys whose id lies in the q block's id range and
  force masking everywhere (mask-free blocks would need equal ids, which we do not track).
  """
  nq = -(-seq_q // block_q)
  qb = jnp.arange(nq, dtype=jnp.int32)
  q_first = qb * block_q
  q_last = jnp.minimum(q_first + block_q, seq_q) - 1
  lo_key, hi_key, lo_all, hi_all = _key_spans(q_first, q_last, spec=spec, seq_k=seq_k)
  lo_key, hi_key, lo_all, hi_all = (jnp.broadcast_to(x, (batch, nq))
                                    for x in (lo_key, hi_key, lo_all, hi_all))
  if kv_lengths is not None:
    length = jnp.clip(kv_lengths.astype(jnp.int32), 0, seq_k)[:, None]
    hi_key = jnp.minimum(hi_key, length)
    hi_all = jnp.minimum(hi_all, length)
  if q_segment_ids is not None:
    # Segment ids of the block's queries span [smin, smax]; keys outside that id range are hidden.
    pad = nq * block_q - seq_q
    qs = q_segment_ids.astype(jnp.int32)
    big = jnp.iinfo(jnp.int32).max
    smin = jnp.pad(qs, ((0, 0), (0, pad)), constant_values=big).reshape(batch, nq, block_q).min(-1)
    smax = jnp.pad(qs, ((0, 0), (0, pad)), constant_values=-big).reshape(batch, nq, block_q).max(-1)
    ks = kv_segment_ids.astype(jnp.int32)[:, None, :]                    # [B, 1, S]
    hit = (ks >= smin[..., None]) & (ks <= smax[..., None])              # [B, nq, S]
    pos = jnp.arange(seq_k, dtype=jnp.int32)
    first = jnp.min(jnp.where(hit, pos, seq_k), axis=-1)
    last = jnp.max(jnp.where(hit, pos + 1, 0), axis=-1)
    lo_key = jnp.maximum(lo_key, first)
    hi_key = jnp.minimum(hi_key, last)
    hi_all = lo_all                                                      # always mask
  lo, lo_full, hi_full, hi = _to_blocks(lo_key, hi_key, lo_all, hi_all, block_k)
  return jnp.stack([lo, lo_full, hi_full, hi], axis=-1).astype(jnp.int32)


def q_block_ranges(kv_ranges: jax.Array, *, num_k_blocks: int) -> jax.Array:
  """Transpose ``kv_block_ranges`` output: per (batch, K/V block), the Q blocks to visit.

  ``kv_ranges`` is ``[B, nq, 4]`` for the tile sizes of the K/V-outer kernel. Returns
  ``[B, nk, 4]`` with the same ``(lo, lo_full, hi_full, hi)`` meaning along Q blocks. For the
  positional masks the Q blocks that see a K/V block (fully or at all) are contiguous.
  """
  nq = kv_ranges.shape[1]
  j = jnp.arange(num_k_blocks, dtype=jnp.int32)[None, None, :]          # [1, 1, nk]
  r = kv_ranges[..., None]                                               # [B, nq, 4, 1]
  any_ = (r[:, :, 0] <= j) & (j < r[:, :, 3])                            # [B, nq, nk]
  full = (r[:, :, 1] <= j) & (j < r[:, :, 2])
  i = jnp.arange(nq, dtype=jnp.int32)[None, :, None]

  def span(sel):
    first = jnp.min(jnp.where(sel, i, nq), axis=1)
    last = jnp.max(jnp.where(sel, i + 1, 0), axis=1)
    return first, last

  lo, hi = span(any_)
  empty = hi <= lo
  lo, hi = jnp.where(empty, 0, lo), jnp.where(empty, 0, hi)
  flo, fhi = span(full)
  fempty = fhi <= flo
  lo_full = jnp.where(fempty, hi, jnp.clip(flo, lo, hi))
  hi_full = jnp.where(fempty, hi, jnp.clip(fhi, lo_full, hi))
  return jnp.stack([lo, lo_full, hi_full, hi], axis=-1).astype(jnp.int32)

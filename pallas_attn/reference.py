"""Pure-jnp attention with every feature: the test oracle and the "xla" backend.

For each batch b, query head n (in K/V group g = n // (N // K)):

  s_ij   = scale * q_i . k_j                     (softcap: s = c * tanh(s / c))
  s_ij   = -inf where the mask hides key j from query i
  lse_i  = log sum_j exp(s_ij)                   (-inf for a row with no visible key)
  out_i  = sum_j exp(s_ij - lse_i) v_j           (0 for a row with no visible key)

The computation runs in the inputs' dtype (matmul outputs rounded to it, softmax in float32 and
rounded back), so called on bf16 inputs it gives the "ref_lo" of the FlashAttention test rule and
on float32 inputs with precision=HIGHEST the "ref_hi".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_attn import masks


def visible_mask(
    *,
    batch: int,
    seq_q: int,
    seq_k: int,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    kv_lengths: Int[Array, "B"] | None = None,
) -> jax.Array:
  """Boolean ``[B, T, S]``: True where query i may attend to key j."""
  left, right = masks.canonical_window(causal=causal, window=window)
  spec = masks.MaskSpec(left=left, right=right, offset=seq_k - seq_q)
  q_pos = jnp.arange(seq_q)[:, None]
  k_pos = jnp.arange(seq_k)[None, :]
  mask = jnp.ones((batch, seq_q, seq_k), bool)
  pos = masks.position_mask(q_pos, k_pos, spec)
  if pos is not None:
    mask &= pos[None]
  if q_segment_ids is not None:
    mask &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  if kv_lengths is not None:
    mask &= jnp.arange(seq_k)[None, None, :] < kv_lengths[:, None, None]
  return mask


def attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    kv_lengths: Int[Array, "B"] | None = None,
    return_lse: bool = False,
    precision: jax.lax.Precision | None = None,
    accumulate_f32: bool = False,
):
  """Reference attention (see module docstring). Same keywords as ``flash_attention``.

  ``accumulate_f32`` keeps the two matmuls' outputs in float32 (as the kernels do) instead of
  rounding them to the input dtype; the "xla" backend uses it, the tests' ``ref_lo`` does not.

  Example:
    >>> q = k = v = jnp.ones((1, 4, 2, 8), jnp.float32)
    >>> attention(q, k, v, causal=True).shape
    (1, 4, 2, 8)
  """
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  scale = h ** -0.5 if scale is None else scale
  dtype = q.dtype
  mask = visible_mask(batch=b, seq_q=t, seq_k=s, causal=causal, window=window,
                      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                      kv_lengths=kv_lengths)
  # Keys hidden from every query (padding past kv_lengths) may hold garbage, even NaN: zero them
  # so that 0 * NaN never reaches the output.
  key_ok = mask.any(axis=1)                                            # [B, S]
  k = jnp.where(key_ok[:, :, None, None], k, 0)
  v = jnp.where(key_ok[:, :, None, None], v, 0)
  qg = q.reshape(b, t, kh, g, h)
  acc = jnp.float32 if accumulate_f32 else None
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, precision=precision,
                      preferred_element_type=acc).astype(jnp.float32)
  logits = logits * scale
  if softcap is not None:
    logits = softcap * jnp.tanh(logits / softcap)
  mask5 = mask[:, None, None, :, :]
  logits = jnp.where(mask5, logits, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask5, jnp.exp(logits - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  has_key = l > 0
  probs = (p / jnp.where(has_key, l, 1.0)).astype(dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v.astype(dtype), precision=precision,
                   preferred_element_type=acc)
  out = out.reshape(b, t, n, h).astype(dtype)
  if not return_lse:
    return out
  lse = jnp.where(has_key, m + jnp.log(jnp.where(has_key, l, 1.0)), -jnp.inf)
  lse = lse[..., 0].reshape(b, n, t)
  return out, lse

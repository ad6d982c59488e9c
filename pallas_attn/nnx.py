"""Flax NNX integration: a drop-in ``attention_fn`` and a self-attention module.

``nnx.MultiHeadAttention(..., attention_fn=make_attention_fn())`` runs our kernels inside any NNX
model with one import. ``SelfAttention`` is a GQA self-attention layer that also exposes causal,
window, softcap and packed-sequence masks.

Example:
  >>> from flax import nnx
  >>> mha = nnx.MultiHeadAttention(num_heads=4, in_features=64, decode=False,
  ...                              attention_fn=make_attention_fn(), rngs=nnx.Rngs(0))
  >>> y = mha(jnp.ones((2, 16, 64)), is_causal=True)        # [2, 16, 64]
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from pallas_attn.api import flash_attention
from pallas_attn.fp8 import flash_attention_fp8


def make_attention_fn(
    *,
    implementation: str | None = None,
    config: Any = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    interpret: bool | None = None,
    fp8: bool = False,
) -> Callable[..., jax.Array]:
  """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` backed by ``flash_attention``.

  Inputs are ``[..., length, heads, head_dim]`` as in ``nnx.dot_product_attention``. Causal
  masking comes from ``is_causal``; arbitrary ``mask``/``bias`` arrays, attention dropout and weight
  sowing have no tiled equivalent and raise NotImplementedError (use ``SelfAttention`` with segment
  ids for packed sequences). ``fp8``: ``pallas_attn.fp8.flash_attention_fp8`` instead (e4m3
  inputs, forward only: for inference; ``implementation`` then "mosaic", "xla" or None).
  """
  attend = flash_attention_fp8 if fp8 else flash_attention

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                   dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                   precision=None, module=None, is_causal=False, **unused):
    del broadcast_dropout, dropout_rng, precision, unused
    if bias is not None or mask is not None:
      raise NotImplementedError("flash attention_fn takes no dense bias/mask; use is_causal, "
                                "window or pallas_attn.nnx.SelfAttention with segment ids")
    if dropout_rate > 0.0 and not deterministic:
      raise NotImplementedError("attention dropout is not supported by the flash kernels")
    if module is not None:
      raise NotImplementedError("sow_weights needs the attention matrix, which flash never forms")
    lead = query.shape[:-3]
    q, k, v = (x.reshape((-1,) + x.shape[-3:]) for x in (query, key, value))
    if dtype is not None:
      q, k, v = (x.astype(dtype) for x in (q, k, v))
    out = attend(q, k, v, causal=is_causal, window=window, softcap=softcap,
                 implementation=implementation, config=config, interpret=interpret)
    return out.reshape(lead + out.shape[-3:])

  return attention_fn


class SelfAttention(nnx.Module):
  """GQA self-attention: projections around ``flash_attention``.

  Attributes follow ``nnx.MultiHeadAttention``; ``num_kv_heads`` divides ``num_heads``.
  """

  def __init__(self, *, in_features: int, num_heads: int, num_kv_heads: int | None = None,
               head_dim: int | None = None, causal: bool = True,
               window: tuple[int | None, int | None] | None = None, softcap: float | None = None,
               implementation: str | None = None, config: Any = None,
               dtype: jnp.dtype | None = None, rngs: nnx.Rngs):
    num_kv_heads = num_kv_heads or num_heads
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    head_dim = head_dim or in_features // num_heads
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.causal, self.window, self.softcap = causal, window, softcap
    self.implementation, self.config = implementation, config
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
    self.q = lin(in_features, num_heads * head_dim)
    self.k = lin(in_features, num_kv_heads * head_dim)
    self.v = lin(in_features, num_kv_heads * head_dim)
    self.o = lin(num_heads * head_dim, in_features)

  def __call__(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None,
               interpret: bool | None = None) -> Float[Array, "B T D"]:
    b, t, _ = x.shape
    q = self.q(x).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    v = self.v(x).reshape(b, t, self.num_kv_heads, self.head_dim)
    y = flash_attention(q, k, v, causal=self.causal, window=self.window, softcap=self.softcap,
                        q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                        implementation=self.implementation, config=self.config,
                        interpret=interpret)
    return self.o(y.reshape(b, t, self.num_heads * self.head_dim))

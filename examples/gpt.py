"""A small decoder-only GPT in Flax NNX, shared by notebooks, benchmarks and tests.

Parameters carry logical axis names (``nnx.with_partitioning``) so that ``parallel/`` rule presets
can lay the same model out as DP, FSDP, TP, ... without changing this file. Attention is injectable:
``attention_fn(q, k, v, *, causal)`` with the ``[B, T, N, H]`` layout of ``pallas_attn``.

Example:
  >>> from flax import nnx
  >>> cfg = GPTConfig(vocab=256, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, max_len=128)
  >>> model = GPT(cfg, rngs=nnx.Rngs(0))
  >>> logits = model(jnp.zeros((2, 16), jnp.int32))   # [2, 16, 256]
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

AttentionFn = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab: int = 256
  d_model: int = 128
  n_heads: int = 4
  n_kv_heads: int = 4
  n_layers: int = 2
  mlp_ratio: int = 4
  max_len: int = 256
  dtype: jnp.dtype = jnp.float32       # activation / compute dtype
  param_dtype: jnp.dtype = jnp.float32

  def __post_init__(self):
    if self.d_model % self.n_heads:
      raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


def default_attention(q, k, v, *, causal: bool = True):
  """Our flash attention; dispatch picks the fastest backend (the reference on CPU)."""
  import pallas_attn  # local import: examples/ must not make pallas_attn import this file
  return pallas_attn.flash_attention(q, k, v, causal=causal)


def _partitioned(init, names: tuple[str, ...]):
  # Logical names only: parallel/ maps them to mesh axes. eager_sharding=False lets the model be
  # built with no mesh in scope (flax >= 0.12 otherwise shards at creation).
  return nnx.with_partitioning(init, names, eager_sharding=False)


def _linear(cfg: GPTConfig, d_in: int, d_out: int, names: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
  init = _partitioned(nnx.initializers.normal(0.02), names)
  return nnx.Linear(d_in, d_out, use_bias=False, kernel_init=init, dtype=cfg.dtype,
                    param_dtype=cfg.param_dtype, rngs=rngs)


class Attention(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, attention_fn: AttentionFn | None = None):
    self.cfg = cfg
    h = cfg.head_dim
    self.q = _linear(cfg, cfg.d_model, cfg.n_heads * h, ("embed", "heads"), rngs)
    self.k = _linear(cfg, cfg.d_model, cfg.n_kv_heads * h, ("embed", "kv_heads"), rngs)
    self.v = _linear(cfg, cfg.d_model, cfg.n_kv_heads * h, ("embed", "kv_heads"), rngs)
    self.o = _linear(cfg, cfg.n_heads * h, cfg.d_model, ("heads", "embed"), rngs)
    self.attention_fn = attention_fn or default_attention

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    cfg = self.cfg
    q = self.q(x).reshape(b, t, cfg.n_heads, cfg.head_dim)
    k = self.k(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    v = self.v(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    y = self.attention_fn(q, k, v, causal=True)
    return self.o(y.reshape(b, t, cfg.n_heads * cfg.head_dim))


class MLP(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    hidden = cfg.mlp_ratio * cfg.d_model
    self.up = _linear(cfg, cfg.d_model, hidden, ("embed", "mlp"), rngs)
    self.down = _linear(cfg, hidden, cfg.d_model, ("mlp", "embed"), rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, attention_fn: AttentionFn | None = None):
    norm_init = _partitioned(nnx.initializers.ones_init(), ("embed",))
    self.ln1 = nnx.RMSNorm(cfg.d_model, scale_init=norm_init, dtype=cfg.dtype, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs, attention_fn=attention_fn)
    self.ln2 = nnx.RMSNorm(cfg.d_model, scale_init=norm_init, dtype=cfg.dtype, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x))


class GPT(nnx.Module):
  """Token embedding, ``n_layers`` pre-norm blocks, final norm, untied LM head."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, attention_fn: AttentionFn | None = None):
    self.cfg = cfg
    emb_init = _partitioned(nnx.initializers.normal(0.02), ("vocab", "embed"))
    self.embed = nnx.Embed(cfg.vocab, cfg.d_model, embedding_init=emb_init, dtype=cfg.dtype,
                           param_dtype=cfg.param_dtype, rngs=rngs)
    pos_init = _partitioned(nnx.initializers.normal(0.02), ("seq", "embed"))
    self.pos = nnx.Param(pos_init(rngs.params(), (cfg.max_len, cfg.d_model), cfg.param_dtype))
    self.blocks = nnx.List([Block(cfg, rngs=rngs, attention_fn=attention_fn)
                            for _ in range(cfg.n_layers)])
    norm_init = _partitioned(nnx.initializers.ones_init(), ("embed",))
    self.ln_f = nnx.RMSNorm(cfg.d_model, scale_init=norm_init, dtype=cfg.dtype, rngs=rngs)
    self.head = _linear(cfg, cfg.d_model, cfg.vocab, ("embed", "vocab"), rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    t = tokens.shape[1]
    if t > self.cfg.max_len:
      raise ValueError(f"sequence length {t} exceeds max_len={self.cfg.max_len}")
    x = self.embed(tokens) + self.pos[...][:t].astype(self.cfg.dtype)
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x))


def next_token_loss(model: GPT, tokens: jax.Array) -> jax.Array:
  """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]."""
  logits = model(tokens[:, :-1]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return nll.mean()

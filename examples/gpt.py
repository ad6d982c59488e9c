"""A small decoder-only GPT in Flax NNX, shared by notebooks, benchmarks and tests.

Parameters carry logical axis names (``nnx.with_partitioning``) so that ``parallel/`` rule presets
can lay the same model out as DP, FSDP, TP, ... without changing this file. Attention is injectable:
``attention_fn(q, k, v, *, causal)`` with the ``[B, T, N, H]`` layout of ``pallas_attn``.

Hooks for ``parallel/`` (both ``None`` by default, set on a traced copy by ``make_train_step``):
``activation_sharding(x, logical_names)`` constrains activations (``("batch", "length",
"act_embed")`` for the residual stream, ``act_heads`` / ``act_mlp`` / ``act_vocab`` inside), and
``GPT.layer_runner(apply, params, x, *, stacked)`` applies the blocks (activation checkpointing,
pipelines). ``GPTConfig(scan_layers=True)`` stacks the blocks' parameters on a leading ``"layers"``
axis (same initial values as the list of blocks) so a pipeline can split them over stages.

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
  scan_layers: bool = False            # stack the blocks' params on a leading "layers" axis (pipelines)

  def __post_init__(self):
    if self.d_model % self.n_heads:
      raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
    if self.n_layers < 1:
      raise ValueError(f"n_layers={self.n_layers} must be >= 1")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


def default_attention(q, k, v, *, causal: bool = True):
  """Our flash attention; dispatch picks the fastest backend (the reference on CPU)."""
  import pallas_attn  # local import: examples/ must not make pallas_attn import this file
  return pallas_attn.flash_attention(q, k, v, causal=causal)


def dense_attention(q, k, v, *, causal: bool = True):
  """Plain jnp attention (GQA, bottom-right causal); the same maths as the kernels, for tests.

  Example:
    >>> model = GPT(cfg, rngs=nnx.Rngs(0), attention_fn=dense_attention)
  """
  b, t, n, h = q.shape
  s, kv = k.shape[1], k.shape[2]
  q = q.reshape(b, t, kv, n // kv, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, k).astype(jnp.float32) / jnp.sqrt(h).astype(jnp.float32)
  if causal:
    visible = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t)
    logits = jnp.where(visible, logits, -jnp.inf)
  weights = jax.nn.softmax(logits, axis=-1)
  weights = jnp.where(jnp.isnan(weights), 0.0, weights).astype(v.dtype)
  return jnp.einsum("bkgts,bskh->btkgh", weights, v).reshape(b, t, n, h)


def _constrain(module: nnx.Module, x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
  # Activation sharding hook: parallel/ installs a callable (x, logical names) -> x on the copy of
  # the model it traces; by default it is None and this is the identity.
  fn = getattr(module, "activation_sharding", None)
  return x if fn is None else fn(x, names)


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
    self.activation_sharding = None

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    cfg = self.cfg
    q = self.q(x).reshape(b, t, cfg.n_heads, cfg.head_dim)
    k = self.k(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    v = self.v(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
    q = _constrain(self, q, ("batch", None, "act_heads", None))
    k = _constrain(self, k, ("batch", None, "act_kv_heads", None))
    v = _constrain(self, v, ("batch", None, "act_kv_heads", None))
    y = self.attention_fn(q, k, v, causal=True)
    y = _constrain(self, y, ("batch", None, "act_heads", None))
    return self.o(y.reshape(b, t, cfg.n_heads * cfg.head_dim))


class MLP(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
    hidden = cfg.mlp_ratio * cfg.d_model
    self.up = _linear(cfg, cfg.d_model, hidden, ("embed", "mlp"), rngs)
    self.down = _linear(cfg, hidden, cfg.d_model, ("mlp", "embed"), rngs)
    self.activation_sharding = None

  def __call__(self, x: jax.Array) -> jax.Array:
    h = _constrain(self, jax.nn.gelu(self.up(x)), ("batch", None, "act_mlp"))
    return self.down(h)


class Block(nnx.Module):
  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, attention_fn: AttentionFn | None = None):
    norm_init = _partitioned(nnx.initializers.ones_init(), ("embed",))
    self.ln1 = nnx.RMSNorm(cfg.d_model, scale_init=norm_init, dtype=cfg.dtype, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs, attention_fn=attention_fn)
    self.ln2 = nnx.RMSNorm(cfg.d_model, scale_init=norm_init, dtype=cfg.dtype, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)
    self.activation_sharding = None

  def __call__(self, x: jax.Array) -> jax.Array:
    x = _constrain(self, x + self.attn(self.ln1(x)), _RESIDUAL)
    return _constrain(self, x + self.mlp(self.ln2(x)), _RESIDUAL)


_RESIDUAL = ("batch", "length", "act_embed")
LayerRunner = Callable[..., jax.Array]


class StackedBlocks(nnx.Module):
  """``n_layers`` blocks held as one ``Block`` whose parameters have a leading ``"layers"`` axis.

  The blocks are initialised exactly like the list of ``GPTConfig(scan_layers=False)`` (same
  random stream), then stacked, so both variants hold the same numbers. Applied with
  ``lax.scan``, or by a ``runner(apply, stacked_state, x, stacked=True)`` (pipelines).

  Example:
    >>> blocks = StackedBlocks(GPTConfig(d_model=32, n_layers=4), rngs=nnx.Rngs(0))
    >>> blocks.layers.mlp.up.kernel.shape
    (4, 32, 128)
  """

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, attention_fn: AttentionFn | None = None):
    blocks = [Block(cfg, rngs=rngs, attention_fn=attention_fn) for _ in range(cfg.n_layers)]
    graphdef, _ = nnx.split(blocks[0])
    states = [nnx.state(b) for b in blocks]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)

    def add_layer_axis(v):
      meta = v.get_metadata()
      names = ("layers",) + tuple(meta.get("out_sharding") or (None,) * (v.get_value().ndim - 1))
      return type(v)(v.get_value(), **{**meta, "out_sharding": names})

    stacked = jax.tree.map(add_layer_axis, stacked, is_leaf=lambda x: isinstance(x, nnx.Variable))
    self.layers = nnx.merge(graphdef, stacked)
    self.n_layers = cfg.n_layers

  def __call__(self, x: jax.Array, *, runner: LayerRunner | None = None) -> jax.Array:
    graphdef, state = nnx.split(self.layers)

    def apply(layer_state, x):
      return nnx.merge(graphdef, layer_state)(x)

    if runner is not None:
      return runner(apply, state, x, stacked=True)
    x, _ = jax.lax.scan(lambda x, s: (apply(s, x), None), x, state)
    return x


class GPT(nnx.Module):
  """Token embedding, ``n_layers`` pre-norm blocks, final norm, untied LM head."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, attention_fn: AttentionFn | None = None):
    self.cfg = cfg
    emb_init = _partitioned(nnx.initializers.normal(0.02), ("vocab", "embed"))
    self.embed = nnx.Embed(cfg.vocab, cfg.d_model, embedding_init=emb_init, dtype=cfg.dtype,
                           param_dtype=cfg.param_dtype, rngs=rngs)
    pos_init = _partitioned(nnx.initializers.normal(0.02), ("seq", "embed"))
    self.pos = nnx.Param(pos_init(rngs.params(), (cfg.max_len, cfg.d_model), cfg.param_dtype))
    if cfg.scan_layers:
      self.blocks = StackedBlocks(cfg, rngs=rngs, attention_fn=attention_fn)
    else:
      self.blocks = nnx.List([Block(cfg, rngs=rngs, attention_fn=attention_fn)
                              for _ in range(cfg.n_layers)])
    norm_init = _partitioned(nnx.initializers.ones_init(), ("embed",))
    self.ln_f = nnx.RMSNorm(cfg.d_model, scale_init=norm_init, dtype=cfg.dtype, rngs=rngs)
    self.head = _linear(cfg, cfg.d_model, cfg.vocab, ("embed", "vocab"), rngs)
    self.activation_sharding = None
    # Hook for parallel/: runner(apply, params, x, *, stacked) applies the blocks, where
    # apply(layer_state, x) runs one block; params is a list of per-block states, or one
    # state with a leading layer axis (stacked=True). None: a plain loop / lax.scan.
    self.layer_runner: LayerRunner | None = None

  def __call__(self, tokens: jax.Array) -> jax.Array:
    t = tokens.shape[1]
    if t > self.cfg.max_len:
      raise ValueError(f"sequence length {t} exceeds max_len={self.cfg.max_len}")
    x = self.embed(tokens) + self.pos[...][:t].astype(self.cfg.dtype)
    x = _constrain(self, x, _RESIDUAL)
    if isinstance(self.blocks, StackedBlocks):
      x = self.blocks(x, runner=self.layer_runner)
    elif self.layer_runner is not None:
      graphdef = nnx.graphdef(self.blocks[0])
      states = [nnx.state(block) for block in self.blocks]
      x = self.layer_runner(lambda s, x: nnx.merge(graphdef, s)(x), states, x, stacked=False)
    else:
      for block in self.blocks:
        x = block(x)
    logits = self.head(self.ln_f(x))
    return _constrain(self, logits, ("batch", "length", "act_vocab"))


def next_token_loss(model: GPT, tokens: jax.Array) -> jax.Array:
  """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]."""
  logits = model(tokens[:, :-1]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return nll.mean()


def next_token_nll(model: GPT, tokens: jax.Array, *, pad_id: int | None = None
                   ) -> tuple[jax.Array, jax.Array]:
  """Summed cross-entropy of tokens[:, 1:] and the number of target tokens counted.

  Targets equal to ``pad_id`` are skipped. ``sum / count`` is the exact mean over the batch, and
  stays exact when the batch is split into micro-batches (gradient accumulation).

  Example:
    >>> total, count = next_token_nll(model, tokens, pad_id=0)
  """
  logits = model(tokens[:, :-1]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits, axis=-1)
  targets = tokens[:, 1:]
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  mask = jnp.ones_like(nll) if pad_id is None else (targets != pad_id).astype(nll.dtype)
  return (nll * mask).sum(), mask.sum()

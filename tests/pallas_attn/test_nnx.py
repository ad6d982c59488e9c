"""Flax NNX integration: the same block gives the same output and gradients with our kernel."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_attn.nnx import SelfAttention, make_attention_fn


class Block(nnx.Module):
  def __init__(self, attention_fn, rngs):
    self.ln = nnx.LayerNorm(64, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=64, decode=False,
                                       attention_fn=attention_fn, rngs=rngs)
    self.mlp = nnx.Linear(64, 64, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln(x), is_causal=True)
    return x + self.mlp(jax.nn.gelu(x))


def _out_and_grads(attention_fn, x):
  model = Block(attention_fn, nnx.Rngs(0))
  loss = lambda m: jnp.sum(m(x) * jnp.cos(jnp.arange(x.size).reshape(x.shape)))
  return model(x), nnx.grad(loss)(model)


@pytest.mark.parametrize("implementation", ["triton", "xla"])
def test_block_matches_flax_reference(implementation):
  x = jax.random.normal(jax.random.key(0), (2, 48, 64), jnp.float32)
  # float32 arithmetic in both models (XLA:GPU's default for float32 dots is TF32, ~1e-3).
  with jax.default_matmul_precision("float32"):
    ref_out, ref_grads = _out_and_grads(nnx.dot_product_attention, x)
    out, grads = _out_and_grads(make_attention_fn(implementation=implementation), x)
  np.testing.assert_allclose(out, ref_out, rtol=2e-5, atol=2e-5)
  flat_ref = jax.tree.leaves(nnx.state(ref_grads))
  flat = jax.tree.leaves(nnx.state(grads))
  assert len(flat) == len(flat_ref) > 0
  for a, b in zip(flat, flat_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_fp8_attention_fn_serves_inference():
  """``make_attention_fn(fp8=True)``: the block's output within FP8's error of the float32 one
  (e4m3 inputs: ~3% of the attention output, less after the residual), no gradients."""
  x = jax.random.normal(jax.random.key(0), (2, 48, 64), jnp.float32)
  model = Block(nnx.dot_product_attention, nnx.Rngs(0))
  ref = model(x)
  model.attn.attention_fn = make_attention_fn(fp8=True, implementation="xla")
  out = model(x)
  assert out.dtype == ref.dtype and out.shape == ref.shape
  err = float(jnp.abs(out - ref).mean() / jnp.abs(ref).mean())
  assert 0.0 < err < 0.03, err
  with pytest.raises(NotImplementedError, match="forward only"):
    nnx.grad(lambda m: m(x).sum())(model)


def test_attention_fn_rejects_dense_mask():
  fn = make_attention_fn()
  q = jnp.ones((1, 8, 2, 16))
  with pytest.raises(NotImplementedError, match="mask"):
    fn(q, q, q, mask=jnp.ones((1, 2, 8, 8), bool))
  with pytest.raises(NotImplementedError, match="dropout"):
    fn(q, q, q, dropout_rate=0.1)


def test_self_attention_segments_isolate_sequences():
  """Packed sequences: changing sequence 1's tokens must not change sequence 0's outputs."""
  layer = SelfAttention(in_features=32, num_heads=4, num_kv_heads=2, implementation="triton",
                        rngs=nnx.Rngs(1))
  x = jax.random.normal(jax.random.key(2), (1, 40, 32), jnp.float32)
  seg = jnp.array([[0] * 24 + [1] * 16], jnp.int32)
  y1 = layer(x, segment_ids=seg)
  y2 = layer(x.at[:, 24:].set(7.0), segment_ids=seg)
  np.testing.assert_array_equal(y1[:, :24], y2[:, :24])
  assert not np.allclose(y1[:, 24:], y2[:, 24:])
  with pytest.raises(ValueError, match="num_kv_heads"):
    SelfAttention(in_features=32, num_heads=4, num_kv_heads=3, rngs=nnx.Rngs(0))

"""Helpers shared by the parallel/ tests (a tiny GPT config, tokens, tree comparisons)."""
import jax
import jax.numpy as jnp
import numpy as np

from examples.gpt import GPTConfig

# Fewer LLVM passes: 3x faster CPU compiles, which dominate these tests' runtime.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def tiny_config(**changes) -> GPTConfig:
  base = dict(vocab=64, d_model=32, n_heads=8, n_kv_heads=8, n_layers=2, mlp_ratio=4, max_len=16)
  base.update(changes)
  return GPTConfig(**base)


def make_tokens(batch: int = 8, length: int = 17, *, seed: int = 1, pad_rows: int = 3) -> jax.Array:
  """Random tokens; the first ``pad_rows`` rows end in padding (id 0) of different lengths."""
  tokens = np.array(jax.random.randint(jax.random.key(seed), (batch, length), 1, 64))
  for r in range(min(pad_rows, batch)):
    tokens[r, length - 3 * (r + 1):] = 0
  return jnp.asarray(tokens, jnp.int32)


def assert_trees_close(actual, expected, *, rtol=1e-5, atol=1e-6, what="", scale_atol=False):
  """rtol / atol per element; ``scale_atol`` multiplies atol by max(1, max|expected|) of the leaf
  (float32 sums err in proportion to their terms, not their result, when terms cancel)."""
  a_leaves, a_tree = jax.tree.flatten(actual)
  e_leaves, e_tree = jax.tree.flatten(expected)
  assert a_tree == e_tree, f"{what}: tree structures differ"
  for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
    a, e = np.asarray(a), np.asarray(e)
    assert np.isfinite(a).all(), f"{what} leaf {i} has non-finite values"
    tol = atol * max(1.0, float(np.abs(e).max(initial=0.0))) if scale_atol else atol
    np.testing.assert_allclose(a, e, rtol=rtol, atol=tol, err_msg=f"{what} leaf {i}")


def assert_trees_equal(actual, expected, *, what=""):
  a_leaves, a_tree = jax.tree.flatten(actual)
  e_leaves, e_tree = jax.tree.flatten(expected)
  assert a_tree == e_tree, f"{what}: tree structures differ"
  for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
    a, e = np.asarray(a), np.asarray(e)
    assert a.dtype == e.dtype and a.shape == e.shape, f"{what} leaf {i}"
    assert a.tobytes() == e.tobytes(), f"{what} leaf {i} not bitwise equal"

"""shard_map tensor parallel layers equal dense matmuls, with the expected collectives."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parallel
from parallel import tensor as T
from parallel_helpers import FAST_COMPILE, assert_trees_close


def inputs():
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (4, 8, 16))
  w_up = jax.random.normal(k[1], (16, 64)) * 0.2
  w_down = jax.random.normal(k[2], (64, 16)) * 0.2
  ct = jax.random.normal(k[3], x.shape)
  return x, w_up, w_down, ct


def dense_mlp(x, w_up, w_down):
  return jax.nn.gelu(x @ w_up) @ w_down


def collectives(fn, *args):
  hlo = jax.jit(fn, compiler_options=FAST_COMPILE).lower(*args).compile().as_text()
  return {c: hlo.count(f" {c}(") + hlo.count(f" {c}-start(")
          for c in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")}


MODES = [(False, False), (True, False), (True, True)]


@pytest.mark.parametrize("sp,cm", MODES, ids=["tp", "tp+sp", "tp+sp+collective_matmul"])
def test_mlp_matches_dense_forward_and_grads(sp, cm):
  mesh = parallel.make_mesh(data=2, tensor=4)
  x, w_up, w_down, ct = inputs()
  f = functools.partial(T.mlp, mesh=mesh, sequence_parallel=sp, collective_matmul=cm)
  y = jax.jit(f, compiler_options=FAST_COMPILE)(x, w_up, w_down)
  np.testing.assert_allclose(y, dense_mlp(x, w_up, w_down), rtol=1e-5, atol=1e-6)
  loss = lambda fn: (lambda *a: (fn(*a) * ct).sum())
  grads = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)), compiler_options=FAST_COMPILE)(
      x, w_up, w_down)
  ref = jax.grad(loss(dense_mlp), argnums=(0, 1, 2))(x, w_up, w_down)
  assert_trees_close(grads, ref, what="mlp grads", scale_atol=True)


def test_collectives_per_block_forward():
  mesh = parallel.make_mesh(data=2, tensor=4)
  x, w_up, w_down, _ = inputs()
  plain = collectives(functools.partial(T.mlp, mesh=mesh), x, w_up, w_down)
  assert plain == {"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0, "collective-permute": 0}
  sp = collectives(functools.partial(T.mlp, mesh=mesh, sequence_parallel=True), x, w_up, w_down)
  assert sp == {"all-reduce": 0, "all-gather": 1, "reduce-scatter": 1, "collective-permute": 0}
  cm = collectives(functools.partial(T.mlp, mesh=mesh, sequence_parallel=True,
                                     collective_matmul=True), x, w_up, w_down)
  # n - 1 = 3 ring hops for the gather side and 3 for the scatter side, no bulk collectives.
  assert cm == {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0, "collective-permute": 6}


def test_column_and_row_layouts():
  mesh = parallel.make_mesh(tensor=8)
  x, w_up, w_down, _ = inputs()
  h = T.column_parallel(x, w_up, mesh=mesh)
  assert h.sharding.spec[-1] == "tensor"
  assert h.addressable_shards[0].data.shape == (4, 8, 64 // 8)
  # Column parallel has no cross-device reduction, so it matches the dense matmul to float32
  # rounding of one K = 16 dot product. Not bitwise: XLA:CPU may pick a different GEMM kernel
  # (and K summation order) for the 8-column shards than for the 64-column matrix; a fresh-clone
  # CI run saw last-bit differences (max 4.8e-7) where earlier runs were bitwise equal.
  np.testing.assert_allclose(np.asarray(h), np.asarray(jax.jit(jnp.matmul)(x, w_up)),
                             rtol=1e-6, atol=2e-6)
  y = T.row_parallel(h, w_down, mesh=mesh, sequence_parallel=True)
  assert y.addressable_shards[0].data.shape == (4, 1, 16)
  np.testing.assert_allclose(y, (x @ w_up) @ w_down, rtol=1e-5, atol=1e-5)


def test_parallel_mlp_module():
  mesh = parallel.make_mesh(data=2, tensor=4)
  layer = T.ParallelMLP(16, 64, mesh=mesh, rngs=nnx.Rngs(0), sequence_parallel=True)
  x = inputs()[0]
  np.testing.assert_allclose(layer(x), dense_mlp(x, layer.w_up[...], layer.w_down[...]),
                             rtol=1e-5, atol=1e-6)
  assert layer.w_up.get_metadata()["out_sharding"] == ("embed", "mlp")


BAD = [
    (dict(w_up=jnp.zeros((16, 62))), r"columns dimension 62 is not divisible by mesh axis 'tensor'"),
    (dict(x=jnp.zeros((4, 6, 16)), sequence_parallel=True), r"sequence length 6"),
    (dict(x=jnp.zeros((3, 8, 16))), r"batch 3 is not divisible"),
    (dict(x=jnp.zeros((4, 8, 12))), r"x features 12 != w rows 16"),
    (dict(collective_matmul=True), r"collective_matmul=True .* needs sequence_parallel=True"),
    (dict(axis="model"), r"mesh has no axis 'model'"),
]


@pytest.mark.parametrize("changes,match", BAD)
def test_bad_inputs(changes, match):
  mesh = parallel.make_mesh(data=2, tensor=4)
  x, w_up, w_down, _ = inputs()
  args = dict(x=x, w_up=w_up, w_down=w_down)
  args.update({k: v for k, v in changes.items() if k in args})
  kw = {k: v for k, v in changes.items() if k not in args}
  with pytest.raises(ValueError, match=match):
    T.mlp(args["x"], args["w_up"], args["w_down"], mesh=mesh, **kw)

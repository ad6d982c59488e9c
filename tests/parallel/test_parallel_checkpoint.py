"""Checkpoints: saved at fsdp=8, restored bitwise on other meshes; resuming equals not stopping."""
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallel
from parallel import checkpoint
from parallel import rules as R
from examples.gpt import GPT, dense_attention, next_token_nll
from parallel_helpers import FAST_COMPILE, assert_trees_equal, make_tokens, tiny_config

loss_fn = functools.partial(next_token_nll, pad_id=0)


def make(mesh, rules):
  model = GPT(tiny_config(), rngs=nnx.Rngs(0), attention_fn=dense_attention)
  step = parallel.make_train_step(model, optax.adamw(1e-2), loss_fn, mesh=mesh, rules=rules,
                                  compiler_options=FAST_COMPILE)
  return model, step


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Two Adam steps at fsdp=8, saved."""
  model, step = make(parallel.make_mesh(fsdp=8), R.FSDP)
  state = step.init(model)
  for _ in range(2):
    state, _ = step(state, make_tokens())
  path = tmp_path_factory.mktemp("ckpt") / "step_2"
  checkpoint.save(path, state)
  return path, jax.device_get(state), (model, step, state)


@pytest.mark.parametrize("mesh_kw,rules", [
    (dict(fsdp=4, tensor=2), R.FSDP_TP),
    (dict(data=2, fsdp=2, tensor=2), R.FSDP_TP),
    (dict(devices=jax.devices()[:1]), R.DP),
], ids=["fsdp4-tensor2", "2x2x2", "1-device"])
def test_restore_on_another_mesh_is_bitwise(saved, mesh_kw, rules):
  path, host_state, _ = saved
  model, step = make(parallel.make_mesh(**mesh_kw), rules)
  restored = checkpoint.restore(path, target=step.abstract_state(model))
  assert_trees_equal(jax.device_get(restored), host_state, what="restored state")
  kernel = restored.params["blocks"][0]["mlp"]["up"]["kernel"].get_value()
  assert kernel.sharding == step.param_shardings["blocks"][0]["mlp"]["up"]["kernel"]
  assert kernel.sharding.mesh.shape == step.mesh.shape
  # The restored state trains on its new mesh.
  state, metrics = step(restored, make_tokens())
  assert np.isfinite(float(metrics["loss"])) and int(state.step) == 3


def test_resumed_run_equals_uninterrupted(saved):
  path, _, (model, step, state) = saved
  uninterrupted, _ = step(state, make_tokens(seed=5))
  restored = checkpoint.restore(path, target=step.abstract_state(model))
  resumed, _ = step(restored, make_tokens(seed=5))
  assert_trees_equal(jax.device_get(resumed), jax.device_get(uninterrupted), what="resumed")


def test_bad_checkpoint_use(saved, tmp_path):
  path, host_state, (model, step, state) = saved
  with pytest.raises(ValueError, match="exists"):
    checkpoint.save(path, state)
  with pytest.raises(ValueError, match="no checkpoint"):
    checkpoint.restore(tmp_path / "missing", target=step.abstract_state(model))
  other = GPT(tiny_config(n_layers=3), rngs=nnx.Rngs(0), attention_fn=dense_attention)
  _, step3 = make(parallel.make_mesh(fsdp=8), R.FSDP)
  big = parallel.make_train_step(other, optax.adamw(1e-2), loss_fn, mesh=step3.mesh, rules=R.FSDP)
  with pytest.raises(ValueError, match="does not match the target"):
    checkpoint.restore(path, target=big.abstract_state(other))


def test_restore_checks_dtypes_and_keeps_python_scalars(tmp_path):
  """A target of another dtype raises (orbax would cast float32 -> bfloat16 silently), and
  Python scalars saved beside the arrays come back as such (audit, session 23)."""
  x = jax.numpy.arange(8.0)
  checkpoint.save(tmp_path / "c", {"x": x, "lr": 0.5, "n": 3})
  back = checkpoint.restore(tmp_path / "c", target={"x": x, "lr": 0.0, "n": 0})
  assert back["lr"] == 0.5 and back["n"] == 3
  np.testing.assert_array_equal(np.asarray(back["x"]), np.asarray(x))
  with pytest.raises(ValueError, match="dtype float32, the target bfloat16"):
    checkpoint.restore(tmp_path / "c", target={"x": x.astype(jax.numpy.bfloat16), "lr": 0.0,
                                               "n": 0})

"""make_train_step: every rules preset on meshes (8,), (2,4), (2,2,2) equals one device."""
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallel
from parallel import rules as R
from parallel.pipeline import PipelineConfig
from examples.gpt import GPT, dense_attention, next_token_nll
from parallel_helpers import FAST_COMPILE, assert_trees_close, make_tokens, tiny_config

STEPS = 3
loss_fn = functools.partial(next_token_nll, pad_id=0)


def optimizer():
  # SGD with momentum: linear in the gradients, so rounding differences of the reductions stay at
  # the 1e-7 level after 3 steps (Adam's g / sqrt(v) turns them into O(lr) flips on tiny grads).
  return optax.chain(optax.clip_by_global_norm(10.0), optax.sgd(0.1, momentum=0.9))


def train(cfg, mesh, rules, *, tokens, **kw):
  model = GPT(cfg, rngs=nnx.Rngs(0), attention_fn=dense_attention)
  step = parallel.make_train_step(model, optimizer(), loss_fn, mesh=mesh, rules=rules,
                                  compiler_options=FAST_COMPILE, **kw)
  state = step.init(model)
  losses, grads = [], None
  for i in range(STEPS):
    state, metrics = step(state, tokens, return_grads=True)
    losses.append(metrics["loss"])
    grads = metrics["grads"] if i == 0 else grads
  return {"losses": losses, "grads": grads, "params": state.params}, state


@functools.lru_cache(maxsize=None)
def reference(scan_layers: bool, n_layers: int):
  single = parallel.make_mesh(devices=jax.devices()[:1])
  out, _ = train(tiny_config(scan_layers=scan_layers, n_layers=n_layers), single, R.DP,
                 tokens=make_tokens())
  return jax.device_get(out)


MESHES = {
    "DP": [dict(data=8), dict(data=2, fsdp=4), dict(data=2, fsdp=2, tensor=2)],
    "ZERO1": [dict(fsdp=8), dict(data=2, fsdp=4), dict(data=2, fsdp=2, tensor=2)],
    "FSDP": [dict(fsdp=8), dict(data=2, fsdp=4), dict(data=2, fsdp=2, tensor=2)],
    "TP": [dict(tensor=8), dict(data=2, tensor=4), dict(data=2, fsdp=2, tensor=2)],
    "TP_SP": [dict(tensor=8), dict(data=2, tensor=4), dict(data=2, fsdp=2, tensor=2)],
    "FSDP_TP": [dict(fsdp=8), dict(fsdp=2, tensor=4), dict(data=2, fsdp=2, tensor=2)],
}
CASES = [(name, kw) for name, meshes in MESHES.items() for kw in meshes]


@pytest.mark.parametrize("preset,mesh_kw", CASES,
                         ids=[f"{n}-{'x'.join(map(str, k.values()))}" for n, k in CASES])
def test_preset_matches_single_device(preset, mesh_kw):
  rules = R.PRESETS[preset]
  mesh = parallel.make_mesh(**mesh_kw)
  out, state = train(tiny_config(), mesh, rules, tokens=make_tokens())
  ref = reference(False, 2)
  assert_trees_close(out["losses"], ref["losses"], what="loss")
  assert_trees_close(out["grads"], ref["grads"], what="grads")
  assert_trees_close(out["params"], ref["params"], what="params after 3 steps")
  # The layout is the one the preset asks for.
  up = state.params["blocks"][0]["mlp"]["up"]["kernel"]
  expected = jax.sharding.PartitionSpec(*rules.param_axes(("embed", "mlp")))
  assert up.get_value().sharding.spec == expected
  # Replicas hold bitwise identical copies.
  shards = [np.asarray(s.data) for s in up.get_value().addressable_shards]
  index = [s.index for s in up.get_value().addressable_shards]
  for a, ia in zip(shards, index):
    for b, ib in zip(shards, index):
      if ia == ib:
        assert np.array_equal(a, b)


def test_zero1_shards_optimizer_state_only():
  mesh = parallel.make_mesh(fsdp=8)
  model = GPT(tiny_config(), rngs=nnx.Rngs(0), attention_fn=dense_attention)
  step = parallel.make_train_step(model, optax.adam(1e-3), loss_fn, mesh=mesh, rules=R.ZERO1)
  state = step.init(model)
  kernel = state.params["blocks"][0]["mlp"]["up"]["kernel"].get_value()
  mu = state.opt_state[0].mu["blocks"][0]["mlp"]["up"]["kernel"].get_value()
  assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, None)
  assert mu.sharding.spec == jax.sharding.PartitionSpec("fsdp", None)
  assert mu.addressable_shards[0].data.shape == (32 // 8, 128)


def test_grad_accum_uses_exact_token_count():
  # Padding sits in the first rows, so micro-batches hold different numbers of tokens: only the
  # exact (sum / total count) denominator matches the full-batch step.
  mesh = parallel.make_mesh(data=2, fsdp=4)
  tokens = make_tokens(batch=16, pad_rows=6, seed=3)
  single = parallel.make_mesh(devices=jax.devices()[:1])
  ref, _ = train(tiny_config(), single, R.DP, tokens=tokens)
  out, _ = train(tiny_config(), mesh, R.FSDP, tokens=tokens, grad_accum=2)
  assert_trees_close(out["losses"], ref["losses"], what="loss")
  assert_trees_close(out["grads"], ref["grads"], what="grads")
  assert_trees_close(out["params"], ref["params"], what="params")


PIPELINE_CASES = [
    ("PP", dict(stage=2, data=4), PipelineConfig(schedule="gpipe", microbatches=2), "none"),
    ("FSDP_TP_PP", dict(stage=2, fsdp=2, tensor=2),
     PipelineConfig(schedule="1f1b", microbatches=4), "none"),
    ("FSDP_PP", dict(stage=2, fsdp=4),
     PipelineConfig(schedule="interleaved", microbatches=2, virtual_stages=2), "full"),
]


@pytest.mark.parametrize("preset,mesh_kw,config,remat", PIPELINE_CASES,
                         ids=[c[0] + "-" + c[2].schedule for c in PIPELINE_CASES])
def test_pipelined_train_step_matches_single_device(preset, mesh_kw, config, remat):
  mesh = parallel.make_mesh(**mesh_kw)
  cfg = tiny_config(scan_layers=True, n_layers=4)
  out, state = train(cfg, mesh, R.PRESETS[preset], tokens=make_tokens(), pipeline=config,
                     remat=remat)
  ref = reference(True, 4)
  assert_trees_close(out["losses"], ref["losses"], what="loss")
  assert_trees_close(out["grads"], ref["grads"], what="grads")
  assert_trees_close(out["params"], ref["params"], what="params after 3 steps")
  up = state.params["blocks"]["layers"]["mlp"]["up"]["kernel"].get_value()
  assert up.sharding.spec[0] == "stage"
  assert up.addressable_shards[0].data.shape[0] == 4 // mesh.shape["stage"]


def test_remat_policies_give_same_gradients():
  mesh = parallel.make_mesh(data=8)
  ref = reference(False, 2)
  out, _ = train(tiny_config(), mesh, R.DP, tokens=make_tokens(), remat="full")
  assert_trees_close(out["grads"], ref["grads"], what="grads with remat")


def test_state_beyond_params_raises_a_clear_error():
  """A loss that advances an RNG stream (nnx.Dropout with its own rngs) needs state the step
  does not carry: NotImplementedError saying so, not flax's trace-level error (audit, session
  23)."""
  class Dropped(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(8, 8, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(self.lin(x))

  model = Dropped(nnx.Rngs(0))
  loss = lambda m, batch: jax.numpy.mean(m(batch) ** 2)
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  step = parallel.make_train_step(model, optax.sgd(0.1), loss, mesh=mesh, rules=R.DP)
  state = step.init(model)
  with pytest.raises(NotImplementedError, match="nnx.Param state"):
    step(state, jax.numpy.ones((4, 8)))

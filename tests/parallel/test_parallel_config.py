"""Bad configurations raise ValueError naming the problem; mesh and rules basics."""
import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import parallel
from parallel import rules as R
from parallel.pipeline import PipelineConfig
from parallel.sharding import ActivationSharding, batch_sharding, state_shardings
from examples.gpt import GPT, dense_attention, next_token_loss
from parallel_helpers import tiny_config


def test_make_mesh_axes_and_order():
  mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
  assert mesh.axis_names == ("stage", "data", "fsdp", "tensor")
  assert dict(mesh.shape) == {"stage": 1, "data": 2, "fsdp": 2, "tensor": 2}
  # tensor is innermost: neighbours on the tensor axis are consecutive devices.
  assert [d.id for d in mesh.devices[0, 0, 0]] == [0, 1]
  one = parallel.make_mesh(devices=jax.devices()[:1])
  assert one.size == 1


@pytest.mark.parametrize("kw,match", [
    (dict(data=3), r"8 devices were given.*= 3 devices|3 devices, but 8"),
    (dict(data=2, fsdp=2), r"= 4 devices, but 8 devices were given"),
    (dict(tensor=0, data=8), r"tensor=0 must be a positive integer"),
    (dict(fsdp=2.0, data=4), r"fsdp=2.0 must be a positive integer"),
])
def test_make_mesh_bad(kw, match):
  with pytest.raises(ValueError, match=match):
    parallel.make_mesh(**kw)


def test_rules_tables():
  assert R.FSDP_TP.param_axes(("embed", "mlp")) == ("fsdp", "tensor")
  assert R.TP.param_axes(("heads", "embed")) == ("tensor", None)
  assert R.ZERO1.param_axes(("embed", "mlp")) == (None, None)
  assert R.ZERO1.opt_state_axes(("embed", "mlp")) == ("fsdp", None)
  assert R.TP_SP.activation_axes(("batch", "length", "act_embed")) == (("data", "fsdp"), "tensor",
                                                                      None)
  assert R.FSDP_TP_PP.param_axes(("layers", "embed", "heads")) == ("stage", "fsdp", "tensor")
  # A mesh axis is used once per array.
  assert R.Rules(name="x", params=(("a", "tensor"), ("b", "tensor"))).param_axes(("a", "b")) == (
      "tensor", None)
  assert set(R.PRESETS) >= {"DP", "ZERO1", "FSDP", "TP", "TP_SP", "FSDP_TP", "FSDP_TP_PP"}


@pytest.mark.parametrize("kw,match", [
    (dict(params=(("a", "tensor"), ("a", "fsdp"))), r"names 'a' twice"),
    (dict(params=(("a",),)), r"must be \(name, axes\)"),
])
def test_rules_bad(kw, match):
  with pytest.raises(ValueError, match=match):
    R.Rules(name="bad", **kw)


def test_sharding_divisibility_names_the_parameter():
  # vocab 60 is not divisible by tensor=8.
  model = GPT(tiny_config(vocab=60), rngs=nnx.Rngs(0), attention_fn=dense_attention)
  params = nnx.state(model, nnx.Param)
  with pytest.raises(ValueError, match=r"TP params embed/embedding: dimension 0 .*size 60.* "
                                       r"not divisible by mesh axes 'tensor'"):
    state_shardings(params, mesh=parallel.make_mesh(tensor=8), rules=R.TP)


def test_batch_and_activation_divisibility():
  mesh = parallel.make_mesh(data=2, fsdp=4)
  with pytest.raises(ValueError, match=r"DP batch .*size 6.* not divisible by mesh axes "
                                       r"\('data', 'fsdp'\)"):
    batch_sharding(jnp.zeros((6, 5), jnp.int32), mesh=mesh, rules=R.DP)
  constrain = ActivationSharding(mesh=parallel.make_mesh(tensor=8), rules=R.TP_SP)
  with pytest.raises(ValueError, match=r"dimension 1 .*size 12.* not divisible"):
    jax.jit(lambda x: constrain(x, ("batch", "length", "act_embed")))(jnp.zeros((1, 12, 8)))


def _model(**changes):
  return GPT(tiny_config(**changes), rngs=nnx.Rngs(0), attention_fn=dense_attention)


@pytest.mark.parametrize("make,match", [
    (lambda: dict(model=_model(), mesh=parallel.make_mesh(tensor=8), rules="TP"),
     r"rules must be a parallel.rules.Rules"),
    (lambda: dict(model=_model(), mesh=parallel.make_mesh(data=8), rules=R.DP, grad_accum=0),
     r"grad_accum=0 must be a positive integer"),
    (lambda: dict(model=_model(), mesh=parallel.make_mesh(data=8), rules=R.DP, remat="some"),
     r"remat='some' is not one of"),
    (lambda: dict(model=_model(scan_layers=True, n_layers=4), mesh=parallel.make_mesh(
        stage=4, data=2), rules=R.PP), r"split layers over 'stage' .* no pipeline config"),
    (lambda: dict(model=_model(), mesh=parallel.make_mesh(stage=2, data=4), rules=R.PP,
                  pipeline=PipelineConfig(microbatches=2)), r"needs stacked layers"),
    (lambda: dict(model=_model(scan_layers=True, n_layers=4), mesh=parallel.make_mesh(
        stage=4, data=2), rules=R.PP, pipeline=PipelineConfig(microbatches=6)),
     r"microbatches=6 must be divisible by stages=4"),
    (lambda: dict(model=_model(scan_layers=True, n_layers=6), mesh=parallel.make_mesh(
        stage=4, data=2), rules=R.PP, pipeline=PipelineConfig(microbatches=4)),
     r"layers=6 must be divisible by stages=4"),
    (lambda: dict(model=_model(vocab=60), mesh=parallel.make_mesh(tensor=8), rules=R.TP),
     r"not divisible by mesh axes 'tensor'"),
], ids=["rules-type", "grad_accum", "remat", "stage-without-pipeline", "pipeline-unstacked",
        "microbatches%stages", "layers%stages", "vocab%tensor"])
def test_make_train_step_bad(make, match):
  kw = make()
  with pytest.raises(ValueError, match=match):
    parallel.make_train_step(kw.pop("model"), optax.sgd(0.1), next_token_loss, **kw)


def test_train_step_bad_batch():
  model = _model()
  step = parallel.make_train_step(model, optax.sgd(0.1), next_token_loss,
                                  mesh=parallel.make_mesh(data=8), rules=R.DP, grad_accum=2)
  state = step.init(model)
  with pytest.raises(ValueError, match=r"not divisible by mesh axes"):
    step(state, jnp.zeros((4, 17), jnp.int32))
  with pytest.raises(ValueError, match=r"not divisible by grad_accum=2"):
    parallel.make_train_step(model, optax.sgd(0.1), next_token_loss,
                             mesh=parallel.make_mesh(devices=jax.devices()[:1]), rules=R.DP,
                             grad_accum=2)(state, jnp.zeros((3, 17), jnp.int32))

"""Pipelines (GPipe, 1F1B, interleaved) equal sequential layers; 1F1B uses less memory."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallel
from parallel.pipeline import (BWD, FWD, IDLE, PipelineConfig, pipeline_apply, schedule_1f1b)
from parallel_helpers import FAST_COMPILE, assert_trees_close

D = 16


def layer(p, h):
  return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


def make_params(n_layers, seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"w1": jax.random.normal(k1, (n_layers, D, 4 * D)) * 0.1,
          "w2": jax.random.normal(k2, (n_layers, 4 * D, D)) * 0.1}


def sequential(params, x):
  return jax.lax.scan(lambda h, p: (layer(p, h), None), x, params)[0]


def weighted_sum(f, cotangent):
  # A random cotangent, not .sum(), so every output element's gradient path is checked.
  return lambda params, x: (f(params, x) * cotangent).sum()


CASES = [
    ("gpipe", dict(stage=4, data=2), PipelineConfig(schedule="gpipe", microbatches=8), 8, "none"),
    ("1f1b", dict(stage=4, data=2), PipelineConfig(schedule="1f1b", microbatches=8), 8, "none"),
    ("1f1b-8stages", dict(stage=8), PipelineConfig(schedule="1f1b", microbatches=8), 8, "full"),
    ("interleaved", dict(stage=2, fsdp=4),
     PipelineConfig(schedule="interleaved", microbatches=4, virtual_stages=2), 8, "none"),
    ("interleaved-m=p", dict(stage=4, data=2),
     PipelineConfig(schedule="interleaved", microbatches=4, virtual_stages=2), 8, "dots"),
]


@pytest.mark.parametrize("name,mesh_kw,config,n_layers,remat", CASES, ids=[c[0] for c in CASES])
def test_pipeline_equals_sequential_layers(name, mesh_kw, config, n_layers, remat):
  mesh = parallel.make_mesh(**mesh_kw)
  params = make_params(n_layers)
  x = jax.random.normal(jax.random.key(1), (16, 4, D))
  ct = jax.random.normal(jax.random.key(2), x.shape)
  piped = functools.partial(pipeline_apply, layer, mesh=mesh, config=config, remat=remat)
  fn = jax.jit(jax.value_and_grad(weighted_sum(lambda p, x: piped(p, x), ct), argnums=(0, 1)),
               compiler_options=FAST_COMPILE)
  loss, (g_params, g_x) = fn(params, x)
  ref_loss, (ref_gp, ref_gx) = jax.value_and_grad(weighted_sum(sequential, ct), argnums=(0, 1))(
      params, x)
  assert_trees_close(loss, ref_loss, what="loss")
  # Gradients are sums over micro-batches in a different order: atol scales with their size.
  assert_trees_close(g_params, ref_gp, what="param grads", scale_atol=True)
  assert_trees_close(g_x, ref_gx, what="input grads", scale_atol=True)
  # The forward involves no cross-device reduction (each micro-batch row meets the same layers in
  # the same order): bitwise equal.
  y = jax.jit(piped, compiler_options=FAST_COMPILE)(params, x)
  y_ref = jax.jit(sequential, compiler_options=FAST_COMPILE)(params, x)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("interleaved", 2)])
def test_bubble_ticks_do_not_poison_gradients(schedule, virtual):
  """A layer that is NaN at an all-zero input (a norm without eps) but finite on the data: the
  bubble ticks must not run it on their placeholder zeros, or autodiff sends 0 * NaN into the
  parameter gradients (found by a user-level audit, session 23)."""
  mesh = parallel.make_mesh(stage=4, data=2)
  ws = jax.random.normal(jax.random.key(0), (8, D, D)) * 0.5
  x = jax.random.normal(jax.random.key(1), (8, D)) + 1.0
  ct = jax.random.normal(jax.random.key(2), x.shape)

  def norm_layer(w, h):
    y = jnp.tanh(h @ w)
    return y / jnp.sqrt(jnp.mean(y ** 2, -1, keepdims=True))
  config = PipelineConfig(schedule=schedule, microbatches=4, virtual_stages=virtual)
  piped = functools.partial(pipeline_apply, norm_layer, mesh=mesh, config=config)
  seq = lambda ws, x: jax.lax.scan(lambda h, w: (norm_layer(w, h), None), x, ws)[0]
  grads = jax.jit(jax.grad(weighted_sum(piped, ct), argnums=(0, 1)),
                  compiler_options=FAST_COMPILE)(ws, x)
  ref = jax.grad(weighted_sum(seq, ct), argnums=(0, 1))(ws, x)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
  assert_trees_close(grads, ref, what="grads", scale_atol=True)


def test_1f1b_peak_activation_memory_below_gpipe():
  mesh = parallel.make_mesh(stage=4, data=2)
  params = make_params(8)
  x = jax.random.normal(jax.random.key(1), (32, 8, D))
  ct = jax.random.normal(jax.random.key(2), x.shape)
  temp = {}
  for schedule in ("gpipe", "1f1b"):
    config = PipelineConfig(schedule=schedule, microbatches=8)
    f = functools.partial(pipeline_apply, layer, mesh=mesh, config=config)
    compiled = jax.jit(jax.grad(weighted_sum(f, ct)), compiler_options=FAST_COMPILE).lower(
        params, x).compile()
    temp[schedule] = compiled.memory_analysis().temp_size_in_bytes
  # GPipe keeps every tick's stage activations (m + p - 1 = 11 ticks) for the backward; 1F1B keeps
  # at most p = 4 stage inputs per stage.
  assert temp["1f1b"] < temp["gpipe"] / 2, temp


@pytest.mark.parametrize("stages,microbatches", [(2, 2), (4, 8), (4, 4), (8, 16)])
def test_1f1b_timetable(stages, microbatches):
  t = schedule_1f1b(stages=stages, microbatches=microbatches)
  p, m = stages, microbatches
  assert t.op.shape == (2 * (m + p - 1), p)
  assert t.stash <= p                       # at most p micro-batches alive per stage
  for s in range(p):
    fwd = [i for k, i in zip(t.op[:, s], t.mb[:, s]) if k == FWD]
    bwd = [i for k, i in zip(t.op[:, s], t.mb[:, s]) if k == BWD]
    assert fwd == list(range(m)) and bwd == list(range(m))
  bubble = PipelineConfig(schedule="1f1b", microbatches=m).bubble_fraction(stages=p)
  assert bubble == pytest.approx((p - 1) / (m + p - 1))
  assert t.bubble_fraction == pytest.approx(bubble)
  assert (t.op == IDLE).sum() == 2 * p * (p - 1)


def test_bubble_fraction_formulas():
  assert PipelineConfig(microbatches=8).bubble_fraction(stages=4) == pytest.approx(3 / 11)
  inter = PipelineConfig(schedule="interleaved", microbatches=8, virtual_stages=2)
  assert inter.bubble_fraction(stages=4) == pytest.approx(3 / 19)


BAD = [
    (dict(schedule="zigzag"), "schedule"),
    (dict(microbatches=0), "microbatches"),
    (dict(virtual_stages=2), "virtual_stages"),
    (dict(virtual_stages=0, schedule="interleaved"), "virtual_stages"),
]


@pytest.mark.parametrize("kw,match", BAD)
def test_bad_pipeline_config(kw, match):
  with pytest.raises(ValueError, match=match):
    PipelineConfig(**kw)


@pytest.mark.parametrize("config,n_layers,batch,match", [
    (PipelineConfig(microbatches=6), 8, 12, r"microbatches=6 must be divisible by stages=4"),
    (PipelineConfig(microbatches=4), 6, 8, r"layers=6 must be divisible by stages=4"),
    (PipelineConfig(schedule="interleaved", microbatches=4, virtual_stages=2), 4, 8,
     r"layers=4 .* virtual_stages=2"),
    (PipelineConfig(microbatches=8), 8, 12, r"batch=12 must be divisible by microbatches=8"),
])
def test_bad_pipeline_shapes(config, n_layers, batch, match):
  mesh = parallel.make_mesh(stage=4, data=2)
  with pytest.raises(ValueError, match=match):
    pipeline_apply(layer, make_params(n_layers), jnp.zeros((batch, 4, D)), mesh=mesh,
                   config=config)

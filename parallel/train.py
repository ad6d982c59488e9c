"""``make_train_step``: one optax training step, jit-compiled with explicit shardings.

The model is split into a graph definition and its parameters (``nnx.split``); the step merges a
fresh copy inside the trace, installs the layout's activation constraints and layer runner
(activation checkpointing or a pipeline) on that copy, and differentiates ``loss_fn`` with respect
to the parameters. Parameter, gradient and optimizer-state shardings come from the rules preset,
so swapping ``rules`` re-lays out the same model.

``loss_fn(model, batch)`` returns a scalar mean loss, or a pair ``(loss_sum, token_count)``. With
``grad_accum > 1`` the batch is split into that many micro-batches whose gradients are summed;
for the pair form the result is divided by the exact total token count (so padding spread
unevenly over micro-batches changes nothing), for a scalar the micro-batch losses are averaged.

Example:
  >>> mesh = parallel.make_mesh(fsdp=4, tensor=2)
  >>> step = parallel.make_train_step(model, optax.adamw(1e-3), next_token_loss,
  ...                                 mesh=mesh, rules=parallel.rules.FSDP_TP)
  >>> state = step.init(model)
  >>> state, metrics = step(state, tokens)
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
import flax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from parallel import sharding as shd
from parallel.rules import Rules

log = logging.getLogger(__name__)

REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
"""Activation checkpointing per block: ``none`` stores everything, ``full`` recomputes the whole
block in the backward pass, ``dots`` keeps matmul outputs, ``dots_no_batch`` keeps only weight
matmuls (no attention logits)."""


class TrainState(NamedTuple):
  """What a training step carries: the step count, parameters (an ``nnx.State``) and optax state."""
  step: jax.Array
  params: Any
  opt_state: Any


def remat_runner(policy: str) -> Callable:
  """A ``GPT.layer_runner`` applying ``jax.checkpoint`` with the named policy to every block.

  Example:
    >>> model.layer_runner = remat_runner("full")
  """
  if policy not in REMAT_POLICIES:
    raise ValueError(f"remat={policy!r} is not one of {sorted(REMAT_POLICIES)}")
  saveable = REMAT_POLICIES[policy]

  def run(apply, params, x, *, stacked):
    fn = apply if policy == "none" else jax.checkpoint(apply, policy=saveable)
    if stacked:
      x, _ = jax.lax.scan(lambda x, p: (fn(p, x), None), x, params)
      return x
    for p in params:
      x = fn(p, x)
    return x

  return run


def _check_microbatches(batch: Any, n: int) -> None:
  for x in jax.tree.leaves(batch):
    if not x.shape or x.shape[0] % n:
      raise ValueError(f"batch dimension of shape {x.shape} is not divisible by grad_accum={n}")


def _split_microbatches(batch: Any, n: int) -> Any:
  # Strided split: micro-batch j takes rows j, j + n, ...; each device keeps its own rows.
  _check_microbatches(batch, n)
  return jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1), batch)


class TrainStep:
  """A compiled training step; see ``make_train_step``.

  Attributes:
    mesh, rules: the layout.
    param_shardings, opt_shardings: ``NamedSharding`` trees of the state.
  """

  def __init__(self, model: nnx.Module, optimizer: optax.GradientTransformation,
               loss_fn: Callable, *, mesh: Mesh, rules: Rules, pipeline: Any = None,
               remat: str = "none", grad_accum: int = 1,
               compiler_options: dict[str, Any] | None = None):
    if not isinstance(rules, Rules):
      raise ValueError(f"rules must be a parallel.rules.Rules preset, got {type(rules).__name__}")
    if not isinstance(grad_accum, int) or grad_accum < 1:
      raise ValueError(f"grad_accum={grad_accum!r} must be a positive integer")
    if remat not in REMAT_POLICIES:
      raise ValueError(f"remat={remat!r} is not one of {sorted(REMAT_POLICIES)}")
    if rules.uses_axis("stage") and mesh.shape["stage"] > 1 and pipeline is None:
      raise ValueError(f"rules {rules.name} split layers over 'stage' (size "
                       f"{mesh.shape['stage']}) but no pipeline config was given")
    if pipeline is not None:
      from parallel.pipeline import PipelineConfig
      if not isinstance(pipeline, PipelineConfig):
        raise ValueError(f"pipeline must be a PipelineConfig, got {type(pipeline).__name__}")
      blocks = getattr(model, "blocks", None)
      if not hasattr(blocks, "n_layers"):
        raise ValueError("pipeline needs stacked layers: build the model with "
                         "GPTConfig(scan_layers=True)")
      pipeline.validate(stages=mesh.shape["stage"], layers=blocks.n_layers)
    self.mesh, self.rules, self.pipeline, self.remat = mesh, rules, pipeline, remat
    self.optimizer, self.loss_fn, self.grad_accum = optimizer, loss_fn, grad_accum
    self.compiler_options = dict(compiler_options or {})
    self.graphdef, params, self._rest = nnx.split(model, nnx.Param, ...)
    self.param_shardings = shd.state_shardings(params, mesh=mesh, rules=rules, kind="params")
    opt_shape = jax.eval_shape(optimizer.init, params)
    self.opt_shardings = shd.state_shardings(opt_shape, mesh=mesh, rules=rules, kind="opt_state")
    self._replicated = NamedSharding(mesh, P())
    self.state_shardings = TrainState(self._replicated, self.param_shardings, self.opt_shardings)
    self._compiled: dict[Any, Any] = {}

  # ---------------------------------------------------------------- state
  def init(self, model: nnx.Module) -> TrainState:
    """Places ``model``'s parameters on the mesh and creates the optimizer state there."""
    params = nnx.state(model, nnx.Param)
    params = jax.device_put(params, self.param_shardings)
    opt_state = jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), self._replicated)
    return TrainState(step, params, opt_state)

  def abstract_state(self, model: nnx.Module) -> TrainState:
    """``TrainState`` of ``jax.ShapeDtypeStruct`` with this step's shardings (no allocation):
    the target for ``parallel.checkpoint.restore``."""
    params = nnx.state(model, nnx.Param)
    shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params,
                        jax.eval_shape(self.optimizer.init, params))
    leaves, treedef = jax.tree.flatten(shapes)
    shardings = jax.tree.leaves(self.state_shardings)   # one per array (a Variable holds one)
    if len(shardings) != len(leaves):
      raise ValueError("model does not match this train step's state")
    return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                        for x, s in zip(leaves, shardings)])

  def to_model(self, state: TrainState) -> nnx.Module:
    """An NNX model holding ``state.params`` (sharded arrays, no copy)."""
    return nnx.merge(self.graphdef, state.params, self._rest)

  # ---------------------------------------------------------------- tracing
  def _model(self, params) -> nnx.Module:
    model = nnx.merge(self.graphdef, params, self._rest)
    shd.install_activation_sharding(model, shd.ActivationSharding(mesh=self.mesh, rules=self.rules))
    if self.pipeline is not None:
      from parallel.pipeline import pipeline_runner
      # Inside the stage-manual shard_map, constraints over the whole mesh do not apply.
      shd.install_activation_sharding(model.blocks, None)
      model.layer_runner = pipeline_runner(mesh=self.mesh, config=self.pipeline, remat=self.remat)
    elif self.remat != "none" and hasattr(model, "layer_runner"):
      model.layer_runner = remat_runner(self.remat)
    return model

  def _sum_and_count(self, params, batch):
    try:
      out = self.loss_fn(self._model(params), batch)
    except flax.errors.TraceContextError as e:
      # The step carries only nnx.Param state; a loss that updates other state (the RNG
      # counters of nnx.Dropout(rngs=...), nnx.BatchNorm's statistics) cannot write it back.
      raise NotImplementedError(
          "make_train_step carries only the model's nnx.Param state, but the loss updated "
          "other state (RNG streams such as nnx.Dropout(rngs=...), or BatchNorm statistics). "
          "Run the model deterministically in the step (dropout off, BatchNorm "
          "use_running_average=True), or keep that state outside the model.") from e
    if isinstance(out, tuple):
      total, count = out
      return total.astype(jnp.float32), jnp.asarray(count, jnp.float32)
    return out.astype(jnp.float32), jnp.ones((), jnp.float32)

  def _loss_and_grad(self, params, batch):
    if self.grad_accum == 1:
      (total, count), grads = self._vg(params, batch)
      return total / count, jax.tree.map(lambda g: g / count, grads), count
    micro = _split_microbatches(batch, self.grad_accum)

    def body(carry, mb):
      total, count, grads = carry
      (t, c), g = self._vg(params, mb)
      return (total + t, count + c, jax.tree.map(jnp.add, grads, g)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
    (total, count, grads), _ = jax.lax.scan(body, init, micro)
    return total / count, jax.tree.map(lambda g: g / count, grads), count

  def _vg(self, params, batch):
    def f(p):
      total, count = self._sum_and_count(p, batch)
      return total, count
    (total, count), vjp = jax.vjp(f, params)
    (grads,) = vjp((jnp.ones_like(total), jnp.zeros_like(count)))
    return (total, count), grads

  def _step(self, state: TrainState, batch, *, return_grads: bool = False):
    loss, grads, count = self._loss_and_grad(state.params, batch)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "tokens": count}
    if return_grads:
      metrics["grads"] = grads
    return TrainState(state.step + 1, params, opt_state), metrics

  def _jitted(self, kind: str, batch):
    key = (kind, jax.tree.structure(batch),
           tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(batch)))
    if key not in self._compiled:
      bs = shd.batch_sharding(batch, mesh=self.mesh, rules=self.rules)
      _check_microbatches(batch, self.grad_accum)
      metric_sh = {"loss": self._replicated, "tokens": self._replicated}
      if kind.startswith("step"):
        with_grads = kind == "step+grads"
        if with_grads:
          metric_sh["grads"] = self.param_shardings
        fn = jax.jit(functools.partial(self._step, return_grads=with_grads),
                     in_shardings=(self.state_shardings, bs),
                     out_shardings=(self.state_shardings, metric_sh),
                     compiler_options=self.compiler_options or None)
      else:
        fn = jax.jit(lambda s, b: self._loss_and_grad(s.params, b)[:2],
                     in_shardings=(self.state_shardings, bs),
                     out_shardings=(self._replicated, self.param_shardings),
                     compiler_options=self.compiler_options or None)
      log.debug("compiling %s for %s", kind, key)
      self._compiled[key] = fn
    return self._compiled[key]

  # ---------------------------------------------------------------- public calls
  def __call__(self, state: TrainState, batch: Any, *, return_grads: bool = False
               ) -> tuple[TrainState, dict[str, Any]]:
    """One optimizer step: returns the new state and ``{"loss", "tokens"}`` (the loss and
    token count of ``batch`` before the update), plus ``"grads"`` if ``return_grads``."""
    return self._jitted("step+grads" if return_grads else "step", batch)(state, batch)

  def loss_and_grad(self, state: TrainState, batch: Any) -> tuple[jax.Array, Any]:
    """The loss and the gradients (sharded like the parameters), without updating."""
    return self._jitted("grad", batch)(state, batch)

  def lower(self, state: TrainState, batch: Any, *, kind: str = "step"):
    """``jax.jit(...).lower`` of the step (``kind="step"``) or of ``loss_and_grad``
    (``kind="grad"``): call ``.compile().memory_analysis()`` or ``.as_text()`` on it."""
    if kind not in ("step", "grad"):
      raise ValueError(f"kind={kind!r} must be 'step' or 'grad'")
    return self._jitted(kind, batch).lower(state, batch)


def make_train_step(model: nnx.Module, optimizer: optax.GradientTransformation,
                    loss_fn: Callable, *, mesh: Mesh, rules: Rules, pipeline: Any = None,
                    remat: str = "none", grad_accum: int = 1,
                    compiler_options: dict[str, Any] | None = None) -> TrainStep:
  """Builds a sharded optax training step for an NNX model.

  Args:
    model: an NNX module whose parameters carry logical axis names.
    optimizer: an optax ``GradientTransformation``.
    loss_fn: ``loss_fn(model, batch)`` -> scalar mean, or ``(loss_sum, token_count)``.
    mesh: from ``parallel.make_mesh``.
    rules: a ``parallel.rules`` preset.
    pipeline: a ``parallel.pipeline.PipelineConfig`` to pipeline the model's stacked blocks
      over the ``stage`` axis (needs ``GPTConfig(scan_layers=True)``), or ``None``.
    remat: activation checkpointing policy per block, one of ``REMAT_POLICIES``.
    grad_accum: number of micro-batches whose gradients are accumulated per step.
    compiler_options: XLA options passed to ``jax.jit`` (e.g. ``{"xla_backend_optimization_level":
      0}`` to compile faster on CPU in tests).

  Returns:
    A ``TrainStep``: ``state = step.init(model)``, ``state, metrics = step(state, batch)``,
    ``loss, grads = step.loss_and_grad(state, batch)``, ``step.lower(state, batch)``.

  Example:
    >>> step = make_train_step(model, optax.adam(1e-3), next_token_loss,
    ...                        mesh=make_mesh(data=8), rules=rules.DP)
  """
  return TrainStep(model, optimizer, loss_fn, mesh=mesh, rules=rules, pipeline=pipeline,
                   remat=remat, grad_accum=grad_accum, compiler_options=compiler_options)

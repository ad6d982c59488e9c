"""Rules -> ``NamedSharding`` for Flax NNX state, optimizer state, batches and activations.

Parameters carry their logical names as NNX variable metadata (``out_sharding``, set by
``nnx.with_partitioning``). The functions here turn those names into ``NamedSharding`` trees for
``jax.jit``'s ``in_shardings`` / ``out_shardings`` and check that every split divides its
dimension (a ``ValueError`` names the parameter, the dimension and the mesh axes otherwise).

Example:
  >>> mesh = make_mesh(fsdp=4, tensor=2)
  >>> graphdef, params = nnx.split(model, nnx.Param)
  >>> shardings = state_shardings(params, mesh=mesh, rules=rules.FSDP_TP)
  >>> params = jax.device_put(params, shardings)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from parallel.mesh import axis_size
from parallel.rules import Rules

Kind = Literal["params", "opt_state"]


def logical_names(variable: nnx.Variable) -> tuple[str | None, ...]:
  """The logical axis names of an NNX variable (all ``None`` when it has none)."""
  meta = variable.get_metadata()
  names = meta.get("out_sharding", None) or meta.get("sharding_names", None)
  ndim = len(variable.get_value().shape)
  if not names:
    return (None,) * ndim
  names = tuple(names)
  if len(names) != ndim:
    raise ValueError(f"variable of shape {tuple(variable.get_value().shape)} has "
                     f"{len(names)} logical names {names}")
  return names


def spec_for(shape: tuple[int, ...], axes: tuple, *, mesh: Mesh, what: str) -> P:
  """A ``PartitionSpec`` from per-dimension mesh axes, checking divisibility.

  Raises:
    ValueError: naming ``what``, the dimension and the axes when a split does not divide.
  """
  for dim, (size, ax) in enumerate(zip(shape, axes)):
    n = axis_size(mesh, ax)
    if size % n:
      raise ValueError(f"{what}: dimension {dim} of shape {tuple(shape)} (size {size}) is not "
                       f"divisible by mesh axes {ax!r} of total size {n}")
  return P(*axes)


def _path_str(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def state_shardings(state: Any, *, mesh: Mesh, rules: Rules, kind: Kind = "params") -> Any:
  """``NamedSharding`` for every array of an NNX state (or an optax state holding variables).

  Variables are mapped through ``rules`` by their logical names; other leaves (e.g. optax step
  counts) are replicated. The result is a pytree prefix of ``state`` for ``jax.jit``.

  Example:
    >>> s = state_shardings(nnx.state(model, nnx.Param), mesh=mesh, rules=rules.FSDP)
  """
  lookup = rules.param_axes if kind == "params" else rules.opt_state_axes

  def one(path, leaf):
    if isinstance(leaf, nnx.Variable):
      value = leaf.get_value()
      axes = lookup(logical_names(leaf))
      spec = spec_for(tuple(value.shape), axes, mesh=mesh,
                      what=f"{rules.name} {kind} {_path_str(path)}")
      return NamedSharding(mesh, spec)
    return NamedSharding(mesh, P())

  return jax.tree_util.tree_map_with_path(
      one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(batch: Any, *, mesh: Mesh, rules: Rules) -> Any:
  """Shardings splitting the leading (batch) dimension of every array in ``batch``.

  Example:
    >>> batch_sharding(jnp.zeros((8, 16), jnp.int32), mesh=mesh, rules=rules.DP)
  """
  (axes,) = rules.activation_axes(("batch",))

  def one(path, x):
    shape = jax.numpy.shape(x)
    if not shape:
      return NamedSharding(mesh, P())
    spec = spec_for(shape, (axes,) + (None,) * (len(shape) - 1), mesh=mesh,
                    what=f"{rules.name} batch {_path_str(path) or 'array'}")
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(one, batch)


@dataclasses.dataclass(frozen=True)
class ActivationSharding:
  """Callable ``(x, names) -> x`` that constrains an activation by its logical names.

  Hashable (it is stored as static model data). Dimensions whose size the mesh axes do not
  divide raise ``ValueError``.

  Example:
    >>> constrain = ActivationSharding(mesh=mesh, rules=rules.TP_SP)
    >>> x = constrain(x, ("batch", "length", "act_embed"))
  """
  mesh: Mesh
  rules: Rules

  def __call__(self, x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    if len(names) != x.ndim:
      raise ValueError(f"activation of shape {x.shape} got {len(names)} names {names}")
    axes = self.rules.activation_axes(names)
    spec = spec_for(x.shape, axes, mesh=self.mesh, what=f"{self.rules.name} activation {names}")
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def install_activation_sharding(model: nnx.Module, constrain: Any) -> None:
  """Sets ``activation_sharding = constrain`` on every submodule that declares that attribute.

  ``constrain`` is an ``ActivationSharding`` or ``None`` (no constraints). Call it on a model
  merged inside a jitted function (``make_train_step`` does) so the user's object is untouched.
  """
  for _, module in model.iter_modules():
    if hasattr(module, "activation_sharding"):
      module.activation_sharding = constrain


def shard_model(model: nnx.Module, *, mesh: Mesh, rules: Rules) -> nnx.Module:
  """Moves ``model``'s state onto ``mesh`` laid out by ``rules`` (in place) and returns it.

  Example:
    >>> model = shard_model(GPT(cfg, rngs=nnx.Rngs(0)), mesh=mesh, rules=rules.FSDP)
  """
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, state_shardings(state, mesh=mesh, rules=rules)))
  return model

"""Logical-axis rules: one table per layout, mapping model axis names to mesh axes.

Model code names the axes of its parameters (``nnx.with_partitioning(init, ("embed", "mlp"))``)
and of its activations (``("batch", "length", "act_embed")``). A ``Rules`` preset says which mesh
axes each name is split over. Swapping the preset re-lays out the same model.

Parameter names used by ``examples/gpt.py``: ``vocab embed heads kv_heads mlp seq layers``.
Activation names: ``batch length act_embed act_heads act_kv_heads act_mlp act_vocab``.

Mesh axes (see ``mesh.py``): ``data`` replicas, ``fsdp`` shard groups (the batch is split over
both), ``tensor`` Megatron tensor parallelism (and the sequence for sequence parallelism), and
``stage`` pipeline stages.

Example:
  >>> FSDP_TP.param_axes(("embed", "mlp"))
  ('fsdp', 'tensor')
  >>> ZERO1.param_axes(("embed", "mlp")), ZERO1.opt_state_axes(("embed", "mlp"))
  ((None, None), ('fsdp', None))
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

MeshAxes = str | tuple[str, ...] | None
Table = tuple[tuple[str, MeshAxes], ...]

BATCH: Table = (("batch", ("data", "fsdp")),)


@dataclasses.dataclass(frozen=True)
class Rules:
  """A layout: logical name -> mesh axes, for parameters, optimizer state and activations.

  Attributes:
    name: shown in reprs and error messages.
    params: table for parameters (and their gradients).
    activations: table for activation sharding constraints and the batch.
    opt_state: table for optimizer state; ``None`` means the same as ``params``.

  Names absent from a table are replicated. A mesh axis already used by an earlier dimension of
  the same array is skipped for later dimensions.

  Example:
    >>> r = Rules(name="mine", params=(("mlp", "tensor"),), activations=BATCH)
    >>> r.param_axes(("embed", "mlp"))
    (None, 'tensor')
  """
  name: str
  params: Table = ()
  activations: Table = BATCH
  opt_state: Table | None = None

  def __post_init__(self):
    for table_name in ("params", "activations", "opt_state"):
      table = getattr(self, table_name)
      if table is None:
        continue
      seen = set()
      for entry in table:
        if len(entry) != 2 or not isinstance(entry[0], str):
          raise ValueError(f"Rules {self.name}: {table_name} entry {entry!r} must be (name, axes)")
        if entry[0] in seen:
          raise ValueError(f"Rules {self.name}: {table_name} names {entry[0]!r} twice")
        seen.add(entry[0])

  def replace(self, **changes) -> "Rules":
    """A copy with fields replaced (``dataclasses.replace``)."""
    return dataclasses.replace(self, **changes)

  def param_axes(self, names: Iterable[str | None]) -> tuple[MeshAxes, ...]:
    """Mesh axes for each dimension of a parameter with logical ``names``."""
    return _lookup(self.params, names)

  def opt_state_axes(self, names: Iterable[str | None]) -> tuple[MeshAxes, ...]:
    """Mesh axes for each dimension of an optimizer-state array mirroring a parameter."""
    return _lookup(self.params if self.opt_state is None else self.opt_state, names)

  def activation_axes(self, names: Iterable[str | None]) -> tuple[MeshAxes, ...]:
    """Mesh axes for each dimension of an activation with logical ``names``."""
    return _lookup(self.activations, names)

  def uses_axis(self, axis: str) -> bool:
    """Whether any table splits something over mesh ``axis``."""
    tables = [self.params, self.activations, self.opt_state or ()]
    for table in tables:
      for _, axes in table:
        if axes == axis or (isinstance(axes, tuple) and axis in axes):
          return True
    return False


def _lookup(table: Table, names: Iterable[str | None]) -> tuple[MeshAxes, ...]:
  mapping = dict(table)
  used: set[str] = set()
  out: list[MeshAxes] = []
  for name in names:
    axes = mapping.get(name) if name is not None else None
    if axes is None:
      out.append(None)
      continue
    tup = (axes,) if isinstance(axes, str) else tuple(axes)
    tup = tuple(a for a in tup if a not in used)
    used.update(tup)
    out.append(None if not tup else tup[0] if len(tup) == 1 else tup)
  return tuple(out)


_TP_PARAMS: Table = (("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"),
                     ("vocab", "tensor"))
_TP_ACTS: Table = BATCH + (("act_heads", "tensor"), ("act_kv_heads", "tensor"),
                           ("act_mlp", "tensor"), ("act_vocab", "tensor"))
_FSDP_PARAMS: Table = (("embed", "fsdp"),)
_PP_PARAMS: Table = (("layers", "stage"),)

DP = Rules(name="DP")
"""Data parallel: parameters and optimizer state replicated, batch over ``data`` x ``fsdp``."""

ZERO1 = Rules(name="ZERO1", opt_state=_FSDP_PARAMS)
"""ZeRO-1: parameters replicated, optimizer state sharded over ``fsdp``."""

FSDP = Rules(name="FSDP", params=_FSDP_PARAMS)
"""ZeRO-3 / FSDP: parameters, gradients and optimizer state sharded over ``fsdp``; XLA gathers
each weight just before its use (layer by layer) and reduce-scatters its gradient."""

TP = Rules(name="TP", params=_TP_PARAMS, activations=_TP_ACTS)
"""Megatron tensor parallel over ``tensor``: heads, MLP hidden and vocab split."""

TP_SP = Rules(name="TP_SP", params=_TP_PARAMS, activations=_TP_ACTS + (("length", "tensor"),))
"""Tensor + sequence parallel: the residual stream (norms, dropout) is split over the sequence on
``tensor``; the all-reduce of TP becomes a reduce-scatter + all-gather pair."""

FSDP_TP = Rules(name="FSDP_TP", params=_FSDP_PARAMS + _TP_PARAMS, activations=_TP_ACTS)
"""FSDP over ``fsdp`` and tensor parallel over ``tensor``."""

PP = Rules(name="PP", params=_PP_PARAMS)
"""Pipeline parallel: stacked layers split over ``stage``; data parallel elsewhere."""

FSDP_PP = Rules(name="FSDP_PP", params=_PP_PARAMS + _FSDP_PARAMS)
"""Pipeline over ``stage`` with FSDP inside each stage."""

FSDP_TP_PP = Rules(name="FSDP_TP_PP", params=_PP_PARAMS + _FSDP_PARAMS + _TP_PARAMS,
                   activations=_TP_ACTS)
"""3D: pipeline over ``stage``, FSDP over ``fsdp`` (+ data replicas), tensor over ``tensor``."""

PRESETS: dict[str, Rules] = {r.name: r for r in
                             (DP, ZERO1, FSDP, TP, TP_SP, FSDP_TP, PP, FSDP_PP, FSDP_TP_PP)}

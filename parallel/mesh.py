"""Device meshes with the library's four named axes.

Every mesh made here has the axes ``("stage", "data", "fsdp", "tensor")`` in that order (outermost
first, so that ``tensor`` neighbours share the fastest links). Axes of size 1 are kept, which lets
one rules table serve every mesh: a rule naming an axis of size 1 simply does not split anything.

Example:
  >>> mesh = make_mesh(data=2, fsdp=2, tensor=2)          # 8 devices
  >>> dict(mesh.shape)
  {'stage': 1, 'data': 2, 'fsdp': 2, 'tensor': 2}
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES: tuple[str, ...] = ("stage", "data", "fsdp", "tensor")


def make_mesh(*, data: int = 1, fsdp: int = 1, tensor: int = 1, stage: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Returns a ``Mesh`` with axes ``("stage", "data", "fsdp", "tensor")``.

  Args:
    data: replica groups (pure data parallelism; parameters replicated across it).
    fsdp: shard groups (ZeRO / FSDP shard parameters or optimizer state across it; the batch
      is split across it too).
    tensor: tensor (Megatron) parallelism; also the sequence axis of sequence parallelism.
    stage: pipeline stages.
    devices: the devices to use, ``jax.devices()`` by default. Their number must equal the
      product of the axis sizes; fewer devices than available may be passed explicitly.

  Example:
    >>> make_mesh(fsdp=4, tensor=2).shape["tensor"]
    2
  """
  sizes = {"stage": stage, "data": data, "fsdp": fsdp, "tensor": tensor}
  for name, size in sizes.items():
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
      raise ValueError(f"mesh axis {name}={size!r} must be a positive integer")
  if devices is None:
    devices = jax.devices()
  devices = list(devices)
  total = math.prod(sizes.values())
  if total != len(devices):
    raise ValueError(
        f"mesh axes stage={stage} x data={data} x fsdp={fsdp} x tensor={tensor} = {total} "
        f"devices, but {len(devices)} devices were given (pass devices=jax.devices()[:{total}] "
        f"to use fewer)")
  grid = np.asarray(devices, dtype=object).reshape(tuple(sizes[a] for a in AXES))
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def axis_size(mesh: Mesh, axes: str | tuple[str, ...] | None) -> int:
  """Product of the sizes of ``axes`` in ``mesh`` (1 for ``None``).

  Example:
    >>> axis_size(make_mesh(data=2, fsdp=4), ("data", "fsdp"))
    8
  """
  if axes is None:
    return 1
  if isinstance(axes, str):
    axes = (axes,)
  for a in axes:
    if a not in mesh.shape:
      raise ValueError(f"mesh has no axis {a!r}; its axes are {tuple(mesh.shape)}")
  return math.prod(mesh.shape[a] for a in axes)

"""Megatron tensor parallelism with ``shard_map``: column / row parallel layers, sequence
parallelism and collective matmuls.

With ``n`` devices on the ``tensor`` axis:

* ``column_parallel``: ``W [D_in, D_out]`` split over output columns; each device computes its
  slice of ``y = x W``. Needs the whole ``x``: replicated, or (sequence parallel) sharded over
  the sequence and all-gathered first.
* ``row_parallel``: ``W`` split over input rows, ``x`` split over features (the output of a
  column-parallel layer); each device computes a partial ``y`` that is summed: ``psum``
  (all-reduce), or ``psum_scatter`` over the sequence (reduce-scatter) with sequence parallelism.
* ``mlp``: column then row parallel = one all-reduce per block forward (or one all-gather + one
  reduce-scatter with sequence parallelism, the same bytes moved but activations between blocks
  stay split over the sequence).
* ``collective_matmul=True`` replaces the all-gather (or reduce-scatter) by ``n`` steps of a ring
  ``ppermute``, each overlapping one sequence chunk's matmul with the transfer of the next chunk.

Shapes are ``x [B, T, D]``; the batch is split over ``batch_axes`` (``("data", "fsdp")``).

Example:
  >>> mesh = make_mesh(data=2, tensor=4)
  >>> y = mlp(x, w_up, w_down, mesh=mesh, sequence_parallel=True, collective_matmul=True)
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from parallel.mesh import axis_size

BatchAxes = str | tuple[str, ...] | None


def _check(x: jax.Array, w: jax.Array, *, mesh: Mesh, axis: str, batch_axes: BatchAxes,
           sequence_parallel: bool, split: str, collective_matmul: bool) -> int:
  if collective_matmul and not sequence_parallel:
    raise ValueError("collective_matmul=True overlaps the sequence all-gather / reduce-scatter "
                     "and needs sequence_parallel=True")
  if axis not in mesh.shape:
    raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}")
  if x.ndim != 3 or w.ndim != 2:
    raise ValueError(f"expected x [B, T, D] and w [D_in, D_out], got {x.shape} and {w.shape}")
  if x.shape[-1] != w.shape[0]:
    raise ValueError(f"x features {x.shape[-1]} != w rows {w.shape[0]}")
  n = mesh.shape[axis]
  dim = w.shape[1] if split == "columns" else w.shape[0]
  if dim % n:
    raise ValueError(f"w {split} dimension {dim} is not divisible by mesh axis {axis!r} of size {n}")
  if sequence_parallel and x.shape[1] % n:
    raise ValueError(f"sequence length {x.shape[1]} is not divisible by mesh axis {axis!r} of "
                     f"size {n} (sequence_parallel=True)")
  nb = axis_size(mesh, batch_axes)
  if x.shape[0] % nb:
    raise ValueError(f"batch {x.shape[0]} is not divisible by batch_axes {batch_axes!r} "
                     f"of size {nb}")
  return n


def _ring(n: int) -> list[tuple[int, int]]:
  return [(j, (j + 1) % n) for j in range(n)]


def _all_gather_matmul(x, w, *, axis: str, n: int):
  """Local x [b, T/n, D] (chunk d) -> [b, T, D_out_local], overlapping ppermute with matmuls."""
  d = jax.lax.axis_index(axis)
  tc = x.shape[1]
  out = jnp.zeros((x.shape[0], tc * n, w.shape[1]), jnp.result_type(x, w))
  cur = x
  for k in range(n):
    src = (d - k) % n                                  # the chunk we hold after k hops
    if k < n - 1:
      nxt = jax.lax.ppermute(cur, axis, _ring(n))      # send while computing this chunk
    out = jax.lax.dynamic_update_slice_in_dim(out, cur @ w, src * tc, axis=1)
    if k < n - 1:
      cur = nxt
  return out


def _matmul_reduce_scatter(x, w, *, axis: str, n: int):
  """Local x [b, T, D_in/n] -> summed chunk d of the sequence [b, T/n, D_out], ring-accumulated."""
  d = jax.lax.axis_index(axis)
  tc = x.shape[1] // n
  acc = None
  for k in range(n):
    chunk = (d - k - 1) % n
    part = jax.lax.dynamic_slice_in_dim(x, chunk * tc, tc, axis=1) @ w
    acc = part if acc is None else acc + part
    if k < n - 1:
      acc = jax.lax.ppermute(acc, axis, _ring(n))
  return acc


def column_parallel(x: jax.Array, w: jax.Array, *, mesh: Mesh, axis: str = "tensor",
                    batch_axes: BatchAxes = ("data", "fsdp"), sequence_parallel: bool = False,
                    collective_matmul: bool = False) -> jax.Array:
  """``x @ w`` with ``w`` split over columns; the result is split over its last dimension.

  Args:
    x: ``[B, T, D_in]``, replicated over ``axis`` (or split over ``T`` if ``sequence_parallel``).
    w: ``[D_in, D_out]``, ``D_out`` divisible by the axis size.
    sequence_parallel: ``x`` arrives split over the sequence; it is all-gathered.
    collective_matmul: overlap that all-gather with the matmul (ring ``ppermute``).

  Example:
    >>> h = column_parallel(x, w_up, mesh=make_mesh(tensor=8))   # [B, T, D_out], split on D_out
  """
  n = _check(x, w, mesh=mesh, axis=axis, batch_axes=batch_axes,
             sequence_parallel=sequence_parallel, split="columns",
             collective_matmul=collective_matmul)

  def local(x, w):
    if not sequence_parallel:
      return x @ w
    if collective_matmul:
      return _all_gather_matmul(x, w, axis=axis, n=n)
    return jax.lax.all_gather(x, axis, axis=1, tiled=True) @ w

  x_spec = P(batch_axes, axis if sequence_parallel else None, None)
  return jax.shard_map(local, mesh=mesh, in_specs=(x_spec, P(None, axis)),
                       out_specs=P(batch_axes, None, axis))(x, w)


def row_parallel(x: jax.Array, w: jax.Array, *, mesh: Mesh, axis: str = "tensor",
                 batch_axes: BatchAxes = ("data", "fsdp"), sequence_parallel: bool = False,
                 collective_matmul: bool = False) -> jax.Array:
  """``x @ w`` with ``w`` split over rows and ``x`` over features; partial sums are reduced.

  Returns ``[B, T, D_out]``: replicated over ``axis`` after an all-reduce, or split over ``T``
  after a reduce-scatter (``sequence_parallel``), optionally as a ring collective matmul.

  Example:
    >>> y = row_parallel(h, w_down, mesh=make_mesh(tensor=8))
  """
  n = _check(x, w, mesh=mesh, axis=axis, batch_axes=batch_axes,
             sequence_parallel=sequence_parallel, split="rows",
             collective_matmul=collective_matmul)

  def local(x, w):
    if not sequence_parallel:
      return jax.lax.psum(x @ w, axis)
    if collective_matmul:
      return _matmul_reduce_scatter(x, w, axis=axis, n=n)
    return jax.lax.psum_scatter(x @ w, axis, scatter_dimension=1, tiled=True)

  out_spec = P(batch_axes, axis if sequence_parallel else None, None)
  return jax.shard_map(local, mesh=mesh, in_specs=(P(batch_axes, None, axis), P(axis, None)),
                       out_specs=out_spec)(x, w)


def mlp(x: jax.Array, w_up: jax.Array, w_down: jax.Array, *, mesh: Mesh, axis: str = "tensor",
        batch_axes: BatchAxes = ("data", "fsdp"), sequence_parallel: bool = False,
        collective_matmul: bool = False,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu) -> jax.Array:
  """Megatron MLP ``activation(x @ w_up) @ w_down``: one all-reduce per forward (or one
  all-gather + one reduce-scatter with ``sequence_parallel``).

  Example:
    >>> y = mlp(x, w_up, w_down, mesh=make_mesh(data=2, tensor=4), sequence_parallel=True)
  """
  kw = dict(mesh=mesh, axis=axis, batch_axes=batch_axes, sequence_parallel=sequence_parallel,
            collective_matmul=collective_matmul)
  return row_parallel(activation(column_parallel(x, w_up, **kw)), w_down, **kw)


class ParallelMLP(nnx.Module):
  """An NNX Megatron MLP whose kernels carry logical names ``("embed", "mlp")`` / ``("mlp",
  "embed")`` and whose call runs the shard_map layers on an explicit mesh.

  Example:
    >>> layer = ParallelMLP(64, 256, mesh=make_mesh(tensor=8), rngs=nnx.Rngs(0))
    >>> y = layer(x)     # [B, T, 64]
  """

  def __init__(self, d_model: int, hidden: int, *, mesh: Mesh, rngs: nnx.Rngs,
               axis: str = "tensor", batch_axes: BatchAxes = ("data", "fsdp"),
               sequence_parallel: bool = False, collective_matmul: bool = False):
    init = nnx.initializers.normal(0.02)
    self.w_up = nnx.Param(init(rngs.params(), (d_model, hidden)), out_sharding=("embed", "mlp"),
                          eager_sharding=False)
    self.w_down = nnx.Param(init(rngs.params(), (hidden, d_model)), out_sharding=("mlp", "embed"),
                            eager_sharding=False)
    self.call = functools.partial(mlp, mesh=mesh, axis=axis, batch_axes=batch_axes,
                                  sequence_parallel=sequence_parallel,
                                  collective_matmul=collective_matmul)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.call(x, self.w_up[...], self.w_down[...])

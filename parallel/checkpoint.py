"""Checkpoints with orbax: save on one mesh, restore on another (resharding on load).

The state (e.g. a ``TrainState``: step, NNX parameters, optax state) is flattened to a dict keyed
by pytree paths and written with ``orbax.checkpoint.StandardCheckpointer``; every array is stored
once, whatever its sharding. Restoring takes a *target*: a pytree of the same structure whose
leaves are arrays or ``jax.ShapeDtypeStruct`` with a ``sharding``; each array is read straight
into that layout, bit for bit. ``TrainStep.abstract_state(model)`` gives the target for a layout.

Example:
  >>> save("/tmp/ckpt/step_3", state)                                # saved at fsdp=8
  >>> step2 = make_train_step(model, opt, loss, mesh=make_mesh(fsdp=4, tensor=2), rules=FSDP_TP)
  >>> state = restore("/tmp/ckpt/step_3", target=step2.abstract_state(model))
"""
from __future__ import annotations

import logging
import os
from typing import Any

import jax
import jax.numpy as jnp

log = logging.getLogger(__name__)


def _flatten(tree: Any) -> tuple[dict[str, Any], Any]:
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  flat = {}
  for path, leaf in leaves:
    key = jax.tree_util.keystr(path) or "<root>"
    if key in flat:
      raise ValueError(f"two leaves map to the checkpoint key {key!r}")
    flat[key] = leaf
  return flat, treedef


def _checkpointer():
  import orbax.checkpoint as ocp
  return ocp.StandardCheckpointer()


def save(directory: str | os.PathLike, state: Any, *, overwrite: bool = False) -> None:
  """Writes every array of ``state`` to ``directory`` (blocking until written).

  Args:
    directory: a new directory (absolute or relative path).
    state: a pytree of ``jax.Array`` (any sharding) and scalars.
    overwrite: replace an existing checkpoint at ``directory``.

  Raises:
    ValueError: ``directory`` exists and ``overwrite`` is False.

  Example:
    >>> save(tmp_path / "ckpt", state)
  """
  directory = os.path.abspath(os.fspath(directory))
  if os.path.exists(directory) and not overwrite:
    raise ValueError(f"checkpoint directory {directory} exists (pass overwrite=True)")
  flat, _ = _flatten(state)
  ckptr = _checkpointer()
  ckptr.save(directory, flat, force=overwrite)
  ckptr.wait_until_finished()
  log.info("saved %d arrays to %s", len(flat), directory)


def restore(directory: str | os.PathLike, *, target: Any) -> Any:
  """Reads a checkpoint into the structure and shardings of ``target``.

  Args:
    directory: written by ``save``.
    target: pytree like the saved state; leaves are arrays or ``jax.ShapeDtypeStruct`` with a
      ``sharding`` (the layout to load into, on any mesh).

  Raises:
    ValueError: missing directory, or the checkpoint does not hold ``target``'s arrays with the
      same shapes and dtypes.

  Example:
    >>> state = restore(tmp_path / "ckpt", target=step.abstract_state(model))
  """
  directory = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(directory):
    raise ValueError(f"no checkpoint at {directory}")
  flat_target, treedef = _flatten(target)
  ckptr = _checkpointer()
  stored = ckptr.metadata(directory)
  stored = getattr(stored, "item_metadata", stored)
  stored_tree = getattr(stored, "tree", stored)
  stored_keys = set(stored_tree.keys()) if hasattr(stored_tree, "keys") else None
  if stored_keys is not None and stored_keys != set(flat_target):
    missing = sorted(set(flat_target) - stored_keys)[:3]
    extra = sorted(stored_keys - set(flat_target))[:3]
    raise ValueError(f"checkpoint {directory} does not match the target: missing {missing}, "
                     f"unexpected {extra}")
  abstract = {}
  for key, leaf in flat_target.items():
    if isinstance(leaf, (bool, int, float)):         # a Python scalar saved as one (a step, a lr)
      abstract[key] = leaf
      continue
    sharding = getattr(leaf, "sharding", None)
    abstract[key] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    meta = stored_tree[key] if stored_keys is not None else None
    if meta is not None and hasattr(meta, "shape") and tuple(meta.shape) != tuple(leaf.shape):
      raise ValueError(f"checkpoint array {key} has shape {tuple(meta.shape)}, the target "
                       f"{tuple(leaf.shape)}")
    stored_dtype = getattr(meta, "dtype", None)
    if stored_dtype is not None and jnp.dtype(stored_dtype) != jnp.dtype(leaf.dtype):
      # Orbax would cast silently (float32 -> bfloat16 loses precision): the docstring
      # promises the same dtypes.
      raise ValueError(f"checkpoint array {key} has dtype {jnp.dtype(stored_dtype)}, the "
                       f"target {jnp.dtype(leaf.dtype)}")
  flat = ckptr.restore(directory, abstract)
  return jax.tree_util.tree_unflatten(treedef, [flat[k] for k in flat_target])

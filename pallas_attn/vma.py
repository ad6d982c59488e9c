"""Varying-manual-axes helpers shared by the Pallas backends (shard_map with check_vma=True)."""
from __future__ import annotations

import jax


def vma(x) -> frozenset:
  """The mesh axes ``x`` varies over inside shard_map (empty outside)."""
  return frozenset(jax.typeof(x).mat.varying)


def match_vma(arrays, axes: frozenset) -> list:
  """Inside ``shard_map(check_vma=True)``: make every operand vary over the same mesh axes.

  Integer side inputs (block ranges, lengths) built from constants are not varying, while q/k/v
  are; a kernel mixes them, which the vma checker rejects unless they agree. None entries pass.
  """
  out = []
  for x in arrays:
    missing = axes - vma(x) if x is not None else frozenset()
    out.append(jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x)
  return out


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """An output type that varies over the same mesh axes as ``like``."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)

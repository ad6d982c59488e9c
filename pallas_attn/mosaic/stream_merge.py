"""The forward's Stream-K tail merge as one kernel (``Config.stream_tail_merge = "pallas"``).

``stream_tail.merge`` combines each tail tile's parts in XLA: a fusion for the weights, then a
scatter into O and one into lse, three launches that took 7.5 us on the H200 at 68 tail tiles
(session 38), about as much as the cut saves at 2048 keys. Here one Pallas (Triton) program per
tail tile reads that tile's parts from the workspace and writes its finished rows straight into
O and lse, which are aliased to the kernel's outputs, so the other tiles are not touched. The
sums are ``stream_tail.merge``'s, in float32 and in key order (flash-decoding's combine, FA2
Alg. 1 lines 10-12 across parts):

    top = max_p lse_p,   w_p = exp(lse_p - top),   O = sum_p w_p O_p / sum_p w_p,
    lse = top + log sum_p w_p,

with a row that no part saw (every lse_p = -inf) left at O = 0, lse = -inf. The program for
tail tile u finds its (batch, head, query tile) by arithmetic: the tail tiles are the last ones
of the (batch, head, tile) numbering, tile fastest. Deterministic; runs in interpret mode too.

Example (interpret mode, the workspace of ``Tail(5, 3, 4)``)::

    out, lse = stream_merge.merge(out, lse, o_parts, lse_parts, tail=Tail(5, 3, 4), heads=1,
                                  tile_rows=8, interpret=True)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float

from pallas_attn.mosaic import stream_tail
from pallas_attn.mosaic.stream_tail import Tail
from pallas_attn.vma import match_vma, out_struct, vma


def _merge_kernel(index_ref, lse_parts_ref, o_parts_ref, out_alias, lse_alias, out_ref,
                  lse_ref, *, width: int):
  """One tail tile: ``index_ref`` [width] workspace slots of its parts in key order (-1: none),
  ``lse_parts_ref`` [slots, rows] and ``o_parts_ref`` [slots, rows, H] the whole workspace;
  writes the tile's ``out_ref`` [rows, H] and ``lse_ref`` [rows]."""
  del out_alias, lse_alias                  # the same buffers as out_ref / lse_ref
  slots, lps = [], []
  for p in range(width):                    # static: the parts' count is padded to `width`
    slot = index_ref[p]
    lp = lse_parts_ref[jnp.maximum(slot, 0), :]
    slots.append(jnp.maximum(slot, 0))
    lps.append(jnp.where(slot >= 0, lp, -jnp.inf))
  top = functools.reduce(jnp.maximum, lps)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  weights = [jnp.exp(lp - top) for lp in lps]         # 0 for a missing part or an empty row
  total = functools.reduce(jnp.add, weights)
  o = functools.reduce(jnp.add, [w[:, None] * o_parts_ref[s, :, :].astype(jnp.float32)
                                 for w, s in zip(weights, slots)])
  seen = total > 0
  safe = jnp.where(seen, total, 1.0)
  out_ref[...] = (o / safe[:, None]).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(seen, top + jnp.log(safe), -jnp.inf)


def _part_slots(tail: Tail) -> np.ndarray:
  """[r, width] workspace slots (cta * 2 + part) of each tail tile's parts in key order, -1
  where a tile has fewer parts; width a power of two (Triton's block shapes)."""
  index, valid = stream_tail.part_index(tail)
  slots = np.where(valid, index, -1).astype(np.int32)
  width = max(2, 1 << (slots.shape[1] - 1).bit_length())
  return np.pad(slots, ((0, 0), (0, width - slots.shape[1])), constant_values=-1)


def merge(out: Float[Array, "b t n h"], lse: Float[Array, "b n t"],
          o_parts: Float[Array, "c 2 rows h"], lse_parts: Float[Array, "c 2 rows"], *,
          tail: Tail, heads: int, tile_rows: int, interpret: bool = False):
  """``stream_tail.merge`` in one Pallas (Triton) launch: writes the merged tail tiles into
  ``out`` [B, T, N, H] and ``lse`` [B, N, T] (natural log) and returns both. ``tile_rows`` and
  H must be powers of two (Triton blocks); ``ops`` passes 128-row tiles at H = 64 or 128."""
  b, t, n, h = out.shape
  if n != heads or lse.shape != (b, n, t) or t % tile_rows:
    raise ValueError(f"merge: out {out.shape} and lse {lse.shape} do not fit heads={heads}, "
                     f"tile_rows={tile_rows}")
  for name, size in (("tile_rows", tile_rows), ("head dim", h)):
    if size & (size - 1):
      raise NotImplementedError(f"merge: {name} {size} is not a power of two (Triton blocks)")
  tiles = t // tile_rows
  base = tail.rounds * tail.num_ctas
  slots = _part_slots(tail)
  width = slots.shape[1]

  def where(u):                       # tail tile u -> (batch, head, query tile)
    flat = base + u
    bh = flat // tiles
    return bh // heads, bh % heads, flat % tiles

  def out_map(u):
    batch, head, tile = where(u)
    return batch, tile, head, 0

  out_spec = pl.BlockSpec((None, tile_rows, None, h), out_map)
  lse_spec = pl.BlockSpec((None, None, tile_rows), lambda u: where(u))
  num_slots = o_parts.shape[0] * o_parts.shape[1]
  # Inside shard_map (check_vma): the constant slot table varies like the workspace.
  inputs = match_vma([jnp.asarray(slots), lse_parts.reshape(num_slots, tile_rows),
                      o_parts.reshape(num_slots, tile_rows, h), out, lse], vma(out))
  return pl.pallas_call(
      functools.partial(_merge_kernel, width=width),
      grid=(tail.rest,),
      in_specs=[pl.BlockSpec((None, width), lambda u: (u, 0)),
                pl.BlockSpec((num_slots, tile_rows), lambda u: (0, 0)),
                pl.BlockSpec((num_slots, tile_rows, h), lambda u: (0, 0, 0)),
                out_spec, lse_spec],
      out_specs=[out_spec, lse_spec],
      out_shape=[out_struct(out.shape, out.dtype, out), out_struct(lse.shape, lse.dtype, out)],
      input_output_aliases={3: 0, 4: 1},
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="flash_attention_tail_merge",
  )(*inputs)


def merge_parts(out, lse, o_parts, lse_parts, *, method: str, in_shard_map: bool, tail: Tail,
                heads: int, tile_rows: int, interpret: bool):
  """The forward's merge as ``Config.stream_tail_merge`` names it: "pallas" (``merge``) or
  "xla" (``stream_tail.merge``). Inside shard_map always the XLA one: in interpret mode the
  kernel's workspace gather trips the vma check there (a dynamic slice of a varying ref at a
  constant index), and the compiled kernel has not been run under shard_map."""
  if method == "pallas" and not in_shard_map:
    return merge(out, lse, o_parts, lse_parts, tail=tail, heads=heads, tile_rows=tile_rows,
                 interpret=interpret)
  return stream_tail.merge(out, lse, o_parts, lse_parts, tail=tail, heads=heads,
                           tile_rows=tile_rows)

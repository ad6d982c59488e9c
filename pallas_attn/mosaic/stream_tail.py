"""Stream-K for the last partial wave of the persistent unmasked forward (``Config.stream_tail``).

The persistent forward deals its ``num_tiles`` (batch, head, query tile) tiles round-robin to
``C`` CTAs, one per SM. Every unmasked tile costs the same, so with ``num_tiles = R C + r``
(0 < r < C) the launch takes R + 1 tile times while the work is worth R + r / C of them: at
every H = 128 row of the issue table 2048 tiles meet 132 SMs, R = 15, r = 68, and 64 SMs
idle through the sixteenth tile time (3% of the kernel).

Here the R C tiles of the first R rounds stay whole, and the r tail tiles are cut along the
keys (Stream-K, Osama et al. 2023, in its "data-parallel + one-tile Stream-K" hybrid): their
r * n K/V blocks (n blocks a tile) are laid end to end and CTA c takes blocks
[floor(c r n / C), floor((c + 1) r n / C)). Fewer than n blocks each, so a CTA's range meets
at most two tail tiles: at most two *parts* a CTA. A part is an ordinary tile over keys
[lo, hi) only, written normalised with its own log-sum-exp (O_p, lse_p) to a workspace instead
of to O. XLA then merges each tail tile's parts (flash-decoding's combine, the split-K form of
the online softmax, FA2 Alg. 1 lines 10-12 across parts):

    lse = log sum_p exp(lse_p),    O = sum_p exp(lse_p - lse) O_p,

always in key order, so the result is deterministic. The parts travel in the output dtype
(bf16): two roundings of a tail row's O instead of one, inside TESTING.md's ratio rule.

No wait on another CTA and no atomics: each CTA writes its own workspace slots, and the merge
is XLA's (a gather, the sums above and scatters into O and lse: ~r * 32 KB of bf16 written at
H = 128; three small kernels, ~5 us on an H100 with the scatters' indices marked distinct and
sorted, 14 us without). So the kernel's loop is the same in interpret mode and compiled.

The backward (``Config.bwd_stream_tail``) cuts its grids' tails the same way: the dK/dV
kernel's (K/V tile) tiles along the queries, the dQ kernel's along the keys; their float32
partials are plain sums (``merge_sum``).

Example, 5 tiles of 4 blocks on 3 CTAs (``part_table(Tail(5, 3, 4))``): one round (tiles 0-2
whole), then tail tiles 3 and 4 = blocks 0-7 dealt [0, 2), [2, 5), [5, 8): tile 3 = CTA 0's
blocks 0-1 + CTA 1's blocks 2-3, tile 4 = CTA 1's block 0 + CTA 2's blocks 1-3.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

MAX_PARTS = 2           # parts one CTA can hold: its range has fewer blocks than a tile


@dataclasses.dataclass(frozen=True)
class Tail:
  """Static shape of the deal: ``num_tiles`` tiles of ``blocks`` K/V blocks on ``num_ctas``."""
  num_tiles: int
  num_ctas: int
  blocks: int

  @property
  def rounds(self) -> int:          # whole tiles per CTA
    return self.num_tiles // self.num_ctas

  @property
  def rest(self) -> int:            # tail tiles, cut into parts
    return self.num_tiles - self.rounds * self.num_ctas

  def span(self, cta):
    """[start, end) of CTA ``cta`` in the tail's block numbering (traced or Python ints)."""
    total = self.rest * self.blocks
    return (cta * total) // self.num_ctas, ((cta + 1) * total) // self.num_ctas


def kernel_items(cta, tail: Tail):
  """In the kernel: (number of local work items, ``item(i) -> (flat, lo, hi, part)``).
  Items 0 .. rounds - 1 are whole tiles ``cta + i * num_ctas`` (blocks [0, blocks), part -1);
  the next one or two are this CTA's parts: flat tile ``rounds * num_ctas + u``, blocks
  [lo, hi), workspace slot ``part`` (0 or 1)."""
  n, base = tail.blocks, tail.rounds * tail.num_ctas
  start, end = tail.span(cta)
  u0 = lax.div(start, jnp.int32(n))
  lo0 = start - u0 * n
  split = end > (u0 + 1) * n                      # the range runs into a second tail tile
  num_parts = (end > start).astype(jnp.int32) + split.astype(jnp.int32)

  def item(i):
    is_part = i >= tail.rounds
    p = i - tail.rounds
    flat = jnp.where(is_part, base + u0 + p, cta + i * tail.num_ctas)
    lo = jnp.where(is_part & (p == 0), lo0, 0)
    hi = jnp.where(is_part, jnp.where(p == 0, jnp.minimum(n, end - u0 * n),
                                      end - (u0 + 1) * n), n)
    return flat, lo, hi, jnp.where(is_part, p, -1)
  return tail.rounds + num_parts, item


def tail_items(cta, tail: Tail):
  """``kernel_items`` without the whole tiles: (this CTA's parts, ``item(j)`` for part j) for
  a launch that runs only the tail (the backward's, after a grid launch of the whole tiles)."""
  count, item = kernel_items(cta, tail)
  return count - tail.rounds, lambda j: item(j + tail.rounds)


def part_table(tail: Tail) -> list[list[tuple[int, int, int, int]]]:
  """Host side, the same deal: for each tail tile u, its parts (lo, hi, cta, part) in key
  order."""
  parts: list[list[tuple[int, int, int, int]]] = [[] for _ in range(tail.rest)]
  n = tail.blocks
  for c in range(tail.num_ctas):
    start, end = tail.span(c)
    p = 0
    while start < end:
      u = start // n
      stop = min(end, (u + 1) * n)
      parts[u].append((start - u * n, stop - u * n, c, p))
      start, p = stop, p + 1
  for u, ps in enumerate(parts):
    ps.sort()
    covered = [hi - lo for lo, hi, _, _ in ps]
    assert ps and sum(covered) == n and ps[0][0] == 0, (u, ps)   # a partition of the tile
  return parts


def part_index(tail: Tail):
  """[r, width] workspace slots (cta * 2 + part) of each tail tile's parts in key order,
  padded with slot 0 (numpy int32), and a numpy bool mask of the real entries."""
  table = part_table(tail)
  width = max(len(ps) for ps in table)
  index = [[c * 2 + p for _, _, c, p in ps] + [0] * (width - len(ps)) for ps in table]
  valid = [[True] * len(ps) + [False] * (width - len(ps)) for ps in table]
  return np.asarray(index, np.int32), np.asarray(valid)


def merge(out, lse, o_parts, lse_parts, *, tail: Tail, heads: int, tile_rows: int):
  """Writes the merged tail tiles into ``out`` [B, T, N, H] and ``lse`` [B, N, T] (T = tiles *
  tile_rows) from the workspace ``o_parts`` [C, 2, tile_rows, H] and ``lse_parts`` [C, 2,
  tile_rows] (natural-log lse). Tiles are numbered (batch, head, tile), tile fastest."""
  index, valid = part_index(tail)    # unused entries: slot 0 with weight exp(-inf) = 0
  valid = jnp.asarray(valid)
  b, t, _, h = out.shape
  tiles = t // tile_rows
  flat = tail.rounds * tail.num_ctas + np.arange(tail.rest)
  bh, tile = flat // tiles, flat % tiles
  batch, head = bh // heads, bh % heads

  lp = lse_parts.reshape(-1, tile_rows)[index]                    # [r, width, rows]
  lp = jnp.where(valid[:, :, None], lp, -jnp.inf)
  top = jnp.max(lp, axis=1, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  w = jnp.exp(lp - top)                                           # 0 for unused entries
  total = jnp.sum(w, axis=1)                                      # [r, rows]
  op = o_parts.reshape(-1, tile_rows, h)[index].astype(jnp.float32)  # [r, width, rows, H]
  o = jnp.einsum("uprh,upr->urh", op, w, precision=lax.Precision.HIGHEST)
  seen = total > 0
  o = o / jnp.where(seen, total, 1.0)[:, :, None]
  merged_lse = jnp.where(seen, top[:, 0] + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)

  # Distinct tiles, in increasing order of the index tuples: XLA's scatter then needs no
  # atomics or sorting (14 us -> 3 us at 68 tiles, H100). lse's (batch, head, tile) tuples
  # ascend in the tile numbering; O's (batch, tile, head) do after a static permutation.
  hints = dict(unique_indices=True, indices_are_sorted=True)
  perm = np.lexsort((head, tile, batch))          # by batch, then tile, then head
  out5 = out.reshape(b, tiles, tile_rows, heads, h)
  out5 = out5.at[batch[perm], tile[perm], :, head[perm], :].set(
      o[perm].astype(out.dtype), **hints)
  lse4 = lse.reshape(b, heads, tiles, tile_rows)
  lse4 = lse4.at[batch, head, tile, :].set(merged_lse, **hints)
  return out5.reshape(out.shape), lse4.reshape(lse.shape)


def merge_sum(dst, parts, *, tail: Tail, coords, tile_rows: int, scale: float = 1.0):
  """Writes each tail tile's sum of parts (in query order, float32, times ``scale``) into
  ``dst`` [B, S, K, H] (rows tile * tile_rows + ...), from ``parts`` [C, 2, tile_rows, H]: the
  backward's dK / dV partials, linear in the queries, so no weights. ``coords(flat) -> (batch,
  head, tile)`` numbers the launch's tiles (numpy arrays in, numpy arrays out)."""
  index, valid = part_index(tail)
  flat = tail.rounds * tail.num_ctas + np.arange(tail.rest)
  batch, head, tile = coords(flat)
  b, s, k, h = dst.shape
  got = parts.reshape(-1, tile_rows, h)[index]                   # [r, width, rows, H]
  total = jnp.einsum("uprh,up->urh", got, jnp.asarray(valid, jnp.float32),
                     precision=lax.Precision.HIGHEST) * scale
  out = dst.reshape(b, s // tile_rows, tile_rows, k, h)
  order = np.lexsort((head, tile, batch))        # ascending (batch, tile, head) tuples
  out = out.at[batch[order], tile[order], :, head[order], :].set(
      total[order].astype(dst.dtype), unique_indices=True, indices_are_sorted=True)
  return out.reshape(dst.shape)


def merge_rows(main, tail_rows, *, tail: Tail, coords, tile_rows: int):
  """The backward's [B, N, 2, T] L2 / D record: the tail tiles' rows from ``tail_rows`` (the
  tail launch's record), the rest from ``main``."""
  flat = tail.rounds * tail.num_ctas + np.arange(tail.rest)
  batch, head, tile = coords(flat)
  b, n, two, t = main.shape
  shape = (b, n, two, t // tile_rows, tile_rows)
  order = np.lexsort((tile, head, batch))         # ascending (batch, head, tile) tuples
  batch, head, tile = batch[order], head[order], tile[order]
  got = tail_rows.reshape(shape)[batch, head, :, tile, :]
  return main.reshape(shape).at[batch, head, :, tile, :].set(
      got, unique_indices=True, indices_are_sorted=True).reshape(main.shape)


def workspace_types(tail: Tail, *, tile_rows: int, head_dim: int, dtype):
  """The kernel's two extra outputs: the parts' O and lse."""
  return (jax.ShapeDtypeStruct((tail.num_ctas, 2, tile_rows, head_dim), dtype),
          jax.ShapeDtypeStruct((tail.num_ctas, 2, tile_rows), jnp.float32))

"""Persistent launches of the backward kernels: a fixed number of CTAs (one per SM) walk the
(heads, tiles, batch) tile space round-robin, each tile's loads overlapping the previous tile's
compute (``Config.bwd_persistent``, ``Config.bwd_stream_tail``)."""
import math

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def _decode_tile(t, *, grid_tiles):
  """(batch, head, sequence tile) of persistent tile ``t`` of the (heads, tiles, batch) tile
  space, sequence tiles fastest: the ~132 tiles running together are one or two heads'
  tiles, which share that head's operands (K / V, or Q / dO) in L2. (Until session 38 heads
  were fastest here, read as "the grid's launch order"; Mosaic GPU launches its grid with the
  last grid axis fastest, i.e. batch, then tiles, then heads: see ``ops._grid``.)"""
  heads, tiles, _ = grid_tiles
  return lax.div(t, heads * tiles), lax.rem(lax.div(t, tiles), heads), lax.rem(t, tiles)


def persistent_tile_count(cta, num_ctas: int, grid_tiles):
  """Tiles that CTA ``cta`` of a persistent launch takes round-robin from the grid."""
  return lax.div(math.prod(grid_tiles) - cta + num_ctas - 1, num_ctas)


def persistent_consumer_loop(*, cta, num_ctas: int, my_tiles, load, wait, consume):
  """A persistent backward consumer's tiles t = cta, cta + num_ctas, ...: tile ``it`` computes
  from buffer ``it % 2`` (``wait(buf)`` for its loads, ``consume(t, buf, it)``) while the next
  tile loads into the other buffer (``load(t, buf)``), once the last tile's TMA stores have
  read it (those stores leave through the buffer they were computed from)."""
  pl.when(my_tiles > 0)(lambda: load(cta, 0))

  @pl.loop(0, my_tiles)
  def _tile(it):
    t, buf = cta + it * num_ctas, lax.rem(it, 2)
    wait(buf)

    @pl.when(it + 1 < my_tiles)
    def _prefetch():
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      load(t + num_ctas, 1 - buf)
    consume(t, buf, it)

"""Block ranges of the mask logic (pallas_attn/masks.py) against a brute-force visibility map."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import masks

SPECS = [(None, None), (None, 0), (3, 0), (50, 5), (0, None), (200, -3)]


def _visible(spec: masks.MaskSpec, t: int, s: int) -> np.ndarray:
  q = np.arange(t)[:, None] + spec.offset
  k = np.arange(s)[None, :]
  vis = np.ones((t, s), bool)
  if spec.right is not None:
    vis &= k <= q + spec.right
  if spec.left is not None:
    vis &= k >= q - spec.left
  return vis


@pytest.mark.parametrize("left,right", SPECS)
@pytest.mark.parametrize("t,s", [(5, 7), (100, 129), (300, 256), (64, 700)])
def test_block_ranges_cover_exactly_the_visible_blocks(left, right, t, s):
  bq, bk = 64, 32
  spec = masks.MaskSpec(left=left, right=right, offset=s - t)
  vis = _visible(spec, t, s)
  ranges = np.asarray(masks.kv_block_ranges(spec=spec, seq_q=t, seq_k=s, block_q=bq,
                                            block_k=bk, batch=1))[0]
  for qi, (lo, lo_full, hi_full, hi) in enumerate(ranges):
    rows = vis[qi * bq:(qi + 1) * bq]
    blocks = [rows[:, j * bk:(j + 1) * bk] for j in range(-(-s // bk))]
    any_ = [j for j, blk in enumerate(blocks) if blk.any()]
    assert (lo, hi) == ((any_[0], any_[-1] + 1) if any_ else (0, 0))
    assert lo <= lo_full <= hi_full <= hi
    for j in range(lo_full, hi_full):         # mask-free blocks really are fully visible
      assert blocks[j].all()
    # tile_block_range (what the Mosaic kernel computes from its tile index) agrees
    q_last = min((qi + 1) * bq, t) - 1
    got = masks.tile_block_range(jnp.int32(qi * bq), jnp.int32(q_last), spec=spec, seq_k=s,
                                 block_k=bk)
    assert [int(x) for x in got] == [lo, lo_full, hi_full, hi]

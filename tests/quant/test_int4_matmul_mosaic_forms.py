"""Mosaic GPU W4A16 kernel, its opt-in forms: stream-K (``MosaicConfig.stream_ctas``,
``mosaic_stream.py``), tile-major storage (``prepare_mosaic(..., tile_major=True)``) and
``late_zero``. Interpret-mode correctness, lowering for sm90 on a CPU host, compiled runs (GPU
only). Same numerical rule as ``test_int4_matmul_mosaic.py``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quant
from quant.matmul import layout
from quant.matmul import mosaic as w4_mosaic
from quant.matmul.config import (MosaicConfig, SMEM_BYTES, default_mosaic_config,
                                 mosaic_smem_bytes)
from test_int4_matmul_mosaic import BF16, _abstract_weight, _h200, _lowered_text
from test_int4_matmul_triton import _check, _weight, _x

# See test_int4_matmul_mosaic.py: a stuck interpreter thread is ended.
pytestmark = pytest.mark.timeout(300, method="thread")

# ----------------------------------------------------------------------------------------------
# Stream-K form (MosaicConfig.stream_ctas, quant/matmul/mosaic_stream.py)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tiles,steps,ctas", [(448, 16, 264), (64, 32, 132), (3, 4, 12), (5, 7, 3),
                                              (7, 3, 20), (224, 16, 132), (1, 1, 1), (2, 9, 5)])
def test_stream_plan_covers_every_unit_once_with_distinct_parts(tiles, steps, ctas):
  """Every (tile, step) unit belongs to exactly one segment, CTAs get L or L + 1 units, and the
  segments of one tile have distinct part slots, the first one slot 0."""
  from quant.matmul.mosaic_stream import StreamPlan
  plan = StreamPlan(tiles=tiles, steps=steps, ctas=ctas)
  covered = np.zeros((tiles, steps), int)
  per_cta = np.zeros(ctas, int)
  slots = {}
  for c, tile, s, e, p in plan.segments():
    assert 0 <= s < e <= steps
    covered[tile, s:e] += 1
    per_cta[c] += e - s
    assert (tile, p) not in slots, (tile, p, slots)
    slots[(tile, p)] = s
    assert (p == 0) == (s == 0)
  assert (covered == 1).all()
  assert set(per_cta) <= {plan.per_cta, plan.per_cta + 1}
  written = plan.written()
  assert written.shape == (plan.parts, tiles) and written.sum() == len(slots)
  assert written[0].all()                                  # every tile's first segment


def test_stream_plan_rejects_more_ctas_than_units():
  from quant.matmul.mosaic_stream import StreamPlan
  with pytest.raises(ValueError, match="ctas"):
    StreamPlan(tiles=2, steps=2, ctas=5)
  with pytest.raises(ValueError, match="stream_ctas"):
    MosaicConfig(stream_ctas=-1)


# (m, k, n, group_size, sym, block_k, block_n, stream_ctas): tiles x steps split over CTAs that
# cross tile boundaries (3, 5), one unit each (12 = tiles x steps), more CTAs asked than units,
# two warpgroups, long groups (one scale for 2 steps), per-channel, symmetric.
STREAM_CASES = [
    (3, 1024, 192, 128, False, 256, 64, 3),
    (1, 1024, 192, 128, False, 256, 64, 5),
    (2, 1024, 192, 64, True, 256, 64, 12),
    (8, 512, 100, 128, False, 256, 64, 50),
    (5, 2048, 256, 64, False, 256, 128, 3),
    (16, 1024, 128, 512, False, 256, 64, 3),
    (4, 520, 70, -1, True, 256, 64, 2),
    (16, 1024, 512, 128, False, 512, 256, 3),   # the M = 16 default's form: four warpgroups
]


@pytest.mark.parametrize("m,k,n,group_size,sym,block_k,block_n,ctas", STREAM_CASES,
                         ids=[f"m{c[0]}_k{c[1]}_n{c[2]}_g{c[3]}_wg{c[6] // 64}_c{c[7]}"
                              for c in STREAM_CASES])
def test_stream_k_matches_reference_in_interpret_mode(m, k, n, group_size, sym, block_k, block_n,
                                                      ctas):
  qw = _weight(k, n, group_size=group_size, sym=sym, act_order=False)
  x = _x(m, k, BF16, seed=m + 7)
  b = _x(1, n, BF16, seed=3)[0]
  cfg = MosaicConfig(block_n=block_n, block_k=block_k, num_stages=2, stream_ctas=ctas)
  y = w4_mosaic.int4_matmul(x, qw, bias=b, config=cfg, interpret=True)
  assert y.shape == (m, n) and y.dtype == BF16
  _check(y, x, qw, b)


def test_stream_k_with_one_segment_per_tile_is_bitwise_equal_to_the_grid():
  """With as many CTAs as tiles each CTA walks exactly one tile's K: the same steps in the same
  order as the one-split grid kernel (short groups), so the same bits."""
  m, k, n = 3, 1024, 192
  qw = _weight(k, n, group_size=128, sym=False, act_order=False)
  x = _x(m, k, BF16, seed=5)
  cfg = MosaicConfig(block_n=64, block_k=256, num_stages=2)
  grid = w4_mosaic.int4_matmul(x, qw, config=cfg, interpret=True)
  stream = w4_mosaic.int4_matmul(x, qw, config=dataclasses.replace(cfg, stream_ctas=3),
                                 interpret=True)
  np.testing.assert_array_equal(np.asarray(grid, np.float32), np.asarray(stream, np.float32))


@pytest.mark.parametrize("kernel", ["grid", "stream"])
def test_groups_per_scope_is_bitwise_neutral(kernel):
  """``MosaicConfig.acc_columns`` decides how many groups share one wgmma wait, not the sums:
  four groups of 64 rows per 256-row step, one scope per group against one for all four."""
  m, k, n = 3, 1024, 192
  qw = _weight(k, n, group_size=64, sym=False, act_order=False)
  x = _x(m, k, BF16, seed=9)
  cfg = MosaicConfig(block_n=64, block_k=256, num_stages=2,
                     stream_ctas=5 if kernel == "stream" else 0)
  outs = [w4_mosaic.int4_matmul(x, qw, interpret=True,
                                config=dataclasses.replace(cfg, acc_columns=a))
          for a in (8, 64, 0)]
  np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[2], np.float32))
  np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))
  _check(outs[1], x, qw)


@pytest.mark.parametrize("m,k,n,group_size,sym,config", [
    (1, 8192, 28672, 128, False, MosaicConfig(block_n=64, num_stages=4, stream_ctas=264)),
    (16, 8192, 28672, 128, False, MosaicConfig(block_n=128, num_stages=3, stream_ctas=264)),
    (1, 8192, 8192, 128, True, MosaicConfig(block_n=64, block_k=256, num_stages=4,
                                            stream_ctas=132)),
    (8, 4096, 1024, -1, False, MosaicConfig(block_n=64, num_stages=4, stream_ctas=100)),
], ids=["decode_2_per_sm", "m16_wg2", "square_sym", "per_channel"])
def test_stream_k_lowers_to_mosaic_gpu_for_h200(m, k, n, group_size, sym, config):
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  qw = _abstract_weight(k, n, group_size=group_size, sym=sym, act_order=False)
  mw = jax.eval_shape(lambda qw: layout.prepare_mosaic(qw, block_k=config.block_k), qw)
  x = jax.ShapeDtypeStruct((m, k), BF16)
  text = _lowered_text(x, mw, config)
  assert "w4a16_mosaic_stream" in text


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,group_size,block_n,ctas", [
    (1, 4096, 1024, 128, 64, 132), (16, 2048, 640, 64, 128, 7), (5, 1024, 200, -1, 64, 40),
    (3, 4096, 1024, 512, 64, 264)], ids=["decode", "m16_wg2", "per_channel", "long_groups"])
def test_compiled_stream_k_matches_reference(m, k, n, group_size, block_n, ctas):
  """Compiled stream-K: CTAs crossing tile boundaries, segment stores and their part slots."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  qw = _weight(k, n, group_size=group_size, sym=False, act_order=False)
  x = _x(m, k, BF16, seed=m)
  b = _x(1, n, BF16, seed=4)[0]
  mw = layout.prepare_mosaic(qw, block_k=256)
  cfg = MosaicConfig(block_n=block_n, block_k=256, num_stages=3, stream_ctas=ctas)
  _check(w4_mosaic.int4_matmul(x, mw, bias=b, interpret=False, config=cfg), x, qw, b)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 40, 64])
def test_compiled_default_stream_k_through_the_public_api(m):
  """The defaults at 8192 x 28672 are stream-K (64-feature CTAs at M = 1, 256-feature CTAs
  with two stages at M = 16, one CTA per SM above; at M = 64 128-feature CTAs whose partials
  leave from registers), reached as users reach them:
  ``quant.int4_matmul`` on a weight prepared with the default layout."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  k, n = 8192, 28672
  cfg = default_mosaic_config(m=m, k=k, n=n, group_size=128)
  assert cfg.stream_ctas and cfg.block_n == {1: 64, 16: 256}.get(m, cfg.block_n)
  qw = _weight(k, n, group_size=128, sym=False, act_order=False)
  x = _x(m, k, BF16, seed=m)
  _check(jax.jit(quant.int4_matmul)(x, layout.prepare_mosaic(qw)), x, qw)


# ----------------------------------------------------------------------------------------------
# Tile-major storage (layout.prepare_mosaic(..., tile_major=True)): each TMA box contiguous
# ----------------------------------------------------------------------------------------------

def test_tile_major_layout_round_trips():
  qw = _weight(1024, 130, group_size=128, sym=False, act_order=True, seed=2)
  row = layout.prepare_mosaic(qw, block_k=256)
  tile = layout.prepare_mosaic(qw, block_k=256, tile_major=True)
  assert tile.tile_major and tile.qweight.shape == (3, 4, 64, 64)        # Np/64, steps, 64, span2
  assert tile.scales.shape == (3, 8, 64) and tile.zeros.shape == (3, 8, 64)
  assert tile.padded_shape == row.padded_shape == (1024, 192)
  # Box (feature tile i, step s) is rows [64 i, 64 i + 64) x columns [64 s, 64 s + 64) of the
  # row-major codes, stored contiguously.
  np.testing.assert_array_equal(np.asarray(tile.qweight[2, 1]), np.asarray(row.qweight[128:, 64:128]))
  np.testing.assert_array_equal(np.asarray(tile.scales[1, 5]), np.asarray(row.scales[5, 64:128]))
  back = layout.to_row_major(tile)
  for name in ("qweight", "scales", "zeros", "perm"):
    np.testing.assert_array_equal(np.asarray(getattr(back, name)), np.asarray(getattr(row, name)))
  assert not back.tile_major and layout.to_row_major(row) is row
  np.testing.assert_array_equal(np.asarray(layout.unpack_mosaic(tile.qweight, 256)),
                                np.asarray(layout.unpack_mosaic(row.qweight, 256)))


# (m, k, n, group_size, sym, config): short groups, long groups with a K split, per-channel with
# padded K and N, stream-K crossing tile boundaries.
TILE_MAJOR_CASES = [
    (3, 1024, 192, 128, False, MosaicConfig(block_n=64, block_k=256, num_stages=2)),
    (2, 1024, 130, 512, True, MosaicConfig(block_n=64, block_k=256, num_stages=2, split_k=2)),
    (5, 520, 70, -1, False, MosaicConfig(block_n=64, block_k=256, num_stages=3)),
    (4, 1024, 192, 64, False, MosaicConfig(block_n=64, block_k=256, num_stages=2, stream_ctas=5)),
]


@pytest.mark.parametrize("m,k,n,group_size,sym,config", TILE_MAJOR_CASES,
                         ids=["short_groups", "long_groups_split2", "per_channel", "stream_k"])
def test_tile_major_is_bitwise_equal_to_row_major(m, k, n, group_size, sym, config):
  """The storage changes where each TMA box is read from, not what it holds."""
  qw = _weight(k, n, group_size=group_size, sym=sym, act_order=False, seed=m)
  x = _x(m, k, BF16, seed=m + 3)
  b = _x(1, n, BF16, seed=6)[0]
  outs = [w4_mosaic.int4_matmul(x, layout.prepare_mosaic(qw, block_k=256, tile_major=t), bias=b,
                                config=config, interpret=True) for t in (False, True)]
  np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))
  _check(outs[1], x, qw, b)


def test_tile_major_gradient_and_bad_shapes():
  qw = _weight(512, 64, group_size=128, sym=False, act_order=False, seed=4)
  x = _x(2, 512, BF16, seed=5)
  grads = []
  for t in (False, True):
    mw = layout.prepare_mosaic(qw, block_k=256, tile_major=t)
    f = lambda x: jnp.sum(w4_mosaic.int4_matmul(x, mw, interpret=True).astype(jnp.float32))
    grads.append(np.asarray(jax.grad(f)(x), np.float32))
  np.testing.assert_array_equal(grads[0], grads[1])
  mw = layout.prepare_mosaic(qw, block_k=256, tile_major=True)
  with pytest.raises(ValueError, match="scales shape"):
    w4_mosaic.int4_matmul(x, dataclasses.replace(mw, scales=mw.scales[:, :-1]), interpret=True)
  with pytest.raises(ValueError, match="qweight shape"):
    w4_mosaic.int4_matmul(x, dataclasses.replace(mw, qweight=mw.qweight[:, :-1]), interpret=True)


@pytest.mark.parametrize("m,config", [
    (1, MosaicConfig(block_n=64, num_stages=4)),
    (16, MosaicConfig(block_n=128, num_stages=3, stream_ctas=132))], ids=["grid", "stream_k"])
def test_tile_major_lowers_to_mosaic_gpu_for_h200(m, config):
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  qw = _abstract_weight(8192, 28672, group_size=128, sym=False, act_order=False)
  mw = jax.eval_shape(lambda qw: layout.prepare_mosaic(qw, block_k=512, tile_major=True), qw)
  assert mw.qweight.shape == (448, 16, 64, 128)
  x = jax.ShapeDtypeStruct((m, 8192), BF16)
  text = _lowered_text(x, mw, config)
  assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,group_size,config", [
    (1, 4096, 1024, 128, MosaicConfig(block_n=64, block_k=256, num_stages=4)),
    (16, 2048, 640, 64, MosaicConfig(block_n=128, block_k=256, num_stages=3, split_k=2)),
    (3, 4096, 1024, 512, MosaicConfig(block_n=64, block_k=256, num_stages=3, stream_ctas=40))],
    ids=["decode", "m16_split2", "stream_k"])
def test_compiled_tile_major_is_bitwise_equal(m, k, n, group_size, config):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  qw = _weight(k, n, group_size=group_size, sym=False, act_order=False)
  x = _x(m, k, BF16, seed=m)
  outs = [w4_mosaic.int4_matmul(x, layout.prepare_mosaic(qw, block_k=256, tile_major=t),
                                config=config, interpret=False) for t in (False, True)]
  np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))
  _check(outs[1], x, qw, None)


# ----------------------------------------------------------------------------------------------
# late_zero: wgmma over B + q, the (B + z) X_g offset taken off each group's float32 partial
# ----------------------------------------------------------------------------------------------

# (m, k, n, group_size, sym, config): short groups (2 per step), long groups over a K split,
# per-channel with a K split and padded K / N, symmetric, stream-K across tile boundaries.
LATE_ZERO_CASES = [
    (3, 1024, 192, 64, False, MosaicConfig(block_n=64, block_k=256, num_stages=2)),
    (2, 2048, 130, 512, False, MosaicConfig(block_n=64, block_k=256, num_stages=3, split_k=2)),
    (5, 520, 70, -1, False, MosaicConfig(block_n=64, block_k=256, num_stages=2, split_k=3)),
    (8, 1024, 128, 128, True, MosaicConfig(block_n=64, block_k=512, num_stages=2)),
    (4, 1024, 192, 128, False, MosaicConfig(block_n=64, block_k=256, num_stages=2,
                                            stream_ctas=5)),
]


@pytest.mark.parametrize("m,k,n,group_size,sym,config", LATE_ZERO_CASES,
                         ids=["short_groups", "long_groups_split2", "per_channel_split3", "sym",
                              "stream_k"])
def test_late_zero_matches_reference(m, k, n, group_size, sym, config):
  qw = _weight(k, n, group_size=group_size, sym=sym, act_order=False, seed=m + 1)
  x = _x(m, k, BF16, seed=m + 2)
  b = _x(1, n, BF16, seed=8)[0]
  late = dataclasses.replace(config, late_zero=True)
  y = w4_mosaic.int4_matmul(x, qw, bias=b, config=late, interpret=True)
  assert y.shape == (m, n) and y.dtype == BF16
  _check(y, x, qw, b)
  # Same maths as the packed subtract up to float32 rounding of the partials.
  base = w4_mosaic.int4_matmul(x, qw, bias=b, config=config, interpret=True)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(base, np.float32),
                             rtol=2e-2, atol=2e-2 * float(jnp.max(jnp.abs(base))))


def test_x_sums_per_piece():
  """One sum per group when a step holds several groups, one per step when a group is longer."""
  xp = jnp.arange(2 * 1024, dtype=jnp.float32).reshape(2, 1024).astype(BF16)
  short = w4_mosaic.Statics(m_pad=2, steps=4, block_k=256, seg=64, stages=2, wgs=1, sym=False,
                            zero=8.0, dtype=BF16, magic_bits=0x4300, magic=128.0)
  want = np.asarray(xp, np.float32).reshape(2, 16, 64).sum(-1).T
  np.testing.assert_allclose(np.asarray(w4_mosaic.x_sums(xp, st=short)), want, rtol=1e-6)
  long = dataclasses.replace(short, seg=512)
  want = np.asarray(xp, np.float32).reshape(2, 4, 256).sum(-1).T
  np.testing.assert_allclose(np.asarray(w4_mosaic.x_sums(xp, st=long)), want, rtol=1e-6)


@pytest.mark.parametrize("m,sym,config", [
    (1, False, MosaicConfig(block_n=64, num_stages=4, late_zero=True)),
    (16, True, MosaicConfig(block_n=128, num_stages=3, late_zero=True)),
    (1, False, MosaicConfig(block_n=64, num_stages=4, stream_ctas=264, late_zero=True))],
    ids=["decode", "m16_sym_wg2", "stream_k"])
def test_late_zero_lowers_without_the_packed_subtract(monkeypatch, m, sym, config):
  """Compiled form: no bf16x2 subtract of B + z is traced (the wgmma A operands come straight
  from the bit operations) and the x sums are one more kernel input."""
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  qw = _abstract_weight(8192, 28672, group_size=128, sym=sym, act_order=False)
  mw = jax.eval_shape(lambda qw: layout.prepare_mosaic(qw, block_k=512), qw)
  x = jax.ShapeDtypeStruct((m, 8192), BF16)
  offsets = []
  real = w4_mosaic.zero_offset
  monkeypatch.setattr(w4_mosaic, "zero_offset", lambda *a: offsets.append(1) or real(*a))
  if config.stream_ctas:
    from quant.matmul import mosaic_stream
    monkeypatch.setattr(mosaic_stream, "zero_offset", w4_mosaic.zero_offset)
  text = _lowered_text(x, mw, config)
  assert "mosaic_gpu" in text
  assert len(offsets) == 4                   # one offset per group of a step (g128, block_k 512)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,group_size,sym,config", LATE_ZERO_CASES,
                         ids=["short_groups", "long_groups_split2", "per_channel_split3", "sym",
                              "stream_k"])
def test_compiled_late_zero_matches_reference(m, k, n, group_size, sym, config):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  qw = _weight(k, n, group_size=group_size, sym=sym, act_order=False, seed=m + 1)
  x = _x(m, k, BF16, seed=m + 2)
  mw = layout.prepare_mosaic(qw, block_k=config.block_k)
  y = w4_mosaic.int4_matmul(x, mw, config=dataclasses.replace(config, late_zero=True),
                            interpret=False)
  _check(y, x, qw, None)


@pytest.mark.parametrize("m_pad,gps,rows", [(8, 1, 4), (8, 2, 4), (8, 4, 4), (8, 5, 8), (16, 1, 2),
                                            (24, 1, 4), (32, 1, 1), (64, 3, 3)])
def test_x_sum_slots_are_128_byte_aligned(m_pad, gps, rows):
  st = w4_mosaic.Statics(m_pad=m_pad, steps=1, block_k=512, seg=512 // gps, stages=2, wgs=1,
                         sym=False, zero=8.0, dtype=BF16, magic_bits=0x4300, magic=128.0)
  assert st.groups_per_step == gps
  assert w4_mosaic.xs_rows(st) == rows and rows * m_pad * 4 % 128 == 0


# ----------------------------------------------------------------------------------------------
# Partials stored from registers (MosaicConfig.out_registers): no output tile in SMEM
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,k,n,group_size,config", [
    (3, 1024, 192, 128, MosaicConfig(block_n=64, block_k=256, num_stages=2, split_k=2)),
    (5, 1024, 192, 128, MosaicConfig(block_n=64, block_k=256, num_stages=2, stream_ctas=5)),
], ids=["grid_split2", "stream5"])
def test_out_registers_is_bitwise_equal(m, k, n, group_size, config):
  """Where the partials go (a TMA store from an SMEM tile, or 8-byte stores from registers)
  changes nothing in the sums: grid with two K splits, stream-K with segments across tiles."""
  qw = _weight(k, n, group_size=group_size, sym=False, act_order=False)
  x = _x(m, k, BF16, seed=m + 2)
  outs = [w4_mosaic.int4_matmul(x, qw, interpret=True,
                                config=dataclasses.replace(config, out_registers=r))
          for r in (False, True)]
  np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))
  _check(outs[1], x, qw)


def test_out_registers_frees_the_output_tile():
  """At 64 rows the 32 KB tile of a 128-feature CTA is what keeps a second 512-row stage out."""
  wide = MosaicConfig(block_n=128, block_k=512, num_stages=2)
  tile = 128 * 64 * 4
  assert mosaic_smem_bytes(wide, m=64, asym=True) > SMEM_BYTES
  freed = dataclasses.replace(wide, out_registers=True)
  assert mosaic_smem_bytes(freed, m=64, asym=True) == (
      mosaic_smem_bytes(wide, m=64, asym=True) - tile) <= SMEM_BYTES
  # direct_io writes y through its own tile, which stays counted.
  both = dataclasses.replace(freed, direct_io=True)
  assert mosaic_smem_bytes(both, m=64, asym=True) == mosaic_smem_bytes(wide, m=64, asym=True)


@pytest.mark.parametrize("config", [
    MosaicConfig(block_n=128, block_k=512, num_stages=2, stream_ctas=132, out_registers=True),
    MosaicConfig(block_n=256, block_k=256, num_stages=3, split_k=2, out_registers=True),
], ids=["stream_wg2", "grid_wg4"])
def test_out_registers_lowers_to_mosaic_gpu_for_h200(config):
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  k, n = (8192, 28672) if config.block_k == 512 else (8192, 8192)
  qw = _abstract_weight(k, n, group_size=128, sym=False, act_order=False)
  mw = jax.eval_shape(lambda qw: layout.prepare_mosaic(qw, block_k=config.block_k), qw)
  text = _lowered_text(jax.ShapeDtypeStruct((64, k), BF16), mw, config)
  assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,config", [
    (64, 8192, 28672, MosaicConfig(block_n=128, block_k=512, num_stages=2, stream_ctas=132,
                                   out_registers=True)),
    (64, 8192, 8192, MosaicConfig(block_n=256, block_k=256, num_stages=3, split_k=2,
                                  out_registers=True)),
    (57, 2048, 640, MosaicConfig(block_n=128, block_k=256, num_stages=4, split_k=2,
                                 out_registers=True)),
    (1, 4096, 1024, MosaicConfig(block_n=64, block_k=512, num_stages=4, stream_ctas=50,
                                 mma_sync=True, out_registers=True)),
], ids=["m64_stream_wg2", "m64_grid_wg4", "m57_grid", "m1_mma_sync_stream"])
def test_compiled_out_registers_matches_reference(m, k, n, config):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  qw = _weight(k, n, group_size=128, sym=False, act_order=False)
  x = _x(m, k, BF16, seed=m)
  b = _x(1, n, BF16, seed=4)[0]
  mw = layout.prepare_mosaic(qw, block_k=config.block_k)
  y = w4_mosaic.int4_matmul(x, mw, bias=b, interpret=False, config=config)
  _check(y, x, qw, b)
  # Where the form without it fits the SMEM unchanged, the bits must be the same.
  plain = dataclasses.replace(config, out_registers=False)
  if mosaic_smem_bytes(plain, m=m, asym=True) <= SMEM_BYTES:
    y0 = w4_mosaic.int4_matmul(x, mw, bias=b, interpret=False, config=plain)
    np.testing.assert_array_equal(np.asarray(y0, np.float32), np.asarray(y, np.float32))


# ----------------------------------------------------------------------------------------------
# Stream-K with one group's wgmmas in flight (MosaicConfig.pipeline; compiled only)
# ----------------------------------------------------------------------------------------------


def test_group_pipeline_lowers_with_one_group_in_flight():
  """The stream-K form's ``pipeline`` issues group g + 1 before it waits for group g: its waits
  leave one group's commit groups (per_group wgmmas) in flight, and only the last is a full
  wait."""
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  from benchmarks import mosaic_mlir
  k, n = 8192, 28672
  qw = _abstract_weight(k, n, group_size=128, sym=False, act_order=False)
  mw = jax.eval_shape(lambda qw: layout.prepare_mosaic(qw, block_k=512), qw)
  cfg = MosaicConfig(block_n=128, block_k=512, num_stages=2, stream_ctas=132,
                     out_registers=True, pipeline=True)
  f = lambda x, mw: w4_mosaic.int4_matmul(x, mw, config=cfg, interpret=False)
  with _h200():
    low = jax.jit(f).trace(jax.ShapeDtypeStruct((64, k), BF16), mw).lower(
        lowering_platforms=("cuda",))
  text = mosaic_mlir.kernel_texts(low)[0]
  waits = [int(line.split("wait_group.sync.aligned")[1].split(";")[0])
           for line in text.splitlines() if "wgmma.wait_group.sync.aligned" in line]
  # 4 groups in the loop's unit, 4 in the last unit: 7 partial waits, one full one at the end.
  assert waits == [1] * 7 + [0], waits


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,group_size,sym,block_k,block_n,ctas", [
    (64, 8192, 28672, 128, False, 512, 128, 132),     # the M = 64 default's CTAs, pipelined
    (16, 2048, 640, 128, True, 512, 256, 7),          # four warpgroups, segments across tiles
    (3, 4096, 1024, 128, False, 256, 64, 50),         # 2 groups a step (2 planes each)
    (40, 2048, 1024, 64, False, 256, 128, 33),        # 4 groups a step
], ids=["m64_wg2", "m16_wg4_sym", "m3_bk256", "m40_g64"])
def test_compiled_group_pipeline_matches_reference(m, k, n, group_size, sym, block_k, block_n,
                                                   ctas):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  qw = _weight(k, n, group_size=group_size, sym=sym, act_order=False)
  x = _x(m, k, BF16, seed=m)
  b = _x(1, n, BF16, seed=4)[0]
  mw = layout.prepare_mosaic(qw, block_k=block_k)
  cfg = MosaicConfig(block_n=block_n, block_k=block_k, num_stages=2, stream_ctas=ctas,
                     out_registers=m > 48, pipeline=True)
  _check(w4_mosaic.int4_matmul(x, mw, bias=b, interpret=False, config=cfg), x, qw, b)

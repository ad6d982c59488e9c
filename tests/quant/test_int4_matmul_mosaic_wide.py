"""Mosaic GPU W4A16 kernel at 65..128 rows of x (one call; ``MOSAIC_WIDE_M < M <= MOSAIC_MAX_M``),
x's own ring of planes (``MosaicConfig.x_slots``, ``mosaic_xring.py``) and the chunking of larger
calls on a prepared weight. Interpret-mode correctness (one warpgroup: see
``test_int4_matmul_mosaic.py`` on multi-warpgroup interpret runs), the config rules (two
warpgroups at most, two stages, no SMEM output tile; x's own ring where a step's planes do not
fit), the chunk sizes, lowering for sm90 on a CPU host, and compiled runs of x's ring (GPU
only; the 65..256-row calls of the default layouts run in
``test_int4_matmul_mosaic.test_compiled_on_gpu``). Same numerical rule as
``test_int4_matmul_mosaic.py``.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import quant
from quant.matmul import layout
from quant.matmul import mosaic as w4_mosaic
from quant.matmul.config import (MOSAIC_MAX_M, MOSAIC_SCALED_MAX_M, MOSAIC_WIDE_M, SMEM_BYTES,
                                 MosaicConfig,
                                 check_mosaic_shape, default_mosaic_config, fit_mosaic_config,
                                 mosaic_scope_planes, mosaic_smem_bytes)
from test_int4_matmul_mosaic import BF16, F16, _abstract_weight, _h200
from test_int4_matmul_triton import _check, _weight, _x

pytestmark = pytest.mark.timeout(300, method="thread")


# (m, k, n, group_size, sym, act_order, dtype, bias, config): the widest wgmma N this kernel
# takes (128), an odd M, the SMEM output tile, a K split, per-channel scales, and stream-K.
CASES = [
    (127, 512, 128, 128, False, True, BF16, True, None),
    (128, 256, 70, 64, True, False, F16, False,
     MosaicConfig(block_n=64, block_k=128, num_stages=2)),                # output tile in SMEM
    (100, 1024, 64, -1, False, False, BF16, True,
     MosaicConfig(block_n=64, block_k=256, num_stages=2, split_k=2, out_registers=True)),
    (72, 512, 192, 32, False, False, BF16, False,
     MosaicConfig(block_n=64, block_k=128, num_stages=3, stream_ctas=4, out_registers=True)),
    # x's own ring: 512-row steps at 100 rows, g128 (one plane a scope); per-channel with a K
    # split (a step's four planes in one scope: eight slots).
    (100, 2048, 128, 128, False, True, BF16, True,
     MosaicConfig(block_n=64, block_k=512, num_stages=2, x_slots=4, out_registers=True)),
    (8, 1536, 64, -1, False, False, F16, False,
     MosaicConfig(block_n=64, block_k=128, num_stages=2, x_slots=8, split_k=3)),
]


@pytest.mark.parametrize("m,k,n,group_size,sym,act_order,dtype,bias,config", CASES,
                         ids=["m127_default", "m128_smem_tile", "m100_split_per_channel",
                              "m72_stream", "m100_x_ring", "m8_x_ring_split_per_channel"])
def test_matches_reference(m, k, n, group_size, sym, act_order, dtype, bias, config):
  qw = _weight(k, n, group_size=group_size, sym=sym, act_order=act_order, seed=m)
  x = _x(m, k, dtype, seed=m + 1)
  b = _x(1, n, dtype, seed=7)[0] if bias else None
  y = quant.int4_matmul(x, qw, bias=b, implementation="mosaic", config=config, interpret=True)
  _check(y, x, qw, b)


@pytest.mark.parametrize("m", [65, 100, 128])
@pytest.mark.parametrize("k,n", [(28672, 8192), (8192, 8192), (4096, 11008)])
def test_default_config_above_64_rows(m, k, n):
  """Two warpgroups share x's 256-row steps over two stages, the partials stored from registers;
  the K split keeps the CTAs within one wave (one or two CTAs per SM)."""
  cfg = default_mosaic_config(m=m, k=k, n=n, group_size=128)
  assert (cfg.block_n, cfg.block_k, cfg.num_stages, cfg.out_registers) == (128, 256, 2, True)
  assert mosaic_smem_bytes(cfg, m=m, asym=True) <= SMEM_BYTES
  per_sm = 2 if 2 * mosaic_smem_bytes(cfg, m=m, asym=True) <= 228 * 1024 else 1
  assert -(-n // 128) * cfg.split_k <= per_sm * 132


def test_512_row_steps_fit_72_rows_not_128():
  """x's planes of a 512-row step are 128 KB at 128 rows, too much for two stages of the step
  ring: no config from the earlier heuristic (``one_call=False``: a prepared weight of that
  layout then ran 64-row chunks); 65..72 rows still fit. x's own ring (four 32 KB slots) fits
  and serves 128 rows when asked for, but it measured slower on the H200 than the 64-row
  chunks, so the heuristic does not pick it."""
  with pytest.raises(NotImplementedError, match="shared memory"):
    default_mosaic_config(m=128, k=8192, n=28672, group_size=128, one_call=False)
  # The default (one_call) splits each step in two parts instead, with the one accumulator.
  one = default_mosaic_config(m=128, k=8192, n=28672, group_size=128)
  assert (one.step_parts, one.scaled_acc) == (2, True)
  assert mosaic_smem_bytes(one, m=128, asym=True) <= SMEM_BYTES
  cfg = default_mosaic_config(m=65, k=8192, n=28672, group_size=128)
  assert cfg.block_k == 512 and cfg.x_slots == 0 and cfg.stream_ctas > 0
  assert mosaic_smem_bytes(cfg, m=65, asym=True) <= SMEM_BYTES
  ring = MosaicConfig(block_n=128, block_k=512, num_stages=2, out_registers=True, x_slots=4)
  ring = fit_mosaic_config(ring, m=128, k=8192, group_size=128, n=28672)
  assert mosaic_smem_bytes(ring, m=128, asym=True) == (
      2 * (128 * 128 * 2 + 4 * 128 * 6) + 4 * 128 * 128 * 2 + 1024)
  with pytest.raises(NotImplementedError, match="twice the 4 planes"):   # per-channel: 8 slots
    fit_mosaic_config(ring, m=128, k=8192, group_size=8192, n=28672)


@pytest.mark.parametrize("block_k,group_size,m,planes", [(512, 128, 128, 1), (256, 128, 40, 2),
                                                         (256, 128, 16, 4), (512, 4096, 16, 4),
                                                         (128, 32, 100, 1)])
def test_scope_planes(block_k, group_size, m, planes):
  """The planes one wgmma scope reads: a step's groups share a scope while their float32
  accumulators fit 64 columns (x's own ring needs twice as many slots)."""
  cfg = MosaicConfig(block_k=block_k, num_stages=2)
  assert mosaic_scope_planes(cfg, m=m, k=4096, group_size=group_size) == planes
  ok = dataclasses.replace(cfg, x_slots=max(2, 2 * planes), block_n=64)
  check_mosaic_shape(ok, m=m, k=4096, group_size=group_size)
  if planes > 1:
    with pytest.raises(NotImplementedError, match="x_slots"):
      check_mosaic_shape(dataclasses.replace(ok, x_slots=2 * planes - 1), m=m, k=4096,
                         group_size=group_size)


def test_x_slots_validation():
  for bad in (1, 17, True, -2, 2.0):
    with pytest.raises(ValueError, match="x_slots"):
      MosaicConfig(x_slots=bad)
  # stream-K's automatic scopes hold one group (the grid's up to 64 float32 columns)
  stream = MosaicConfig(block_k=256, num_stages=2, stream_ctas=132)
  assert mosaic_scope_planes(stream, m=16, k=4096, group_size=128) == 2
  assert mosaic_scope_planes(dataclasses.replace(stream, stream_ctas=0), m=16, k=4096,
                             group_size=128) == 4


@pytest.mark.parametrize("stream_ctas", [0, 5])
def test_x_ring_is_bitwise_the_step_ring(stream_ctas):
  """Same planes, same wgmmas, same order of additions: x's own ring (grid: five slots, so a
  plane's slot wraps around the ring at another place in each step; stream-K: four slots, 12
  units of 3 tiles on 5 CTAs, so the planes follow the units across tile boundaries) gives the
  step ring's bits."""
  n, slots = (64, 5) if not stream_ctas else (192, 4)
  qw = _weight(1024, n, group_size=128, sym=True, act_order=False, seed=3)
  x = _x(40, 1024, BF16, seed=4)
  cfg = MosaicConfig(block_n=64, block_k=256, num_stages=2, stream_ctas=stream_ctas)
  outs = [quant.int4_matmul(x, qw, implementation="mosaic", interpret=True,
                            config=dataclasses.replace(cfg, x_slots=s)) for s in (0, slots)]
  assert (jnp.asarray(outs[0], jnp.float32) == jnp.asarray(outs[1], jnp.float32)).all()
  _check(outs[1], x, qw, None)


def test_four_warpgroups_are_refused_above_64_rows():
  """m_pad / 2 registers a thread for the group accumulator and as many for the total: four
  warpgroups (512 threads, at most 128 registers each) cannot hold them at 65..128 rows."""
  cfg = MosaicConfig(block_n=256, block_k=256, num_stages=2, out_registers=True)
  with pytest.raises(NotImplementedError, match="register"):
    check_mosaic_shape(cfg, m=100, k=4096, group_size=128)
  assert fit_mosaic_config(cfg, m=100, k=4096, group_size=128).block_n == 128
  assert fit_mosaic_config(cfg, m=64, k=4096, group_size=128).block_n == 256   # unchanged
  with pytest.raises(NotImplementedError, match="M <= 128"):
    check_mosaic_shape(cfg, m=MOSAIC_MAX_M + 1, k=4096, group_size=128)


@pytest.mark.parametrize("k,n,block_k,group_size,m,rows", [
    (28672, 8192, 256, 128, 64, 64), (28672, 8192, 256, 128, 128, 128),
    (28672, 8192, 256, 128, 200, 200), (28672, 8192, 256, 128, 300, 150),
    (28672, 8192, 256, 128, 1000, 250), (8192, 28672, 512, 128, 72, 72),
    (8192, 28672, 512, 128, 128, 128), (8192, 28672, 512, 128, 200, 200),
    (8192, 28672, 512, 128, 20, 20), (8192, 28672, 512, -1, 128, 64),
    (8192, 28672, 512, -1, 200, 50),
])
def test_chunk_rows(k, n, block_k, group_size, m, rows):
  """Equal chunks of at most 256 rows with group-wise scales (the default's one call: parts
  of steps, the one accumulator), of at most 64 with per-channel scales on 512-row steps (a
  step's four planes in one scope, eight x slots; the earlier heuristic there)."""
  qw = _abstract_weight(k, n, group_size=group_size, sym=False, act_order=False)
  mw = jax.eval_shape(lambda qw: layout.prepare_mosaic(qw, block_k=block_k), qw)
  assert w4_mosaic.chunk_rows(m, mw) == rows
  assert rows <= (MOSAIC_SCALED_MAX_M if rows > MOSAIC_WIDE_M else MOSAIC_WIDE_M)
  # An explicit config decides as well (fitted first: here its block_n drops to 64, as the
  # 128-feature CTA with an SMEM output tile does not fit 128 rows).
  if block_k == 256 and m == 128:
    assert w4_mosaic.chunk_rows(m, mw, MosaicConfig(block_k=256, num_stages=2)) == 128


@pytest.mark.parametrize("m,k,n,block_k", [(128, 4096, 1024, 256), (100, 28672, 8192, 256),
                                           (256, 4096, 1024, 256), (128, 8192, 28672, 512)])
def test_lowers_for_h200(m, k, n, block_k):
  """The compiled form lowers to one Mosaic GPU kernel (one per chunk where the call is chunked),
  and its output at 65..128 rows is the [parts, Np, m_pad] float32 partials of one call."""
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  qw = _abstract_weight(k, n, group_size=128, sym=False, act_order=False)
  mw = jax.eval_shape(lambda qw: layout.prepare_mosaic(qw, block_k=block_k), qw)
  x = jax.ShapeDtypeStruct((m, k), BF16)
  f = lambda x, mw: w4_mosaic.int4_matmul(x, mw, interpret=False)
  with _h200():
    text = jax.jit(f).trace(x, mw).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text
  rows = w4_mosaic.chunk_rows(m, mw)
  if rows < m:                                     # unrolled chunks: one launch each, no loop
    assert "stablehlo.while" not in text
    return
  cfg = default_mosaic_config(m=m, k=k, n=n, group_size=128, block_k=block_k)
  # the kernel's float32 partials: one per K split, or per stream-K part slot
  parts = cfg.split_k if not cfg.stream_ctas else "[0-9]+"
  assert re.search(f"tensor<{parts}x{n}x{-(-m // 8) * 8}xf32>", text)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [100, 128])
def test_compiled_x_ring(m):
  """512-row steps at 100 / 128 rows: x's own ring (opt-in), bitwise the step ring
  where that fits (100 rows with one warpgroup; grid and stream-K), and correct by the ratio
  rule."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  qw = _weight(2048, 512, group_size=128, sym=False, act_order=False)
  x = _x(m, 2048, BF16, seed=m)
  mw = layout.prepare_mosaic(qw, block_k=512)
  cfg = MosaicConfig(block_n=64, block_k=512, num_stages=2, out_registers=True, x_slots=4)
  ring = dataclasses.replace(cfg, block_n=128)
  assert w4_mosaic.chunk_rows(m, mw, ring) == m   # one call (the default: 64-row chunks)
  _check(w4_mosaic.int4_matmul(x, mw, interpret=False, config=ring), x, qw, None)
  if m == 100:
    for stream_ctas in (0, 7):                     # grid; stream-K (8 tiles x 4 steps on 7)
      outs = [w4_mosaic.int4_matmul(x, mw, interpret=False, config=dataclasses.replace(
          cfg, x_slots=s, stream_ctas=stream_ctas)) for s in (0, 4)]
      assert (jnp.asarray(outs[0], jnp.float32) == jnp.asarray(outs[1], jnp.float32)).all()


@pytest.mark.parametrize("m,split_k", [(72, 2), (16, 1)])
def test_direct_x_is_bitwise_equal(m, split_k):
  """``MosaicConfig.direct_x`` (x read as [M, K] by the TMA; the partials as usual, here from
  registers) moves x's plane transpose into the TMA unit, not the arithmetic; it needs no SMEM
  of its own (``direct_io`` counts an output tile)."""
  qw = _weight(1024, 64, group_size=128, sym=False, act_order=False, seed=3)
  x = _x(m, 1024, BF16, seed=m)
  cfg = MosaicConfig(block_n=64, block_k=256, num_stages=2, split_k=split_k, out_registers=True)
  outs = [w4_mosaic.int4_matmul(x, qw, interpret=True, config=dataclasses.replace(
      cfg, direct_x=d)) for d in (False, True)]
  assert (jnp.asarray(outs[0], jnp.float32) == jnp.asarray(outs[1], jnp.float32)).all()
  _check(outs[1], x, qw, None)
  on = dataclasses.replace(cfg, direct_x=True)
  assert mosaic_smem_bytes(on, m=m, asym=True) == mosaic_smem_bytes(cfg, m=m, asym=True)
  assert mosaic_smem_bytes(dataclasses.replace(cfg, direct_io=True), m=m, asym=True) > (
      mosaic_smem_bytes(cfg, m=m, asym=True))


def test_direct_x_lowering_at_128_rows():
  """Compiled form at 128 x 28672 x 8192 (the heuristic's K split of 2): no XLA transpose of x
  before the kernel, the float32 partials [2, N, 128] after it, 128-feature CTAs kept."""
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  k, n, m = 28672, 8192, 128
  qw = _abstract_weight(k, n, group_size=128, sym=False, act_order=False)
  mw = jax.eval_shape(layout.prepare_mosaic, qw)
  cfg = dataclasses.replace(default_mosaic_config(m=m, k=k, n=n, group_size=128,
                                                  block_k=mw.block_k), direct_x=True)
  assert fit_mosaic_config(cfg, m=m, k=k, group_size=128, n=n) == cfg
  f = lambda x, mw: w4_mosaic.int4_matmul(x, mw, config=cfg, interpret=False)
  with _h200():
    hlo = jax.jit(f).trace(jax.ShapeDtypeStruct((m, k), BF16), mw).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "transpose" not in hlo.split("mosaic_gpu")[0]
  assert re.search(f"tensor<{cfg.split_k}x{n}x{m}xf32>", hlo)


@pytest.mark.gpu
def test_compiled_direct_x():
  """Compiled at 128 rows (two warpgroups, a K split of 2): bitwise the plane-transposed x."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  qw = _weight(4096, 1024, group_size=128, sym=False, act_order=False)
  x = _x(128, 4096, BF16, seed=5)
  mw = layout.prepare_mosaic(qw)
  cfg = MosaicConfig(block_n=128, block_k=mw.block_k, num_stages=2, split_k=2,
                     out_registers=True)
  outs = [w4_mosaic.int4_matmul(x, mw, interpret=False, config=dataclasses.replace(
      cfg, direct_x=d)) for d in (False, True)]
  assert (jnp.asarray(outs[0], jnp.float32) == jnp.asarray(outs[1], jnp.float32)).all()
  _check(outs[1], x, qw, None)

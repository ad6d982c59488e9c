"""Mosaic GPU W4A16 kernel at 65..128 rows of x (one call; ``MOSAIC_WIDE_M < M <= MOSAIC_MAX_M``)
and the chunking of larger calls on a prepared weight. Interpret-mode correctness (one warpgroup:
see ``test_int4_matmul_mosaic.py`` on multi-warpgroup interpret runs), the config rules (two
warpgroups at most, two stages, no SMEM output tile; 512-row steps do not fit), the chunk sizes,
lowering for sm90 on a CPU host, and compiled runs (GPU only). Same numerical rule as
``test_int4_matmul_mosaic.py``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import quant
from quant.matmul import layout
from quant.matmul import mosaic as w4_mosaic
from quant.matmul.config import (MOSAIC_MAX_M, MOSAIC_WIDE_M, SMEM_BYTES, MosaicConfig,
                                 check_mosaic_shape, default_mosaic_config, fit_mosaic_config,
                                 mosaic_smem_bytes)
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
]


@pytest.mark.parametrize("m,k,n,group_size,sym,act_order,dtype,bias,config", CASES,
                         ids=["m127_default", "m128_smem_tile", "m100_split_per_channel",
                              "m72_stream"])
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


def test_512_row_steps_do_not_fit_128_rows():
  """x's planes of a 512-row step are 128 KB at 128 rows: the heuristic declines (a prepared
  weight of that layout then runs in chunks of at most 64 rows), though 65..72 rows still fit."""
  with pytest.raises(NotImplementedError, match="shared memory"):
    default_mosaic_config(m=128, k=8192, n=28672, group_size=128)
  cfg = default_mosaic_config(m=65, k=8192, n=28672, group_size=128)
  assert cfg.block_k == 512 and mosaic_smem_bytes(cfg, m=65, asym=True) <= SMEM_BYTES


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


@pytest.mark.parametrize("k,n,block_k,m,rows", [
    (28672, 8192, 256, 64, 64), (28672, 8192, 256, 128, 128), (28672, 8192, 256, 200, 100),
    (28672, 8192, 256, 300, 100), (28672, 8192, 256, 1000, 125),
    (8192, 28672, 512, 72, 72), (8192, 28672, 512, 128, 64), (8192, 28672, 512, 200, 50),
    (8192, 28672, 512, 256, 64), (8192, 28672, 512, 20, 20),
])
def test_chunk_rows(k, n, block_k, m, rows):
  """Equal chunks of at most 128 rows where the weight's step fits them, else of at most 64."""
  qw = _abstract_weight(k, n, group_size=128, sym=False, act_order=False)
  mw = jax.eval_shape(lambda qw: layout.prepare_mosaic(qw, block_k=block_k), qw)
  assert w4_mosaic.chunk_rows(m, mw) == rows
  assert rows <= (MOSAIC_MAX_M if rows > MOSAIC_WIDE_M else MOSAIC_WIDE_M)
  # An explicit config decides as well (fitted first: here its block_n drops to 64, as the
  # 128-feature CTA with an SMEM output tile does not fit 128 rows).
  if block_k == 256 and m == 128:
    assert w4_mosaic.chunk_rows(m, mw, MosaicConfig(block_k=256, num_stages=2)) == 128


@pytest.mark.parametrize("m,k,n,block_k", [(128, 4096, 1024, 256), (100, 28672, 8192, 256),
                                           (256, 4096, 1024, 256), (128, 8192, 28672, 512)])
def test_lowers_for_h200(m, k, n, block_k):
  """The compiled form lowers to one Mosaic GPU kernel (in a loop where the call is chunked),
  and its output at 65..128 rows is the [split, Np, m_pad] float32 partials of one call."""
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
  chunked = rows < m
  assert ("while" in text) == chunked
  if not chunked:
    cfg = default_mosaic_config(m=m, k=k, n=n, group_size=128, block_k=block_k)
    assert f"tensor<{cfg.split_k}x{n}x{-(-m // 8) * 8}xf32>" in text


@pytest.mark.gpu
@pytest.mark.parametrize("m", [65, 100, 127, 128, 256])
@pytest.mark.parametrize("group_size,sym,act_order", [(128, False, True), (64, True, False),
                                                      (-1, False, False)])
def test_compiled_on_gpu(m, group_size, sym, act_order):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  qw = _weight(1032 if group_size == -1 else 1024, 1031, group_size=group_size, sym=sym,
               act_order=act_order)
  x = _x(m, qw.shape[0], BF16, seed=m)
  b = _x(1, qw.shape[1], BF16, seed=1)[0]
  mw = layout.prepare_mosaic(qw)
  _check(w4_mosaic.int4_matmul(x, mw, bias=b, interpret=False), x, qw, b)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [100, 128])
def test_compiled_512_row_steps_run_in_64_row_chunks(m):
  """A weight prepared with 512-row steps cannot take 128 rows at once: chunks of <= 64."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  qw = _weight(2048, 512, group_size=128, sym=False, act_order=False)
  x = _x(m, 2048, BF16, seed=m)
  mw = layout.prepare_mosaic(qw, block_k=512)
  assert w4_mosaic.chunk_rows(m, mw) <= MOSAIC_WIDE_M
  _check(w4_mosaic.int4_matmul(x, mw, interpret=False), x, qw, None)

"""Mosaic GPU W4A16 kernel with one accumulator (``MosaicConfig.scaled_acc``): the running total
lives in the wgmma accumulator in units of the current group's scale, rescaled by
``s_{g-1} / s_g`` before each group, which frees the registers of a separate total and lets one
call take 129..256 rows (with ``step_parts`` so that two stages of x fit the SMEM).
Interpret-mode correctness for every group path (short groups, groups longer than a part,
long groups, per-channel, a group whose scale is 0), 256 rows in one call, the config rules
and chunk sizes, lowering for sm90 on a CPU host, and compiled runs (GPU only). Same numerical
rule as ``test_int4_matmul_mosaic.py``.
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
from quant.matmul.config import (MOSAIC_SCALED_MAX_M, SMEM_BYTES, MosaicConfig,
                                 check_mosaic_shape, default_mosaic_config,
                                 mosaic_smem_bytes)
from test_int4_matmul_mosaic import BF16, F16, _abstract_weight, _h200
from test_int4_matmul_triton import _check, _weight, _x

pytestmark = pytest.mark.timeout(300, method="thread")


# (m, k, n, group_size, sym, act_order, dtype, bias, config): g128 on 256-row steps (two groups a
# step), groups of 256 on quarter steps of 512 (longer than a part, shorter than a step: only
# this form serves them), long groups, per-channel with a K split, and 200 rows in one call.
CASES = [
    (40, 1024, 64, 128, False, True, BF16, True,
     MosaicConfig(block_n=64, block_k=256, num_stages=2, scaled_acc=True)),
    (24, 2048, 64, 256, True, False, F16, False,
     MosaicConfig(block_n=64, block_k=512, num_stages=2, step_parts=4, scaled_acc=True)),
    (8, 2048, 64, 1024, False, False, BF16, False,
     MosaicConfig(block_n=64, block_k=256, num_stages=3, step_parts=2, scaled_acc=True)),
    (100, 1024, 64, -1, False, False, BF16, True,
     MosaicConfig(block_n=64, block_k=256, num_stages=2, split_k=2, out_registers=True,
                  scaled_acc=True)),
    (200, 1024, 64, 128, False, False, BF16, True,
     MosaicConfig(block_n=64, block_k=512, num_stages=2, step_parts=4, out_registers=True,
                  scaled_acc=True)),
    (40, 2048, 256, 128, False, False, BF16, False,                # four warpgroups, half steps
     MosaicConfig(block_n=256, block_k=512, num_stages=2, split_k=2, step_parts=2,
                  out_registers=True, scaled_acc=True)),
    (200, 2048, 192, 128, False, False, BF16, True,                # stream-K: 12 units on 5 CTAs
     MosaicConfig(block_n=64, block_k=512, num_stages=2, stream_ctas=5, step_parts=4,
                  out_registers=True, scaled_acc=True, carry_codes=True)),
]


@pytest.mark.parametrize("m,k,n,group_size,sym,act_order,dtype,bias,config", CASES,
                         ids=["g128", "g256_quarters", "long_groups", "per_channel_split",
                              "m200_one_call", "wg4_half_steps", "m200_stream_carry"])
def test_matches_reference(m, k, n, group_size, sym, act_order, dtype, bias, config):
  qw = _weight(k, n, group_size=group_size, sym=sym, act_order=act_order, seed=m)
  x = _x(m, k, dtype, seed=m + 1)
  b = _x(1, n, dtype, seed=7)[0] if bias else None
  if m > 128:
    assert w4_mosaic.chunk_rows(m, layout.prepare_mosaic(qw, block_k=config.block_k),
                                config) == m
  _check(w4_mosaic.int4_matmul(x, qw, bias=b, interpret=True, config=config), x, qw, b)


def test_zero_scale_group_adds_nothing():
  """A group whose scale is 0 (never made by our quantizers; possible in a checkpoint): the
  unit stays the previous group's, and ``prepare_mosaic`` stores q = z there, so the group
  adds exactly 0 and the groups after it are scaled right."""
  qw = _weight(1024, 64, group_size=128, sym=False, act_order=False, seed=5)
  scales = qw.scales.at[2, :].set(0).at[0, :5].set(0)      # a whole group row, part of another
  qw = dataclasses.replace(qw, scales=scales)
  mw = layout.prepare_mosaic(qw, block_k=256)
  codes = np.asarray(layout.dense_transposed(mw.qweight, mw.scales, mw.zeros, block_k=256,
                                             group_size=128, bits=4))
  assert (codes[:, 256:384] == 0).all()                    # dequantized: still 0
  x = _x(16, 1024, BF16, seed=6)
  cfg = MosaicConfig(block_n=64, block_k=256, num_stages=2, scaled_acc=True)
  y = w4_mosaic.int4_matmul(x, mw, interpret=True, config=cfg)
  assert bool(jnp.isfinite(jnp.asarray(y, jnp.float32)).all())
  _check(y, x, qw, None)


def test_config_rules():
  """Above 128 rows only scaled_acc serves a call (no separate total), grid or stream-K; two
  stages of 256 rows fit 128-feature CTAs with two parts of 256-row steps or four of 512-row
  steps, not with whole steps."""
  cfg = MosaicConfig(block_n=128, block_k=256, num_stages=2, out_registers=True)
  with pytest.raises(NotImplementedError, match="scaled_acc"):
    check_mosaic_shape(cfg, m=256, k=8192, group_size=128)
  scaled = dataclasses.replace(cfg, scaled_acc=True)
  with pytest.raises(NotImplementedError, match="shared memory"):
    check_mosaic_shape(scaled, m=256, k=8192, group_size=128)
  check_mosaic_shape(dataclasses.replace(scaled, step_parts=2), m=256, k=8192, group_size=128)
  quarters = dataclasses.replace(scaled, block_k=512, step_parts=4)
  assert mosaic_smem_bytes(quarters, m=256, asym=True) <= SMEM_BYTES
  check_mosaic_shape(quarters, m=256, k=8192, group_size=128)
  with pytest.raises(NotImplementedError, match="M <= 256"):
    check_mosaic_shape(quarters, m=MOSAIC_SCALED_MAX_M + 1, k=8192, group_size=128)
  check_mosaic_shape(dataclasses.replace(quarters, stream_ctas=132), m=200, k=8192,
                     group_size=128)                # stream-K takes them too
  # groups longer than a part but shorter than a step need the one accumulator
  with pytest.raises(NotImplementedError, match="scaled_acc"):
    check_mosaic_shape(dataclasses.replace(quarters, scaled_acc=False), m=16, k=8192,
                       group_size=256)
  with pytest.raises(ValueError, match="step_parts"):
    MosaicConfig(step_parts=3)


@pytest.mark.parametrize("m,rows", [(256, 256), (300, 150), (129, 129), (600, 200)])
def test_chunk_rows_with_scaled_acc(m, rows):
  qw = _abstract_weight(8192, 28672, group_size=128, sym=False, act_order=False)
  mw = jax.eval_shape(layout.prepare_mosaic, qw)
  cfg = MosaicConfig(block_n=128, block_k=512, num_stages=2, out_registers=True, step_parts=4,
                     scaled_acc=True)
  assert w4_mosaic.chunk_rows(m, mw, cfg) == rows
  # The heuristic (one call up to 256 rows since session 24); the earlier one took 64-row chunks.
  assert w4_mosaic.chunk_rows(256, mw) == 256 and w4_mosaic.chunk_rows(300, mw) == 150


@pytest.mark.parametrize("k,n,block_k,parts,split,carry,stream", [
    (8192, 28672, 512, 4, 1, False, 0), (8192, 28672, 512, 4, 1, True, 0),
    (28672, 8192, 256, 2, 2, False, 0), (8192, 28672, 512, 4, 1, True, 132)])
def test_lowers_for_h200_at_256_rows(k, n, block_k, parts, split, carry, stream):
  """256 rows in one call (wgmma N = 256): one Mosaic GPU kernel, float32 partials [split, N,
  256] (stream-K: summed by XLA after it); also with the code tile carried across the parts
  (``carry_codes``)."""
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  qw = _abstract_weight(k, n, group_size=128, sym=False, act_order=False)
  mw = jax.eval_shape(lambda qw: layout.prepare_mosaic(qw, block_k=block_k), qw)
  cfg = MosaicConfig(block_n=128, block_k=block_k, num_stages=2, split_k=split,
                     out_registers=True, step_parts=parts, scaled_acc=True, carry_codes=carry,
                     stream_ctas=stream)
  f = lambda x, mw: w4_mosaic.int4_matmul(x, mw, config=cfg, interpret=False)
  with _h200():
    text = jax.jit(f).trace(jax.ShapeDtypeStruct((256, k), BF16), mw).lower(
        lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 1
  assert f"x{n}x256xf32>" in text if stream else f"tensor<{split}x{n}x256xf32>" in text


@pytest.mark.gpu
def test_compiled_scaled_acc():
  """Compiled: 40 and 128 rows (by the ratio rule), 256 rows in one call on both layouts, f16
  at 200 rows, and 256 rows in one stream-K call with the code tile carried."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  qw = _weight(4096, 1024, group_size=128, sym=False, act_order=False)
  for block_k, parts in ((256, 2), (512, 4)):
    mw = layout.prepare_mosaic(qw, block_k=block_k)
    cfg = MosaicConfig(block_n=128, block_k=block_k, num_stages=2, split_k=2,
                       out_registers=True, scaled_acc=True)
    for m in (40, 128):
      x = _x(m, 4096, BF16, seed=m)
      _check(w4_mosaic.int4_matmul(x, mw, interpret=False, config=cfg), x, qw, None)
    wide = dataclasses.replace(cfg, step_parts=parts)
    for m, dtype in ((256, BF16), (200, F16)):
      x = _x(m, 4096, dtype, seed=m)
      assert w4_mosaic.chunk_rows(m, mw, wide) == m
      _check(w4_mosaic.int4_matmul(x, mw, interpret=False, config=wide), x, qw, None)
  stream = MosaicConfig(block_n=128, block_k=512, num_stages=2, out_registers=True,
                        step_parts=4, scaled_acc=True, carry_codes=True, stream_ctas=7)
  x = _x(256, 4096, BF16, seed=2)                   # 8 tiles x 8 steps on 7 CTAs
  mw = layout.prepare_mosaic(qw, block_k=512)
  _check(w4_mosaic.int4_matmul(x, mw, interpret=False, config=stream), x, qw, None)
  y = quant.int4_matmul(_x(256, 4096, BF16, seed=1), layout.prepare_mosaic(qw), config=None)
  _check(y, _x(256, 4096, BF16, seed=1), qw, None)


@pytest.mark.parametrize("m,k,n,block_k,parts,scaled,split", [
    (128, 8192, 28672, 512, 2, True, 1), (96, 8192, 28672, 512, 2, True, 1),
    (256, 8192, 28672, 512, 4, True, 1), (256, 28672, 8192, 256, 2, True, 2),
    (200, 8192, 8192, 256, 2, True, 2), (128, 28672, 8192, 256, 1, False, 2)])
def test_one_call_config(m, k, n, block_k, parts, scaled, split):
  """``default_mosaic_config`` (``one_call``, the default): the fewest step parts whose two
  stages fit 128-feature CTAs, the one accumulator where a step is split or above 128 rows,
  the codes carried across the parts above 128 rows, a grid (no stream-K) with the wave
  rule's K split. ``one_call=False`` is the earlier heuristic (NotImplementedError above 128
  rows, and on 512-row steps above 72 rows)."""
  cfg = default_mosaic_config(m=m, k=k, n=n, group_size=128, block_k=block_k)
  assert cfg == default_mosaic_config(m=m, k=k, n=n, group_size=128, block_k=block_k,
                                      one_call=True)
  assert (cfg.block_n, cfg.num_stages, cfg.out_registers, cfg.stream_ctas) == (128, 2, True, 0)
  assert (cfg.step_parts, cfg.scaled_acc, cfg.split_k) == (parts, scaled, split)
  assert cfg.carry_codes == (m > 128 and parts > 1)
  check_mosaic_shape(cfg, m=m, k=k, group_size=128)
  old = lambda: default_mosaic_config(m=m, k=k, n=n, group_size=128, block_k=block_k,
                                      one_call=False)
  if parts > 1 or scaled:
    with pytest.raises(NotImplementedError):
      old()
  else:
    assert old() == cfg


def test_one_call_config_runs():
  """The heuristic's one-call config at 150 rows (interpret mode, one warpgroup)."""
  qw = _weight(1024, 64, group_size=128, sym=False, act_order=False, seed=9)
  x = _x(150, 1024, BF16, seed=10)
  mw = layout.prepare_mosaic(qw, block_k=512)
  cfg = dataclasses.replace(default_mosaic_config(m=150, k=1024, n=64, group_size=128,
                                                  block_k=512, one_call=True), block_n=64)
  assert cfg.scaled_acc and cfg.step_parts == 2      # (x: 76 KB a half step at 152 rows)
  _check(w4_mosaic.int4_matmul(x, mw, interpret=True, config=cfg), x, qw, None)

"""Mosaic GPU W4A16 kernel with half steps (``MosaicConfig.step_parts = 2``): the ring walks
``block_k / 2`` K rows a step, each slot holding half a layout step's x planes and scales and
the whole code tile, of which a step dequantizes the nibbles of its half. Interpret-mode
correctness (bitwise the whole-step kernel where groups are no longer than half a step: the
same planes, wgmmas and order of additions), every group path (groups of half a step, long
groups, per-channel), the config rules, lowering for sm90 on a CPU host, and compiled runs
(GPU only). Same numerical rule as ``test_int4_matmul_mosaic.py``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from quant.matmul import layout
from quant.matmul import mosaic as w4_mosaic
from quant.matmul.config import (SMEM_BYTES, MosaicConfig, check_mosaic_shape,
                                 default_mosaic_config, mosaic_smem_bytes)
from test_int4_matmul_mosaic import BF16, F16, _abstract_weight, _h200
from test_int4_matmul_triton import _check, _weight, _x

pytestmark = pytest.mark.timeout(300, method="thread")


def _same_bits(a, b) -> bool:
  return bool((jnp.asarray(a, jnp.float32) == jnp.asarray(b, jnp.float32)).all())


@pytest.mark.parametrize("m,direct_x", [(40, False), (16, True)])
def test_bitwise_the_whole_steps_with_short_groups(m, direct_x):
  """g128 on 512-row steps (four groups a step, two a half): the half steps issue the same
  wgmmas on the same planes and add the scaled group partials to the total in the same order."""
  qw = _weight(2048, 64, group_size=128, sym=False, act_order=False, seed=3)
  x = _x(m, 2048, BF16, seed=m)
  cfg = MosaicConfig(block_n=64, block_k=512, num_stages=2, split_k=2, out_registers=True,
                     direct_x=direct_x)
  outs = [w4_mosaic.int4_matmul(x, qw, interpret=True, config=dataclasses.replace(
      cfg, step_parts=h)) for h in (1, 2)]
  assert _same_bits(outs[0], outs[1])
  _check(outs[1], x, qw, None)


# (m, k, n, group_size, sym, act_order, dtype, bias, config): groups of exactly half a step (the
# short path, one group a ring step), long groups (two half steps a layout step, four a group),
# per-channel scales with a K split, and late_zero (x's sums per half step).
CASES = [
    (24, 1024, 64, 256, False, True, BF16, True, MosaicConfig(block_n=64, block_k=512,
                                                               num_stages=2)),
    (8, 2048, 64, 1024, True, False, F16, False, MosaicConfig(block_n=64, block_k=512,
                                                               num_stages=3)),
    (100, 1024, 64, -1, False, False, BF16, True, MosaicConfig(
        block_n=64, block_k=256, num_stages=2, split_k=2, out_registers=True)),
    (12, 1024, 64, 128, False, False, BF16, False, MosaicConfig(block_n=64, block_k=512,
                                                                 num_stages=2, late_zero=True)),
]


@pytest.mark.parametrize("m,k,n,group_size,sym,act_order,dtype,bias,config", CASES,
                         ids=["g256_short", "g1024_long", "per_channel_split", "late_zero"])
def test_matches_reference(m, k, n, group_size, sym, act_order, dtype, bias, config):
  qw = _weight(k, n, group_size=group_size, sym=sym, act_order=act_order, seed=m)
  x = _x(m, k, dtype, seed=m + 1)
  b = _x(1, n, dtype, seed=7)[0] if bias else None
  cfg = dataclasses.replace(config, step_parts=2)
  _check(w4_mosaic.int4_matmul(x, qw, bias=b, interpret=True, config=cfg), x, qw, b)


def test_config_rules():
  """At 128 rows on the 512-row layout two stages of whole steps overflow the SMEM (128 KB of x
  a slot); half steps fit them with 128-feature CTAs, in the grid or stream-K. x's own ring
  refuses them."""
  whole = MosaicConfig(block_n=128, block_k=512, num_stages=2, out_registers=True)
  half = dataclasses.replace(whole, step_parts=2)
  assert mosaic_smem_bytes(whole, m=128, asym=True) > SMEM_BYTES
  assert mosaic_smem_bytes(half, m=128, asym=True) <= SMEM_BYTES
  check_mosaic_shape(half, m=128, k=8192, group_size=128)
  check_mosaic_shape(dataclasses.replace(half, stream_ctas=132), m=128, k=8192, group_size=128)
  with pytest.raises(NotImplementedError, match="step_parts"):
    check_mosaic_shape(dataclasses.replace(half, x_slots=4), m=128, k=8192, group_size=128)
  # The earlier heuristic had no config here; the default (one call, session 24) takes half
  # steps with the one accumulator.
  with pytest.raises(NotImplementedError, match="shared memory"):
    default_mosaic_config(m=128, k=8192, n=28672, group_size=128, one_call=False)
  cfg = default_mosaic_config(m=128, k=8192, n=28672, group_size=128)
  assert (cfg.step_parts, cfg.scaled_acc, cfg.carry_codes) == (2, True, False)


def test_lowers_for_h200_at_128_rows():
  """128 x 8192 x 28672 on the 512-row layout in one call (128-feature CTAs, two stages)."""
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  k, n, m = 8192, 28672, 128
  qw = _abstract_weight(k, n, group_size=128, sym=False, act_order=False)
  mw = jax.eval_shape(layout.prepare_mosaic, qw)
  assert mw.block_k == 512
  cfg = MosaicConfig(block_n=128, block_k=512, num_stages=2, out_registers=True,
                     step_parts=2)
  assert w4_mosaic.chunk_rows(m, mw, cfg) == m
  f = lambda x, mw: w4_mosaic.int4_matmul(x, mw, config=cfg, interpret=False)
  with _h200():
    text = jax.jit(f).trace(jax.ShapeDtypeStruct((m, k), BF16), mw).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and f"tensor<1x{n}x{m}xf32>" in text


@pytest.mark.gpu
def test_compiled_step_parts():
  """Compiled: bitwise the whole steps at 40 rows (g128, one and two warpgroups; codes copied
  every part or carried from the first), and 128 rows
  on the 512-row layout in one call by the ratio rule."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  qw = _weight(4096, 1024, group_size=128, sym=False, act_order=False)
  mw = layout.prepare_mosaic(qw, block_k=512)
  x = _x(40, 4096, BF16, seed=5)
  for bn in (64, 128):
    cfg = MosaicConfig(block_n=bn, block_k=512, num_stages=2, split_k=2, out_registers=True)
    outs = [w4_mosaic.int4_matmul(x, mw, interpret=False, config=dataclasses.replace(
        cfg, step_parts=h, carry_codes=c)) for h, c in ((1, False), (2, False), (2, True))]
    assert _same_bits(outs[0], outs[1]) and _same_bits(outs[0], outs[2])
  x = _x(128, 4096, BF16, seed=6)
  cfg = MosaicConfig(block_n=128, block_k=512, num_stages=2, split_k=2, out_registers=True,
                     step_parts=2)
  _check(w4_mosaic.int4_matmul(x, mw, interpret=False, config=cfg), x, qw, None)
  xf = _x(100, 4096, F16, seed=7)
  _check(w4_mosaic.int4_matmul(xf, mw, interpret=False, config=cfg), xf, qw, None)
  # stream-K (16 tiles x 8 steps on 11 CTAs): half steps, codes carried, bitwise whole steps
  stream = MosaicConfig(block_n=64, block_k=512, num_stages=2, stream_ctas=11,
                        out_registers=True)
  outs = [w4_mosaic.int4_matmul(x, mw, interpret=False, config=dataclasses.replace(
      stream, step_parts=h, carry_codes=c)) for h, c in ((1, False), (2, True))]
  assert _same_bits(outs[0], outs[1])


@pytest.mark.parametrize("m,group_size,parts,scaled", [(40, 128, 2, False), (24, -1, 2, False),
                                                       (136, 128, 4, True)],
                         ids=["short_groups", "per_channel", "quarters_scaled"])
def test_carried_codes_are_bitwise_the_copied_ones(m, group_size, parts, scaled):
  """``carry_codes``: the code tile crosses to SMEM at a layout step's first part only (the
  later parts arrive on their barrier in its place) and the later parts reuse its registers:
  the same codes, so the same bits, on every group path."""
  qw = _weight(2048, 64, group_size=group_size, sym=False, act_order=False, seed=m)
  x = _x(m, 2048, BF16, seed=m + 1)
  cfg = MosaicConfig(block_n=64, block_k=512, num_stages=2, split_k=2, out_registers=True,
                     step_parts=parts, scaled_acc=scaled)
  outs = [w4_mosaic.int4_matmul(x, qw, interpret=True, config=dataclasses.replace(
      cfg, carry_codes=c)) for c in (False, True)]
  assert _same_bits(outs[0], outs[1])
  _check(outs[1], x, qw, None)


def test_stream_k_parts_are_bitwise_the_whole_steps():
  """Stream-K (12 units of 3 tiles on 5 CTAs, so segments cross tile boundaries): half steps,
  with the code tile copied every part or carried from the first, give the whole-step bits."""
  qw = _weight(2048, 192, group_size=128, sym=False, act_order=False, seed=3)
  x = _x(40, 2048, BF16, seed=4)
  cfg = MosaicConfig(block_n=64, block_k=512, num_stages=2, stream_ctas=5)
  outs = [w4_mosaic.int4_matmul(x, qw, interpret=True, config=dataclasses.replace(
      cfg, step_parts=h, carry_codes=c)) for h, c in ((1, False), (2, False), (2, True))]
  assert _same_bits(outs[0], outs[1]) and _same_bits(outs[0], outs[2])
  _check(outs[2], x, qw, None)

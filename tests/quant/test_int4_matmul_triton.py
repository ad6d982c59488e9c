"""Triton W4A16 kernel: correctness in interpret mode, Config, bad inputs, lowering for an H200.

Correctness (../shared/TESTING.md, "W4A16 and quantization"): the kernel is compared with the
float32 reference ``ref_hi = x @ dequantize(qw)`` (HIGHEST precision). The output is in x's dtype,
whose rounding alone costs ~1.3e-3 (bf16) of mean relative error, so the 1e-3 bar is applied to
``mean|y - round(ref_hi)| / mean|ref_hi|`` (the kernel itself accumulates in float32 and rounds
once). The ratio rule (C = 2) compares against ``ref_lo``, the same product in the test dtype.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax._src import mesh as mesh_lib

import quant
from quant.matmul import layout
from quant.matmul import triton as w4_triton
from quant.matmul.config import Config, check_shape, default_config, fit_config

BF16, F16 = jnp.bfloat16, jnp.float16


def _weight(k, n, *, group_size, sym, act_order, seed=0):
  """Random codes (every value), scales and zeros; act-order as a random stored-row permutation."""
  rng = np.random.default_rng(seed)
  gs = k if group_size == -1 else group_size
  codes = rng.integers(0, 16, (k, n), dtype=np.int32)
  scales = rng.uniform(0.005, 0.05, (k // gs, n)).astype(ml_dtypes.bfloat16)
  zeros = None if sym else jnp.asarray(rng.integers(0, 16, (k // gs, n), dtype=np.int32))
  perm = jnp.asarray(rng.permutation(k).astype(np.int32)) if act_order else None
  return quant.QuantizedWeight.from_codes(jnp.asarray(codes), jnp.asarray(scales), zeros, bits=4,
                                          group_size=group_size, perm=perm)


def _dequantize_np(qw):
  """``dequantize(qw)`` in float64 NumPy, from the packed words (an oracle independent of jnp)."""
  k, n = qw.shape
  words = np.asarray(qw.qweight).view(np.uint32)
  codes = (words[:, None, :] >> (4 * np.arange(8, dtype=np.uint32))[None, :, None]) & 0xF
  codes = codes.reshape(k, n).astype(np.float64)
  g = np.arange(k) // qw.group_size
  s = np.asarray(qw.scales).astype(np.float64)[g]
  z = 2.0 ** (qw.bits - 1) if qw.zeros is None else np.asarray(qw.zeros).astype(np.float64)[g]
  w = (codes - z) * s
  if qw.perm is not None:
    out = np.empty_like(w)
    out[np.asarray(qw.perm)] = w
    w = out
  return w


def _check(y, x, qw, bias=None):
  """Mean relative error vs the rounded float reference < 1e-3, and the ratio rule (C = 2)."""
  dt = np.dtype(x.dtype)
  w = _dequantize_np(qw)
  x64 = np.asarray(x).astype(np.float64)
  ref_hi = x64 @ w
  # ref_lo: the same product in the test dtype (weight and output rounded to it).
  ref_lo = (x64 @ w.astype(dt).astype(np.float64)).astype(dt).astype(np.float64)
  if bias is not None:
    b = np.asarray(bias).astype(np.float64)
    ref_hi = ref_hi + b
    ref_lo = (ref_lo + b).astype(dt).astype(np.float64)
  assert y.dtype == x.dtype and y.shape == ref_hi.shape
  y64 = np.asarray(y).astype(np.float64)
  assert np.isfinite(y64).all()
  rounded = ref_hi.astype(dt).astype(np.float64)
  assert np.mean(np.abs(y64 - rounded)) / np.mean(np.abs(ref_hi)) < 1e-3
  r = ref_hi.astype(dt)
  noise = float(np.max(np.abs(((r + dt.type(0.3)) - dt.type(0.3) - r).astype(np.float64))))
  err, lo_err = np.abs(y64 - ref_hi), np.abs(ref_lo - ref_hi)
  assert err.max() <= 2 * lo_err.max() + 2 * noise
  assert err.mean() <= 1.5 * lo_err.mean() + noise


def _x(m, k, dtype, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((m, k)).astype(dtype))


# (m, k, n, group_size, sym, act_order, dtype, bias, config): every M of TESTING.md, every group
# size, K and N one word / one column off the tiles, split-K, block_k above and below the group.
CASES = [
    (1, 256, 128, 128, False, False, BF16, False, None),
    (2, 512, 384, 64, True, False, F16, True, None),
    (3, 256, 129, 32, False, True, BF16, True, None),
    (8, 264, 200, -1, False, False, BF16, False, None),            # per-channel, K = 256 + 8
    (16, 512, 255, 128, False, True, F16, False, Config(block_k=128, split_k=2)),
    (31, 256, 384, 32, True, False, BF16, True, Config(block_m=32, block_k=128)),   # 4 groups/step
    (64, 512, 128, 128, False, False, BF16, True, Config(block_m=64, block_k=64, split_k=2)),
    (127, 384, 130, 64, False, True, BF16, False, None),
    (256, 256, 256, -1, True, False, F16, True, Config(block_m=128, block_k=64)),   # 4 steps/scale
    (4, 2048, 16, 128, False, False, BF16, True, None),             # heuristic split_k = 2
    (1, 512, 257, -1, False, False, F16, True, Config(block_k=128, split_k=2)),     # per-channel split
    (3, 264, 129, -1, False, False, BF16, True, Config(unpack="strided")),          # K tail padded
    (17, 256, 200, 128, True, True, F16, False, Config(unpack="strided", split_k=2)),
]


@pytest.mark.parametrize("m,k,n,group_size,sym,act_order,dtype,bias,config", CASES,
                         ids=[f"m{c[0]}_k{c[1]}_n{c[2]}_g{c[3]}" for c in CASES])
def test_matches_reference(m, k, n, group_size, sym, act_order, dtype, bias, config):
  qw = _weight(k, n, group_size=group_size, sym=sym, act_order=act_order, seed=m)
  x = _x(m, k, dtype, seed=m + 1)
  b = _x(1, n, dtype, seed=7)[0] if bias else None
  y = quant.int4_matmul(x, qw, bias=b, implementation="triton", config=config, interpret=True)
  _check(y, x, qw, b)


def test_rtn_weights_batch_dims_jit_and_determinism():
  w = jnp.asarray(np.random.default_rng(0).standard_normal((256, 192)).astype(np.float32))
  qw = quant.rtn(w, bits=4, group_size=64, sym=False)
  x = _x(6, 256, BF16, seed=1).reshape(2, 3, 256)
  cfg = Config(block_n=64, block_k=64, split_k=2)
  f = jax.jit(lambda x, qw: quant.int4_matmul(x, qw, implementation="triton", config=cfg,
                                              interpret=True))
  y = f(x, qw)
  assert y.shape == (2, 3, 192)
  _check(y.reshape(6, 192), x.reshape(6, 256), qw)
  assert bool((f(x, qw) == y).all())          # the split-K reduction is deterministic


@pytest.mark.parametrize("sym,act_order,config", [
    (False, True, Config(block_n=64, split_k=2)),
    (True, False, Config(unpack="strided")),
])
def test_prepared_weight_matches(sym, act_order, config):
  qw = _weight(256, 96, group_size=128, sym=sym, act_order=act_order, seed=3)
  pw = layout.prepare(qw)
  assert pw.zeros is None if sym else pw.zeros.dtype == jnp.uint8
  x = _x(5, 256, BF16, seed=4)
  b = _x(1, 96, BF16, seed=5)[0]
  y = w4_triton.int4_matmul(x, pw, bias=b, config=config, interpret=True)
  _check(y, x, qw, b)


@pytest.mark.parametrize("change,x_shape,exc,match", [
    (dict(zeros="int32"), (2, 256), TypeError, "uint8"),
    (dict(qweight="uint32"), (2, 256), TypeError, "int32"),
    (dict(scales="short"), (2, 256), ValueError, "scales"),
    ({}, (2, 128), ValueError, "K=256"),
], ids=["zeros_dtype", "qweight_dtype", "scales_shape", "x_features"])
def test_prepared_weight_bad_inputs(change, x_shape, exc, match):
  pw = layout.prepare(_weight(256, 64, group_size=64, sym=False, act_order=False))
  if change.get("zeros"):
    pw = dataclasses.replace(pw, zeros=pw.zeros.astype(jnp.int32))
  if change.get("qweight"):
    pw = dataclasses.replace(pw, qweight=pw.qweight.astype(jnp.uint32))
  if change.get("scales"):
    pw = dataclasses.replace(pw, scales=pw.scales[:-1])
  with pytest.raises(exc, match=match):
    w4_triton.int4_matmul(jnp.ones(x_shape, BF16), pw, interpret=True)


def test_gradient_wrt_x_and_bias():
  qw = _weight(128, 64, group_size=64, sym=False, act_order=True, seed=9)
  x = _x(3, 128, jnp.float16, seed=10)
  b = _x(1, 64, jnp.float16, seed=11)[0]
  ct = _x(3, 64, jnp.float32, seed=12)

  def loss(x, b):
    y = quant.int4_matmul(x, qw, bias=b, implementation="triton", interpret=True)
    return jnp.sum(y.astype(jnp.float32) * ct)

  dx, db = jax.grad(loss, argnums=(0, 1))(x, b)
  ct64 = np.asarray(ct, np.float64)
  dx_ref = ct64 @ _dequantize_np(qw).T           # y = x W + b  =>  dx = ct W^T, db = sum ct
  np.testing.assert_allclose(np.asarray(dx, np.float64), dx_ref, rtol=2e-3, atol=2e-3)
  np.testing.assert_allclose(np.asarray(db, np.float64), ct64.sum(0), rtol=2e-3, atol=2e-3)


def test_three_bit_codes_use_the_same_path():
  w = jnp.asarray(np.random.default_rng(2).standard_normal((128, 64)).astype(np.float32))
  qw = quant.rtn(w, bits=3, group_size=32)
  x = _x(5, 128, BF16, seed=3)
  _check(quant.int4_matmul(x, qw, implementation="triton", interpret=True), x, qw)


def test_unpack_magic_is_exact():
  codes = jnp.arange(16 * 8 * 16, dtype=jnp.int32).reshape(128, 16) % 16
  words = quant.pack(codes, bits=4)
  for dtype, base in ((BF16, 128.0), (F16, 1024.0)):
    magic = w4_triton._MAGIC[jnp.dtype(dtype)][0]
    vals = w4_triton.unpack_magic(words, dtype=dtype, magic_bits=magic)
    np.testing.assert_array_equal(np.asarray(vals.astype(jnp.float32)) - base, np.asarray(codes))


# ----------------------------------------------------------------------------------------------
# Config and heuristic
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("block_m", 8), ("block_m", 512), ("block_n", 96),
                                         ("block_k", 48), ("split_k", 0), ("split_k", 1.5),
                                         ("num_warps", 3), ("num_stages", 0),
                                         ("unpack", "nibbles")])
def test_config_rejects_bad_values(field, value):
  with pytest.raises(ValueError, match=field):
    Config(**{field: value})


def test_config_is_frozen_and_hashable():
  with pytest.raises(dataclasses.FrozenInstanceError):
    Config().block_m = 32
  assert hash(Config()) == hash(Config())


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_default_config_is_valid_and_pure(group_size):
  for m in (1, 3, 16, 17, 64, 100, 256, 4096):
    for k, n in ((8192, 28672), (28672, 8192), (8192, 8192), (264, 200), (4096, 11008), (128, 64)):
      gs = k if group_size == -1 else group_size
      if k % gs:
        continue
      cfg = default_config(m=m, k=k, n=n, group_size=gs)
      assert cfg == default_config(m=m, k=k, n=n, group_size=gs)
      check_shape(cfg, k=k, group_size=gs)
      assert cfg.block_m == 16 if m <= 16 else cfg.block_m >= 32
      assert cfg.block_n <= max(16, 1 << (n - 1).bit_length())
      assert k // cfg.split_k >= min(k, 1024)
      if m <= 16 and (k, n) == (28672, 8192):
        assert cfg.split_k >= 4        # 64 column tiles: K is split across the SMs


def test_default_config_for_decode():
  cfg = default_config(m=1, k=8192, n=28672, group_size=128)
  assert (cfg.block_m, cfg.block_n, cfg.split_k, cfg.unpack) == (16, 128, 4, "strided")
  cfg = default_config(m=256, k=8192, n=28672, group_size=128)
  assert (cfg.block_m, cfg.num_warps, cfg.split_k, cfg.unpack) == (64, 4, 1, "interleave")


def test_fit_config_shrinks_block_k_to_the_groups():
  cfg = fit_config(Config(block_k=256), m=1, k=96, n=64, group_size=32)
  assert (cfg.block_k, cfg.block_n) == (32, 64)


@pytest.mark.parametrize("cfg,k,group_size,match", [
    (Config(split_k=3), 1024, 128, "split_k=3"),
    (Config(split_k=4), 512, 256, "whole groups"),
    (Config(unpack="strided"), 512, 64, "strided"),
])
def test_fit_config_not_implemented(cfg, k, group_size, match):
  with pytest.raises(NotImplementedError, match=match):
    fit_config(cfg, m=1, k=k, n=64, group_size=group_size)


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------

def _bad_qweight_dtype(qw):
  return dataclasses.replace(qw, qweight=qw.qweight.astype(jnp.uint32))


def _bad_scales(qw):
  return dataclasses.replace(qw, scales=qw.scales[:-1])


def _bad_k(qw):
  # A hand-built weight whose K (shape) is not a multiple of group_size: 264 % 64 != 0.
  return dataclasses.replace(qw, qweight=jnp.zeros((33, 64), jnp.int32),
                             scales=qw.scales[:4], zeros=qw.zeros[:4], shape=(264, 64))


def _eight_bit(qw):
  w = jnp.asarray(np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32))
  return quant.rtn(w, bits=8, group_size=64)


def _group_eight(qw):
  w = jnp.asarray(np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32))
  return quant.rtn(w, bits=4, group_size=8)


@pytest.mark.parametrize("make_qw,x_shape,x_dtype,kw,exc,match", [
    (_bad_qweight_dtype, (2, 256), BF16, {}, TypeError, "int32"),
    (_bad_scales, (2, 256), BF16, {}, ValueError, "scales"),
    (_bad_k, (2, 264), BF16, {}, ValueError, "divisible by group_size"),
    (None, (2, 255), BF16, {}, ValueError, "K=256"),
    (None, (2, 256), BF16, dict(bias=jnp.zeros((63,), BF16)), ValueError, "bias"),
    (None, (2, 256), jnp.int8, {}, ValueError, "bfloat16"),
    (None, (2, 256), jnp.float32, {}, NotImplementedError, "bfloat16 or float16"),
    (_eight_bit, (2, 256), BF16, {}, NotImplementedError, "bits <= 4"),
    (_group_eight, (2, 256), BF16, {}, NotImplementedError, "group_size % 16"),
    (None, (2, 256), BF16, dict(config={"block_m": 16}), NotImplementedError, "Config"),
    (None, (2, 256), BF16, dict(config=Config(split_k=3)), NotImplementedError, "split_k"),
], ids=["qweight_dtype", "scales_shape", "k_not_multiple_of_group", "x_features", "bias_shape",
        "x_dtype", "float32_x", "eight_bit", "group_8", "config_type", "bad_split"])
def test_bad_inputs(make_qw, x_shape, x_dtype, kw, exc, match):
  qw = _weight(256, 64, group_size=64, sym=False, act_order=False)
  if make_qw is not None:
    qw = make_qw(qw)
  x = jnp.ones(x_shape, x_dtype)
  with pytest.raises(exc, match=match):
    quant.int4_matmul(x, qw, implementation="triton", interpret=True, **kw)


def test_from_codes_rejects_k_not_multiple_of_group():
  with pytest.raises(ValueError, match="group_size"):
    quant.QuantizedWeight.from_codes(jnp.zeros((96, 8), jnp.int32), jnp.ones((1, 8)), None,
                                     bits=4, group_size=64)


# ----------------------------------------------------------------------------------------------
# Lowering to Triton for an H200 (no GPU needed) and compiled runs (GPU only)
# ----------------------------------------------------------------------------------------------

def _h200():
  dev = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev))


def _abstract_weight(k, n, *, group_size, sym, act_order):
  gs = k if group_size == -1 else group_size
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  return quant.QuantizedWeight(
      qweight=i32(k // 8, n), scales=jax.ShapeDtypeStruct((k // gs, n), BF16),
      zeros=None if sym else i32(k // gs, n), perm=i32(k) if act_order else None,
      bits=4, group_size=gs, sym=sym, shape=(k, n))


@pytest.mark.parametrize("m,k,n,group_size,sym,act_order,dtype,bias,config", [
    (1, 8192, 28672, 128, False, False, BF16, False, None),          # decode, split-K
    (16, 28672, 8192, 128, False, True, F16, True, None),
    (3, 264, 200, -1, False, False, BF16, True, None),               # masks on M, N and K
    (64, 4096, 1024, 32, True, False, BF16, False, Config(block_m=64, block_k=128)),
    (256, 8192, 8192, 128, False, False, BF16, True, None),
    (256, 1024, 512, 128, False, False, BF16, False, Config(block_m=128, block_k=64, split_k=2)),
    (1, 8192, 8192, 128, False, False, BF16, False, Config(unpack="strided", split_k=4)),
    (16, 1032, 200, -1, True, True, BF16, True, Config(unpack="strided")),
], ids=["decode", "decode_act_order_f16", "masked", "g32_4_per_step", "m256", "nested_split",
        "strided", "strided_masked"])
def test_lowers_to_triton_for_h200(m, k, n, group_size, sym, act_order, dtype, bias, config):
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  qw = _abstract_weight(k, n, group_size=group_size, sym=sym, act_order=act_order)
  x = jax.ShapeDtypeStruct((m, k), dtype)
  b = jax.ShapeDtypeStruct((n,), dtype) if bias else None
  f = lambda x, qw, b: w4_triton.int4_matmul(x, qw, bias=b, config=config, interpret=False)
  with _h200():
    text = jax.jit(f).trace(x, qw, b).lower(lowering_platforms=("cuda",)).as_text()
  assert "w4a16_matmul" in text


@pytest.mark.parametrize("unpack", ["interleave", "strided"])
def test_prepared_weight_lowers_for_h200(unpack):
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  k, n = 8192, 1024
  pw = layout.PackedWeight(
      qweight=jax.ShapeDtypeStruct((k // 8, n), jnp.int32),
      scales=jax.ShapeDtypeStruct((k // 128, n), BF16),
      zeros=jax.ShapeDtypeStruct((k // 128, n), jnp.uint8), perm=None, bits=4, group_size=128,
      sym=False, shape=(k, n))
  x = jax.ShapeDtypeStruct((16, k), BF16)
  cfg = Config(unpack=unpack, split_k=4)
  f = lambda x, pw: w4_triton.int4_matmul(x, pw, config=cfg, interpret=False)
  with _h200():
    text = jax.jit(f).trace(x, pw).lower(lowering_platforms=("cuda",)).as_text()
  assert "w4a16_matmul" in text


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 31, 64, 127, 256])
@pytest.mark.parametrize("group_size,sym,act_order", [(32, False, False), (64, True, False),
                                                      (128, False, True), (-1, False, False)])
def test_compiled_on_gpu(m, group_size, sym, act_order):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  qw = _weight(1032 if group_size == -1 else 1024, 1031, group_size=group_size, sym=sym,
               act_order=act_order)
  x = _x(m, qw.shape[0], BF16, seed=m)
  b = _x(1, qw.shape[1], BF16, seed=1)[0]
  y = quant.int4_matmul(x, qw, bias=b, implementation="triton", interpret=False)
  _check(y, x, qw, b)

"""Packing, exact dequantization and the GPTQ / AWQ checkpoint converters (bit-exact)."""
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quant
from quant import formats

GOLDEN = pathlib.Path(__file__).with_name("golden_layout.json")


def _random_qw(rng, k=64, n=16, bits=4, group_size=16, sym=False, perm=False):
  codes = rng.integers(0, 2 ** bits, (k, n))
  g = k // group_size
  scales = jnp.asarray(rng.uniform(0.01, 1, (g, n)), jnp.float16)
  zeros = None if sym else jnp.asarray(rng.integers(0, 2 ** bits, (g, n)))
  p = jnp.asarray(rng.permutation(k)) if perm else None
  if p is not None:     # canonical: rows sorted within groups, as our algorithms store them
    g_idx = np.zeros(k, int)
    g_idx[np.asarray(p)] = np.arange(k) // group_size
    p = jnp.asarray(np.argsort(g_idx, kind="stable"))
  return formats.QuantizedWeight.from_codes(jnp.asarray(codes), scales, zeros, bits=bits,
                                            group_size=group_size, perm=p)


def _same(a, b):
  assert a.shape == b.shape and a.bits == b.bits and a.group_size == b.group_size
  assert a.sym == b.sym
  for x, y in ((a.qweight, b.qweight), (a.scales, b.scales), (a.zeros, b.zeros), (a.perm, b.perm)):
    assert (x is None) == (y is None)
    if x is not None:
      assert x.dtype == y.dtype
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_every_code_at_every_nibble():
  # Column 16*p + c holds code c at nibble position p (row p of each 8-row word); other rows 0.
  codes = np.zeros((8, 128), np.int32)
  for p in range(8):
    for c in range(16):
      codes[p, 16 * p + c] = c
  words = np.asarray(quant.pack(jnp.asarray(codes), bits=4))
  assert words.shape == (1, 128) and words.dtype == np.int32
  for p in range(8):
    for c in range(16):
      assert words[0, 16 * p + c].view(np.uint32) == np.uint32(c << (4 * p))
  np.testing.assert_array_equal(np.asarray(quant.unpack(jnp.asarray(words), bits=4)), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_pack_roundtrip_all_widths(bits):
  rng = np.random.default_rng(bits)
  per = formats.per_word(bits)
  codes = jnp.asarray(rng.integers(0, 2 ** bits, (4 * per, 5)), jnp.int32)
  words = quant.pack(codes, bits=bits)
  assert words.shape == (4, 5) and words.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(quant.unpack(words, bits=bits)), np.asarray(codes))
  # Sign bit: the largest code in the last slot makes a negative int32 and still round-trips.
  top = jnp.full((per, 1), 2 ** bits - 1, jnp.int32)
  np.testing.assert_array_equal(np.asarray(quant.unpack(quant.pack(top, bits=bits), bits=bits)), top)


def test_golden_layout():
  g = json.loads(GOLDEN.read_text())
  codes = jnp.asarray(g["codes"], jnp.int32)
  zeros = jnp.asarray(g["zeros"], jnp.int32)
  scales = jnp.asarray(g["scales"], jnp.float32)
  qw = formats.QuantizedWeight.from_codes(codes, scales, zeros, bits=4, group_size=g["group_size"])
  words = lambda a: np.asarray(a).view(np.uint32).tolist()
  assert words(qw.qweight) == g["qweight_u32"]
  ck = formats.to_gptq(qw, version=1)
  assert words(ck["qweight"]) == g["qweight_u32"]      # GPTQ packs along K like us
  assert words(ck["qzeros"]) == g["gptq_v1_qzeros_u32"]
  aw = formats.to_awq(qw)
  assert words(aw["qweight"]) == g["awq_qweight_u32"]
  assert words(aw["qzeros"]) == g["awq_qzeros_u32"]
  np.testing.assert_array_equal(np.asarray(quant.dequantize(qw)), np.asarray(g["dequantized"], np.float32))


def test_awq_nibble_order():
  codes = jnp.arange(8, dtype=jnp.int32)[None, :].repeat(8, axis=0)   # column j holds j
  qw = formats.QuantizedWeight.from_codes(codes, jnp.ones((1, 8)), jnp.zeros((1, 8), jnp.int32),
                                          bits=4, group_size=8)
  word = int(np.asarray(formats.to_awq(qw)["qweight"])[0, 0].view(np.uint32))
  assert [(word >> (4 * i)) & 0xF for i in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]


def test_dequantize_is_exact():
  rng = np.random.default_rng(0)
  for sym, perm in ((False, False), (True, False), (False, True)):
    qw = _random_qw(rng, sym=sym, perm=perm)
    q = np.asarray(qw.codes, np.float64)
    z = np.asarray(qw.zero_points, np.float64).repeat(qw.group_size, 0)
    s = np.asarray(qw.scales, np.float64).repeat(qw.group_size, 0)
    ref = (q - z) * s
    if perm:
      out = np.zeros_like(ref)
      out[np.asarray(qw.perm)] = ref
      ref = out
    got = np.asarray(quant.dequantize(qw, dtype=jnp.float32), np.float64)
    np.testing.assert_array_equal(got, ref.astype(np.float32))
    if sym:
      assert qw.zeros is None and (np.asarray(qw.zero_points) == 8).all()


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("sym,perm", [(False, False), (True, False), (False, True)])
def test_gptq_roundtrip(version, bits, sym, perm):
  rng = np.random.default_rng(bits * 10 + version)
  qw = _random_qw(rng, bits=bits, sym=sym, perm=perm, k=64, n=32)
  ck = formats.to_gptq(qw, version=version)
  assert ck["qweight"].shape == (64 * bits // 32, 32) and ck["qzeros"].shape == (4, 32 * bits // 32)
  back = formats.from_gptq(**ck, bits=bits, sym=sym, version=version)
  _same(qw, back)
  ck2 = formats.to_gptq(back, version=version)
  for key in ck:
    np.testing.assert_array_equal(ck[key], ck2[key])
  np.testing.assert_array_equal(np.asarray(quant.dequantize(back)), np.asarray(quant.dequantize(qw)))


def test_gptq_checkpoint_words_roundtrip_with_act_order():
  # Arbitrary checkpoint words (any bit pattern) with a shuffled g_idx survive ckpt -> ours -> ckpt.
  rng = np.random.default_rng(3)
  k, n, gs = 64, 16, 16
  qweight = rng.integers(-2 ** 31, 2 ** 31, (k // 8, n), dtype=np.int64).astype(np.int32)
  qzeros = rng.integers(-2 ** 31, 2 ** 31, (k // gs, n // 8), dtype=np.int64).astype(np.int32)
  scales = rng.uniform(0, 1, (k // gs, n)).astype(np.float16)
  g_idx = rng.permutation(np.arange(k) // gs).astype(np.int32)
  for version in (1, 2):
    qw = formats.from_gptq(qweight, qzeros, scales, g_idx, version=version)
    assert qw.perm is not None
    ck = formats.to_gptq(qw, version=version)
    np.testing.assert_array_equal(ck["qweight"], qweight)
    np.testing.assert_array_equal(ck["qzeros"], qzeros)
    np.testing.assert_array_equal(ck["scales"], scales)
    np.testing.assert_array_equal(ck["g_idx"], g_idx)
    # dequantize agrees with the GPTQ formula w[k] = (q[k] - z[g_idx[k]]) * s[g_idx[k]]
    q = np.asarray(formats.unpack(jnp.asarray(qweight), bits=4))
    z = np.asarray(formats.unpack_cols(jnp.asarray(qzeros), width=4))
    if version == 1:
      z = (z + 1) & 15
    ref = (q - z[g_idx]) * scales[g_idx].astype(np.float32)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(qw, dtype=jnp.float32)), ref)


def test_gptq_v1_zero_minus_one_quirk():
  codes = jnp.zeros((8, 8), jnp.int32)
  zeros = jnp.asarray([[0, 1, 2, 3, 4, 5, 8, 15]], jnp.int32)
  qw = formats.QuantizedWeight.from_codes(codes, jnp.ones((1, 8)), zeros, bits=4, group_size=8)
  word = int(formats.to_gptq(qw, version=1)["qzeros"][0, 0].view(np.uint32))
  assert [(word >> (4 * i)) & 0xF for i in range(8)] == [15, 0, 1, 2, 3, 4, 7, 14]
  word2 = int(formats.to_gptq(qw, version=2)["qzeros"][0, 0].view(np.uint32))
  assert [(word2 >> (4 * i)) & 0xF for i in range(8)] == [0, 1, 2, 3, 4, 5, 8, 15]


def test_awq_roundtrip():
  rng = np.random.default_rng(5)
  qw = _random_qw(rng, k=64, n=32, group_size=32)
  ck = formats.to_awq(qw)
  assert ck["qweight"].shape == (64, 4) and ck["qzeros"].shape == (2, 4)
  back = formats.from_awq(**ck)
  _same(qw, back)
  words = rng.integers(-2 ** 31, 2 ** 31, (64, 4), dtype=np.int64).astype(np.int32)
  zw = rng.integers(-2 ** 31, 2 ** 31, (2, 4), dtype=np.int64).astype(np.int32)
  again = formats.to_awq(formats.from_awq(words, zw, ck["scales"]))
  np.testing.assert_array_equal(again["qweight"], words)
  np.testing.assert_array_equal(again["qzeros"], zw)


def test_pytree_and_jit():
  qw = _random_qw(np.random.default_rng(1), perm=True)
  leaves, tree = jax.tree.flatten(qw)
  assert len(leaves) == 4
  again = jax.tree.unflatten(tree, leaves)
  _same(qw, again)
  a = jax.jit(quant.dequantize)(qw)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(quant.dequantize(qw)))
  g = np.asarray(qw.g_idx)
  assert sorted(np.bincount(g).tolist()) == [16] * 4


def test_check_quantized_rejects_inconsistent_metadata():
  """zeros of another shape than scales would broadcast silently in dequantize; a perm of the
  wrong length or dtype and integer scales fail deep inside otherwise (audit, session 23)."""
  import dataclasses
  qw = quant.rtn(jax.random.normal(jax.random.key(0), (64, 16)), bits=4, group_size=32)
  formats.check_quantized(qw)
  for bad, err, match in [
      (dict(zeros=qw.zeros[:1]), ValueError, "zeros shape"),
      (dict(perm=jnp.arange(32)), ValueError, "perm must have shape"),
      (dict(perm=jnp.arange(64.0)), TypeError, "perm must be an integer"),
      (dict(scales=qw.scales.astype(jnp.int32)), TypeError, "scales must be floating")]:
    with pytest.raises(err, match=match):
      formats.check_quantized(dataclasses.replace(qw, **bad))


def test_rtn_rejects_non_finite_weights_and_gptq_checks_g_idx_range():
  w = jax.random.normal(jax.random.key(0), (64, 16))
  with pytest.raises(ValueError, match="NaN or inf"):
    quant.rtn(w.at[3, 4].set(jnp.nan), bits=4, group_size=32)
  qw = quant.rtn(w, bits=4, group_size=32)
  ckpt = formats.to_gptq(qw)
  g_idx = np.arange(64) // 32
  g_idx[5] = 5                                      # only groups 0 and 1 exist
  with pytest.raises(ValueError, match="g_idx must hold group ids"):
    formats.from_gptq(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], g_idx, bits=4)

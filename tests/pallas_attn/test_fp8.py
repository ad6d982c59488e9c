"""FP8 attention (``pallas_attn.fp8``): quantisation, Hadamard rotation, the xla semantics and
the Mosaic GPU kernel on e4m3 codes.

Error budget: e4m3 keeps 3 mantissa bits, so a code is within 2^-4 of its value (relative) and
the attention of quantised inputs is ~3% off the bf16 one (mean |error| / mean |out| on random
normal inputs; 2.9-3.0% measured for H = 128, seeds 0-2). The kernel also rounds P to e4m3,
another ~2% against the same attention computed in float32 from the same codes. The bounds
below leave ~2x margin.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness as H
from pallas_attn import fp8, fp8_layout, reference
from pallas_attn.mosaic import fp8 as mosaic_fp8
from pallas_attn.mosaic import default_config, kernels, ops


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.abs(a - b).mean() / np.abs(b).mean())


def _reference(q, k, v, **kw):
  return reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                             precision=jax.lax.Precision.HIGHEST, **kw)


# ------------------------------------------------------------------------- quantisation

@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_hadamard_is_an_orthonormal_involution(d):
  x = jax.random.normal(jax.random.key(0), (3, 5, d))
  y = jax.random.normal(jax.random.key(1), (3, 5, d))
  hx, hy = fp8.hadamard(x), fp8.hadamard(y)
  np.testing.assert_allclose(fp8.hadamard(hx), x, atol=1e-5)
  np.testing.assert_allclose((hx * hy).sum(-1), (x * y).sum(-1), rtol=1e-5, atol=1e-4)
  # An outlier channel is spread evenly: |x H|_inf = |x|_inf / sqrt(d) for a one-hot x.
  onehot = jnp.zeros((d,)).at[3].set(10.0)
  np.testing.assert_allclose(jnp.abs(fp8.hadamard(onehot)), 10.0 / np.sqrt(d), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_hadamard_of_16_bit_inputs_is_the_float32_rotation(dtype):
  """16-bit inputs take one matmul pass against the +-1 matrix (exact products, float32 sums):
  the result must be the float32 rotation of the same values, not a 16-bit rounding of it."""
  x = jax.random.normal(jax.random.key(2), (4, 7, 128)).astype(dtype)
  got = fp8.hadamard(x)
  want = fp8.hadamard(x.astype(jnp.float32))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("d", [0, 3, 96])
def test_hadamard_rejects_other_sizes(d):
  with pytest.raises(ValueError, match="power-of-two"):
    fp8.hadamard(jnp.ones((2, d)))


@pytest.mark.parametrize("block", [1, 4])
def test_quantize_tokens_error_and_scales(block):
  b, l, n, h = 2, 10, 3, 32
  x = jax.random.normal(jax.random.key(2), (b, l, n, h)) * jnp.exp(
      jax.random.normal(jax.random.key(3), (b, l, n, 1)))
  x = x.at[1, 2].set(0.0)                                     # an all-zero token
  qx = fp8.quantize_tokens(x, block=block)
  assert qx.codes.dtype == jnp.float8_e4m3fn and qx.codes.shape == x.shape
  assert qx.scale.shape == (b, n, l)
  back = fp8.dequantize(qx, per="token")
  scale = jnp.transpose(qx.scale, (0, 2, 1))[..., None]
  # e4m3: relative error <= 2^-4 for normal codes, absolute 2^-10 (in code units) below 2^-6.
  bound = jnp.maximum(jnp.abs(x) * 2.0 ** -4, scale * 2.0 ** -10) * 1.001
  assert bool(jnp.all(jnp.abs(back - x) <= bound))
  # The largest element of each block maps to +-448 (the scale is amax / 448).
  amax = jnp.abs(qx.codes.astype(jnp.float32)).max(-1)        # [B, L, N]
  blocks = jnp.pad(amax, ((0, 0), (0, -l % block), (0, 0))).reshape(b, -1, block, n).max(2)
  if block == 1:
    np.testing.assert_array_equal(np.asarray(blocks)[0], 448.0)
  else:
    np.testing.assert_array_equal(np.asarray(blocks), 448.0)
    s = np.asarray(qx.scale)
    np.testing.assert_array_equal(s[:, :, 0:4], np.repeat(s[:, :, 0:1], 4, axis=2))
  np.testing.assert_array_equal(np.asarray(back[1, 2]), 0.0)
  assert np.all(np.isfinite(np.asarray(qx.scale)))


def test_quantize_ignores_padding_outside_valid():
  """NaN / huge padding past kv_lengths neither leaks into the codes nor sets a block's scale."""
  k = jax.random.normal(jax.random.key(4), (1, 8, 2, 16))
  padded = k.at[0, 6:].set(jnp.nan).at[0, 5].set(1e6)
  valid = jnp.arange(8)[None, :] < 5
  qk = fp8.quantize_tokens(padded, block=8, valid=valid)
  ref = fp8.quantize_tokens(k.at[0, 5:].set(0.0), block=8)
  np.testing.assert_array_equal(np.asarray(qk.scale), np.asarray(ref.scale))
  assert np.all(np.isfinite(np.asarray(qk.codes, np.float32)))
  qv = fp8.quantize_channels(padded, valid=valid)
  assert qv.scale.shape == (1, 2, 16)
  np.testing.assert_allclose(np.asarray(qv.scale),
                             np.abs(np.asarray(k[:, :5])).max(1) / 448.0, rtol=1e-6)


# ------------------------------------------------------------------------- xla semantics

def test_fp8_attention_is_close_to_bf16():
  b, t, s, n, kh, h = 2, 96, 160, 4, 2, 64
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h, seed=21)
  kw = dict(causal=True, kv_lengths=jnp.array([160, 90]))
  out, lse = fp8.flash_attention_fp8(q, k, v, return_lse=True, implementation="xla", **kw)
  ref_out, ref_lse = _reference(q, k, v, return_lse=True, **kw)
  assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (b, n, t)
  assert _rel(out, ref_out) < 0.06
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=0.05)


def test_hadamard_halves_the_error_with_outlier_channels():
  """FA3's incoherent processing: with a few channels of Q and K 20x larger than the rest
  (as in LLM activations), the rotation spreads them before the per-token amax is taken.
  Measured 0.035-0.037 against 0.064-0.069 without it (seeds 0-2)."""
  b, t, n, h = 2, 128, 2, 128
  keys = jax.random.split(jax.random.key(5), 3)
  boost = jnp.ones(h).at[jnp.array([3, 17, 64])].set(20.0)
  q = (jax.random.normal(keys[0], (b, t, n, h)) * boost).astype(jnp.bfloat16)
  k = (jax.random.normal(keys[1], (b, t, n, h)) * boost).astype(jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, t, n, h), jnp.bfloat16)
  ref = _reference(q, k, v, scale=0.03)
  with_h = _rel(fp8.flash_attention_fp8(q, k, v, scale=0.03, implementation="xla"), ref)
  without = _rel(fp8.flash_attention_fp8(q, k, v, scale=0.03, use_hadamard=False,
                                         implementation="xla"), ref)
  assert with_h < 0.7 * without, (with_h, without)


def test_odd_head_dim_is_padded_for_the_rotation():
  q, k, v = H.qkv_inputs(1, 40, 50, 2, 1, 48, seed=6)
  out = fp8.flash_attention_fp8(q, k, v, implementation="xla")
  assert out.shape == q.shape
  assert _rel(out, _reference(q, k, v)) < 0.06


def test_fp8_rejects_bad_arguments_and_gradients():
  q, k, v = H.qkv_inputs(1, 16, 16, 2, 1, 64)
  with pytest.raises(ValueError, match="scale_block"):
    fp8.flash_attention_fp8(q, k, v, scale_block=0)
  with pytest.raises(ValueError, match="implementation"):
    fp8.flash_attention_fp8(q, k, v, implementation="triton")
  with pytest.raises(ValueError, match="k and v"):
    fp8.flash_attention_fp8(q, k, v[:, :8])
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(lambda q: fp8.flash_attention_fp8(q, k, v, implementation="xla").sum())(q)


@pytest.mark.parametrize("h,use_hadamard,k_block", [(64, True, 256), (48, True, 1),
                                                     (64, False, 16)])
def test_quantized_kv_gives_the_same_attention(h, use_hadamard, k_block):
  """K and V quantised once (``quantize_kv``) then attended by ``flash_attention_fp8_kv``:
  bitwise the one-call ``flash_attention_fp8`` with the same settings (the same codes), through
  jit (QuantizedKV is a pytree with static settings) and with ragged kv_lengths."""
  b, t, s, n, kh = 2, 40, 70, 4, 2
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h, seed=31)
  lens = jnp.array([70, 33])
  kv = jax.jit(functools.partial(fp8.quantize_kv, use_hadamard=use_hadamard,
                                 k_scale_block=k_block))(k, v, kv_lengths=lens)
  d = 64 if use_hadamard else h
  assert kv.k.codes.shape == (b, s, kh, d) and kv.k.codes.dtype == jnp.float8_e4m3fn
  assert kv.k.scale.shape == (b, kh, s) and kv.v.scale.shape == (b, kh, d)
  assert kv.head_dim == h and kv.rotated == use_hadamard and kv.k_scale_block == k_block
  kw = dict(causal=True, kv_lengths=lens, implementation="xla", return_lse=True)
  out, lse = jax.jit(lambda q, kv: fp8.flash_attention_fp8_kv(q, kv, **kw))(q, kv)
  ref_out, ref_lse = fp8.flash_attention_fp8(q, k, v, use_hadamard=use_hadamard,
                                             k_scale_block=k_block, **kw)
  assert out.shape == q.shape and out.dtype == q.dtype
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))
  assert _rel(out, _reference(q, k, v, causal=True, kv_lengths=lens)) < 0.06
  # the QuantizedKV keeps its kv_lengths: the attention masks with them when given none
  np.testing.assert_array_equal(np.asarray(kv.kv_lengths), np.asarray(lens))
  kw.pop("kv_lengths")
  implicit, _ = fp8.flash_attention_fp8_kv(q, kv, **kw)
  np.testing.assert_array_equal(np.asarray(implicit, np.float32), np.asarray(out, np.float32))


def test_quantized_kv_in_interpret_mode(monkeypatch):
  """The Mosaic kernel on a QuantizedKV: one K scale a kernel block (the default 256 keys)."""
  b, t, s, n, kh, h = 1, 130, 300, 2, 1, 128
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h, seed=32)
  launched = _record_launches(monkeypatch)
  kv = fp8.quantize_kv(k, v)
  out = fp8.flash_attention_fp8_kv(q, kv, implementation="mosaic", interpret=True)
  assert launched and all(st.fp8 and st.fp8_k_block for st in launched)
  xla = fp8.flash_attention_fp8_kv(q, kv, implementation="xla")
  assert _rel(out, xla) < 0.04


def test_quantized_kv_rejects_bad_arguments():
  q, k, v = H.qkv_inputs(1, 16, 16, 2, 1, 64)
  kv = fp8.quantize_kv(k, v)
  with pytest.raises(ValueError, match="kv must be a QuantizedKV"):
    fp8.flash_attention_fp8_kv(q, (k, v))
  with pytest.raises(ValueError, match="head dim"):
    fp8.flash_attention_fp8_kv(q[..., :32], kv)
  with pytest.raises(ValueError, match="batch"):
    fp8.flash_attention_fp8_kv(jnp.concatenate([q, q]), kv)
  with pytest.raises(ValueError, match="scale_block"):
    fp8.flash_attention_fp8_kv(q, kv, scale_block=0)
  with pytest.raises(ValueError, match="k_scale_block"):
    fp8.quantize_kv(k, v, k_scale_block=0)
  with pytest.raises(ValueError, match="same shape"):
    fp8.quantize_kv(k, v[:, :8])
  with pytest.raises(ValueError, match="rank 4"):
    fp8.quantize_kv(k[0], v[0])
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(lambda q: fp8.flash_attention_fp8_kv(q, kv, implementation="xla").sum())(q)


def test_mosaic_declines_off_hopper_without_interpret():
  q, k, v = H.qkv_inputs(1, 16, 16, 2, 1, 64)
  with pytest.raises(NotImplementedError, match="Hopper"):
    fp8.flash_attention_fp8(q, k, v, implementation="mosaic", interpret=False)


# ------------------------------------------------------------------------- the kernel

def _record_launches(monkeypatch) -> list:
  """The ``Statics`` of every forward kernel traced from now on (the test's launches)."""
  launched = []
  body = kernels.fwd_kernel
  monkeypatch.setattr(kernels, "fwd_kernel", lambda *refs, st, has_meta: (
      launched.append(st), body(*refs, st=st, has_meta=has_meta))[1])
  return launched


@pytest.mark.parametrize("h,kw", [
    (64, dict(causal=True, softcap=20.0, kv_lengths=True)),
    (128, dict(window=(40, 10), segments=True)),
    (128, dict()),
], ids=["h64_causal_softcap_len", "h128_window_seg", "h128_full_persistent"])
def test_mosaic_fp8_matches_xla_in_interpret_mode(h, kw, monkeypatch):
  """The kernel against the same attention of the same codes in float32 (it differs by the
  e4m3 rounding of P) and against bf16; lse (float32 row sums) agrees to rounding. The
  unmasked H = 128 call runs the persistent launch (``default_config``): the q scales are
  loaded per tile there, and O has its own 16-bit buffer."""
  b, t, s, n, kh = 2, 130, 150, 2, 1
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h, seed=8)
  launched = _record_launches(monkeypatch)
  persistent = not kw
  kw = H.flag_kwargs(kw, t=t, s=s)
  out, lse = fp8.flash_attention_fp8(q, k, v, implementation="mosaic", interpret=True,
                                     return_lse=True, **kw)
  assert launched and all(st.fp8 and st.persistent == persistent for st in launched)
  xla_out, xla_lse = fp8.flash_attention_fp8(q, k, v, implementation="xla", return_lse=True,
                                             **kw)
  assert out.dtype == q.dtype and out.shape == q.shape
  fin = np.isfinite(np.asarray(xla_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(xla_lse)[fin], atol=1e-4)
  assert _rel(out, xla_out) < 0.04
  assert _rel(out, _reference(q, k, v, **kw)) < 0.08
  empty = ~np.isfinite(np.asarray(lse))                      # rows with no visible key: 0
  np.testing.assert_array_equal(np.asarray(out, np.float32).transpose(0, 2, 1, 3)[empty], 0.0)


def test_mosaic_fp8_applies_v_channel_scales_in_the_kernel(monkeypatch):
  """V's per-channel scales multiply O in the kernel's epilogue: with channels 1-128x apart and
  each K/V head (GQA 4:2) scaled differently, a scale applied to the wrong channel or head
  would be off by far more than FP8's rounding. H = 96 pads to 128 channels (scale 1)."""
  b, t, s, n, kh, h = 1, 70, 90, 4, 2, 96
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h, seed=13)
  channel = 2.0 ** (jnp.arange(h) % 8)
  head = jnp.array([1.0, 0.05])
  v = (v.astype(jnp.float32) * channel * head[None, None, :, None]).astype(v.dtype)
  out = fp8.flash_attention_fp8(q, k, v, causal=True, implementation="mosaic", interpret=True)
  xla_out = fp8.flash_attention_fp8(q, k, v, causal=True, implementation="xla")
  per_channel = lambda o: np.abs(np.asarray(o, np.float32)).mean(axis=(0, 1, 2))
  np.testing.assert_allclose(per_channel(out), per_channel(xla_out), rtol=0.05)
  assert _rel(out, xla_out) < 0.04
  assert _rel(out, _reference(q, k, v, causal=True)) < 0.08


@pytest.mark.parametrize("k_block,per_block", [(128, True), (96, False)])
def test_mosaic_fp8_key_block_scales_in_interpret_mode(k_block, per_block, monkeypatch):
  """``k_scale_block``: K's scales are one per run of keys; a multiple of the kernel's key
  block (128 at H = 128) makes the kernel read one scale a block and scale S per row only
  (``Statics.fp8_k_block``), otherwise it keeps the per-key multiply. Either way it computes
  the attention of the same codes (the xla backend on the same quantised inputs)."""
  b, t, s, n, kh, h = 2, 130, 300, 2, 1, 128
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h, seed=9)
  kf = fp8.quantize_inputs(q, k, v, k_scale_block=k_block)[1]
  scales = np.asarray(kf.scale)[..., :(s // k_block) * k_block].reshape(b, kh, -1, k_block)
  assert (scales == scales[..., :1]).all() and not (scales == scales[:, :, :1, :1]).all()
  launched = _record_launches(monkeypatch)
  kw = H.flag_kwargs(dict(causal=True, kv_lengths=True), t=t, s=s)
  out, lse = fp8.flash_attention_fp8(q, k, v, implementation="mosaic", interpret=True,
                                     return_lse=True, k_scale_block=k_block, **kw)
  assert launched and all(st.fp8 and st.fp8_k_block == per_block for st in launched)
  xla_out, xla_lse = fp8.flash_attention_fp8(q, k, v, implementation="xla", return_lse=True,
                                             k_scale_block=k_block, **kw)
  fin = np.isfinite(np.asarray(xla_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(xla_lse)[fin], atol=1e-4)
  assert _rel(out, xla_out) < 0.04
  assert _rel(out, _reference(q, k, v, **kw)) < 0.08


def test_fp8_default_config_takes_three_consumers_on_long_h128_rows():
  cfg = lambda h, s, masked=False: mosaic_fp8.fp8_default_config(head_dim=h, seq_k=s,
                                                                 masked=masked)
  assert cfg(128, 16384).consumers == 3 and cfg(128, 8192, masked=True).consumers == 3
  assert cfg(128, 4096).consumers == 2 and cfg(128, 8191).consumers == 2
  assert cfg(256, 16384).consumers == 2 and cfg(64, 16384).consumers == 2
  assert cfg(100, 8192).consumers == 3               # padded to 128
  # the rest is default_config's (which itself takes three from 16384 unmasked keys)
  assert dataclasses.replace(cfg(128, 8192), consumers=2) == default_config(
      head_dim=128, seq_k=8192)
  assert cfg(128, 16384) == default_config(head_dim=128, seq_k=16384)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mosaic_fp8_three_consumers_in_interpret_mode(causal, monkeypatch):
  """The default at H = 128 from 8192 keys: three consumers (192 query rows a CTA), here on a
  short call with that config; the attention of the same codes as the xla backend."""
  b, t, s, n, kh, h = 1, 400, 330, 2, 1, 128
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h, seed=12)
  launched = _record_launches(monkeypatch)
  config = mosaic_fp8.fp8_default_config(head_dim=h, seq_k=8192, masked=causal)
  out, lse = fp8.flash_attention_fp8(q, k, v, causal=causal, implementation="mosaic",
                                     interpret=True, return_lse=True, config=config)
  # (the persistent launch is written for two consumers: three run the grid, ops._forward)
  assert launched and all(st.consumers == 3 and not st.persistent for st in launched)
  xla_out, xla_lse = fp8.flash_attention_fp8(q, k, v, causal=causal, implementation="xla",
                                             return_lse=True)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(xla_lse), atol=1e-4)
  assert _rel(out, xla_out) < 0.04


def test_key_order_makes_the_register_regrouping_compute_p_v():
  """``Config.fp8_p_registers``'s index maths, simulated per thread from the two layouts' lane
  maps (jax.experimental.mosaic.gpu.fragmented_array): in each 16-key group the accumulator
  layout gives lane quad q keys (2q, 2q+1) and (8+2q, 9+2q), the 8-bit operand layout reads
  positions 4q..4q+3 from one register; concatenating the two 2-key registers and permuting
  V's keys by ``fp8_key_order`` must give P V."""
  rng = np.random.default_rng(0)
  keys, h = 48, 8
  p, v = rng.standard_normal((4, keys)), rng.standard_normal((keys, h))
  order = fp8_layout.fp8_key_order(keys)
  assert sorted(order) == list(range(keys))
  operand = np.empty_like(p)            # what the wgmma reads as A at k-position 4q + j
  for g in range(keys // 16):
    for q in range(4):
      first, second = p[:, 16 * g + 2 * q: 16 * g + 2 * q + 2], p[:, 16 * g + 8 + 2 * q:
                                                                   16 * g + 10 + 2 * q]
      operand[:, 16 * g + 4 * q: 16 * g + 4 * q + 4] = np.concatenate([first, second], axis=1)
  np.testing.assert_allclose(operand @ v[order], p @ v, rtol=1e-12)
  with pytest.raises(ValueError, match="multiple of 16"):
    fp8_layout.fp8_key_order(40)
  # The kernel's input takes the same order by a reshape and transpose instead of a gather.
  vt = jnp.asarray(rng.standard_normal((2, 3, keys)), jnp.float32)
  np.testing.assert_array_equal(fp8_layout.to_fp8_key_order(vt), vt[..., order])
  with pytest.raises(ValueError, match="multiple of 16"):
    fp8_layout.to_fp8_key_order(jnp.zeros((2, 40)))


FORMS = {"p_smem": dict(fp8_p_registers=False, overlap=False),
         "p_registers": dict(fp8_p_registers=True, overlap=False),
         "overlap": dict(fp8_p_registers=True, overlap=True, lazy_rescale=0.0)}


@pytest.mark.parametrize("h,causal,form,k_block", [
    (64, True, "p_smem", 1), (128, False, "p_smem", 1), (256, True, "p_smem", 1),
    (128, True, "p_registers", 1), (128, False, "overlap", 1), (64, True, "overlap", 1),
    (128, False, "p_registers", 256), (256, False, "overlap", 256), (64, False, "p_smem", 256),
    (256, True, "p_registers", 256)])
def test_mosaic_fp8_lowers_for_sm90(h, causal, form, k_block, monkeypatch):
  """The compiled form (e4m3 wgmmas with K-major operands, V^T's ring, P through SMEM, or with
  ``fp8_p_registers`` P as a register operand, and with ``overlap`` the intra-warpgroup
  overlapped loop; with ``k_block`` one key scale a block, read as a scalar) lowers for sm90
  on the CPU host; Mosaic GPU rejects a transposed FP8 operand at this stage."""
  monkeypatch.setattr(ops, "_on_hopper", lambda: True)
  b, t, n = 1, 512, 2
  codes = jax.ShapeDtypeStruct((b, t, n, h), jnp.float8_e4m3fn)
  rows = jax.ShapeDtypeStruct((b, n, t), jnp.float32)
  chans = jax.ShapeDtypeStruct((b, n, h), jnp.float32)
  config = dataclasses.replace(default_config(head_dim=h, seq_k=t, masked=causal), **FORMS[form])

  def fwd(q8, qs, k8, ks, v8, vs):
    return mosaic_fp8.attention(q8, qs, k8, ks, v8, vs, out_dtype=jnp.bfloat16, causal=causal,
                                scale=h ** -0.5, window=None, softcap=None, q_segment_ids=None,
                                kv_segment_ids=None, kv_lengths=None, return_lse=False,
                                config=config, interpret=False, k_scale_block=k_block)
  text = jax.jit(fwd).trace(codes, rows, codes, rows, codes, chans).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "flash_attention_fwd" in text


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_mosaic_fp8_three_consumers_lower_for_sm90(causal, monkeypatch):
  """The default from 8192 keys at H = 128 (three consumers, P in registers) lowers for sm90."""
  monkeypatch.setattr(ops, "_on_hopper", lambda: True)
  b, t, n, h = 1, 8192, 2, 128
  codes = jax.ShapeDtypeStruct((b, t, n, h), jnp.float8_e4m3fn)
  rows = jax.ShapeDtypeStruct((b, n, t), jnp.float32)
  chans = jax.ShapeDtypeStruct((b, n, h), jnp.float32)
  launched = _record_launches(monkeypatch)

  def fwd(q8, qs, k8, ks, v8, vs):
    return mosaic_fp8.attention(q8, qs, k8, ks, v8, vs, out_dtype=jnp.bfloat16, causal=causal,
                                scale=h ** -0.5, window=None, softcap=None, q_segment_ids=None,
                                kv_segment_ids=None, kv_lengths=None, return_lse=False,
                                config=None, interpret=False, k_scale_block=256)
  text = jax.jit(fwd).trace(codes, rows, codes, rows, codes, chans).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "flash_attention_fwd" in text
  assert launched and all(st.consumers == 3 and st.registers_pv for st in launched)


COMPILED_CASES = [
    H.Case(t=1024, s=1024, h=128, n=4, kh=4, seed=601),
    H.Case(t=1000, s=1100, h=128, n=4, kh=2, causal=True, seed=602),
    H.Case(t=700, s=900, h=64, n=4, kh=2, window=(100, 20), softcap=30.0, segments=2,
           kv_lengths=(900, 555), seed=603),
    H.Case(t=1000, s=1100, h=256, n=4, kh=2, causal=True, seed=604),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", COMPILED_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("form", list(FORMS))
def test_mosaic_fp8_compiled(case, form):
  """Compiled on the GPU: the error budget above, against the float32 attention of the same
  codes and against bf16; with P in registers (``fp8_p_registers``, and the overlapped loop)
  also against P through SMEM (the same products, summed in another order inside 16-key
  groups)."""
  x = H.make_inputs(case)
  kw = dict(causal=case.causal, window=case.window, softcap=case.softcap,
            q_segment_ids=x.q_segment_ids, kv_segment_ids=x.kv_segment_ids,
            kv_lengths=x.kv_lengths)
  masked = case.causal or case.window is not None
  base = default_config(head_dim=case.h, seq_k=case.s, masked=masked)
  out, lse = fp8.flash_attention_fp8(x.q, x.k, x.v, implementation="mosaic", return_lse=True,
                                     config=dataclasses.replace(base, **FORMS[form]), **kw)
  if form != "p_smem":
    smem_out = fp8.flash_attention_fp8(x.q, x.k, x.v, implementation="mosaic",
                                       config=dataclasses.replace(
                                           base, **{**FORMS[form], **FORMS["p_smem"]}), **kw)
    assert _rel(out, smem_out) < 2e-3
  xla_out, xla_lse = fp8.flash_attention_fp8(x.q, x.k, x.v, implementation="xla",
                                             return_lse=True, **kw)
  fin = np.isfinite(np.asarray(xla_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(xla_lse)[fin], atol=1e-3)
  assert _rel(out, xla_out) < 0.04
  assert _rel(out, _reference(x.q, x.k, x.v, **kw)) < 0.08


@pytest.mark.gpu
@pytest.mark.parametrize("case", COMPILED_CASES, ids=lambda c: c.id)
def test_mosaic_fp8_per_key_scales_compiled(case):
  """Compiled, one scale per key (``k_scale_block=1``: S multiplied per logit; the default,
  one per 256 keys, is the path the tests above take): the same error budget."""
  x = H.make_inputs(case)
  kw = dict(causal=case.causal, window=case.window, softcap=case.softcap,
            q_segment_ids=x.q_segment_ids, kv_segment_ids=x.kv_segment_ids,
            kv_lengths=x.kv_lengths)
  out, lse = fp8.flash_attention_fp8(x.q, x.k, x.v, implementation="mosaic", return_lse=True,
                                     k_scale_block=1, **kw)
  xla_out, xla_lse = fp8.flash_attention_fp8(x.q, x.k, x.v, implementation="xla",
                                             return_lse=True, k_scale_block=1, **kw)
  fin = np.isfinite(np.asarray(xla_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(xla_lse)[fin], atol=1e-3)
  assert _rel(out, xla_out) < 0.04
  assert _rel(out, _reference(x.q, x.k, x.v, **kw)) < 0.08


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in COMPILED_CASES if c.h == 128], ids=lambda c: c.id)
def test_mosaic_fp8_three_consumers_compiled(case):
  """Compiled with three consumers (the default at H = 128 from 8192 keys, forced here on
  shorter rows): the same error budget, and within rounding of two consumers."""
  x = H.make_inputs(case)
  kw = dict(causal=case.causal, q_segment_ids=x.q_segment_ids,
            kv_segment_ids=x.kv_segment_ids, kv_lengths=x.kv_lengths)
  three = mosaic_fp8.fp8_default_config(head_dim=128, seq_k=8192, masked=case.causal)
  assert three.consumers == 3
  out = fp8.flash_attention_fp8(x.q, x.k, x.v, implementation="mosaic", config=three, **kw)
  two = fp8.flash_attention_fp8(x.q, x.k, x.v, implementation="mosaic", **kw)
  xla_out = fp8.flash_attention_fp8(x.q, x.k, x.v, implementation="xla", **kw)
  assert _rel(out, two) < 2e-3
  assert _rel(out, xla_out) < 0.04
  assert _rel(out, _reference(x.q, x.k, x.v, **kw)) < 0.08


@pytest.mark.gpu
def test_quantized_kv_compiled():
  """Compiled: a QuantizedKV through the Mosaic kernel, bitwise the one-call form (the same
  codes)."""
  case = COMPILED_CASES[1]
  x = H.make_inputs(case)
  kv = jax.jit(fp8.quantize_kv)(x.k, x.v)
  out = jax.jit(lambda q, kv: fp8.flash_attention_fp8_kv(q, kv, causal=True,
                                                         implementation="mosaic"))(x.q, kv)
  ref = fp8.flash_attention_fp8(x.q, x.k, x.v, causal=True, implementation="mosaic")
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
  assert _rel(out, _reference(x.q, x.k, x.v, causal=True)) < 0.08
  # V kept as [B, S, K, D] (transposed per call): the same operand, the same output
  bskd = fp8.quantize_kv(x.k, x.v, v_layout="bskd")
  per_call = fp8.flash_attention_fp8_kv(x.q, bskd, causal=True, implementation="mosaic")
  np.testing.assert_array_equal(np.asarray(per_call, np.float32), np.asarray(out, np.float32))

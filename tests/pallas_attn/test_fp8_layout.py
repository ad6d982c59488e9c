"""V's FP8 layout for the Mosaic kernel (``pallas_attn.fp8_layout``) and QuantizedKV's
``v_layout``: the kernel-ordered V that a QuantizedKV keeps must reach the kernel as exactly the
array the per-call transposition builds (the compiled kernel then sees the same operand)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness as H
from pallas_attn import fp8, fp8_layout as L


def _codes(shape, seed=0):
  x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 100
  return x.astype(jnp.float8_e4m3fn)


def _bits(x):
  return np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint8))


@pytest.mark.parametrize("s", [16, 70, 256])
def test_kernel_layout_round_trips(s):
  v = _codes((2, s, 3, 32))
  vt = L.kernel_v_layout(v)
  assert vt.shape == (2, 3, 32, -(-s // 16) * 16) and vt.dtype == v.dtype
  np.testing.assert_array_equal(_bits(L.bskd_v_layout(vt, num_keys=s)), _bits(v))
  # the permutation is fp8_key_order's, and the padded keys are zero
  natural = jnp.pad(jnp.transpose(v, (0, 2, 3, 1)), ((0, 0), (0, 0), (0, 0), (0, -s % 16)))
  np.testing.assert_array_equal(_bits(vt), _bits(natural[..., L.fp8_key_order(vt.shape[-1])]))
  np.testing.assert_array_equal(_bits(L.from_fp8_key_order(vt)), _bits(natural))


@pytest.mark.parametrize("key_order", [True, False])
@pytest.mark.parametrize("s,head_dim,num_keys", [(70, 32, 128), (256, 64, 256), (33, 48, 64)])
def test_both_routes_give_the_kernel_the_same_operand(key_order, s, head_dim, num_keys):
  """Per-call transposition (in order) and the stored layout (permuted, padded to 16) give the
  same padded operand, in the kernel's key order or not (interpret mode reads it in order)."""
  v = _codes((1, s, 2, 32), seed=1)
  per_call = L.kernel_v_operand(jnp.transpose(v, (0, 2, 3, 1)), in_key_order=False,
                                key_order=key_order, head_dim=head_dim, num_keys=num_keys)
  stored = L.kernel_v_operand(L.kernel_v_layout(v), in_key_order=True, key_order=key_order,
                              head_dim=head_dim, num_keys=num_keys)
  assert per_call.shape == (1, 2, head_dim, num_keys)
  np.testing.assert_array_equal(_bits(stored), _bits(per_call))


def test_operand_rejects_bad_key_counts():
  with pytest.raises(ValueError, match="multiple of 16"):
    L.kernel_v_operand(jnp.zeros((1, 1, 8, 20)), in_key_order=True, key_order=True,
                       head_dim=8, num_keys=32)
  with pytest.raises(ValueError, match="num_keys"):
    L.kernel_v_operand(jnp.zeros((1, 1, 8, 32)), in_key_order=False, key_order=True,
                       head_dim=8, num_keys=24)
  with pytest.raises(ValueError, match="multiple of 16"):
    L.from_fp8_key_order(jnp.zeros((2, 40)))


def test_quantized_kv_layouts_hold_the_same_codes():
  q, k, v = H.qkv_inputs(2, 24, 70, 4, 2, 48, seed=5)
  lens = jnp.array([70, 40])
  kern = fp8.quantize_kv(k, v, kv_lengths=lens)
  bskd = fp8.quantize_kv(k, v, kv_lengths=lens, v_layout="bskd")
  assert kern.v_layout == "kernel" and bskd.v_layout == "bskd"
  assert kern.v.codes.shape == (2, 2, 64, 80) and bskd.v.codes.shape == (2, 70, 2, 64)
  np.testing.assert_array_equal(_bits(kern.v_bskd().codes), _bits(bskd.v.codes))
  np.testing.assert_array_equal(np.asarray(kern.v.scale), np.asarray(bskd.v.scale))
  assert bskd.v_bskd() is bskd.v
  # the layout is static: jit keeps it, and both give the same attention
  out_k = jax.jit(lambda q, kv: fp8.flash_attention_fp8_kv(q, kv, implementation="xla"))(q, kern)
  out_b = fp8.flash_attention_fp8_kv(q, bskd, implementation="xla")
  np.testing.assert_array_equal(np.asarray(out_k, np.float32), np.asarray(out_b, np.float32))
  with pytest.raises(ValueError, match="v_layout"):
    fp8.quantize_kv(k, v, v_layout="bksd")


def test_kernel_layout_in_interpret_mode_is_bitwise_the_per_call_transposition():
  """The Mosaic kernel (interpret mode) on both layouts: the same operand, the same output."""
  q, k, v = H.qkv_inputs(1, 70, 90, 2, 1, 64, seed=6)
  run = lambda kv: fp8.flash_attention_fp8_kv(q, kv, causal=True, implementation="mosaic",
                                              interpret=True)
  a = run(fp8.quantize_kv(k, v))
  b = run(fp8.quantize_kv(k, v, v_layout="bskd"))
  np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

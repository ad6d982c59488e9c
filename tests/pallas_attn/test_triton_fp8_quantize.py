"""The fused FP8 quantisation pass (``pallas_attn.triton.fp8_quantize``): the same codes and
scales as ``fp8.quantize_inputs``'s XLA passes, in interpret mode on CPU (bitwise) and
compiled on the GPU (the rotation's float32 sums may round differently there, so up to one
e4m3 step on a few codes)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import mesh as mesh_lib

from pallas_attn import fp8
from pallas_attn.triton import fp8_quantize as fq


def _inputs(b, l, n, d, *, seed, dtype=jnp.bfloat16):
  x = jax.random.normal(jax.random.key(seed), (b, l, n, d), jnp.float32)
  return x.at[0, min(3, l - 1), 0, d // 3].set(40.0).astype(dtype)   # one outlier channel


def _xla(x, lengths, *, rotate, block):
  xr = fp8.hadamard(x).astype(x.dtype) if rotate else x
  valid = None if lengths is None else jnp.arange(x.shape[1])[None, :] < lengths[:, None]
  return fp8.quantize_tokens(xr, block=block, valid=valid)


@pytest.mark.parametrize("b,l,n,d,block,rotate,lengths", [
    (2, 100, 3, 64, 1, True, None),
    (2, 300, 2, 128, 256, True, (300, 123)),       # one K scale per 256 keys, ragged lengths
    (1, 70, 2, 128, 64, False, (50,)),
    (2, 64, 1, 32, 1, True, (64, 0)),              # an empty row: scale 1, codes 0
    (1, 40, 1, 256, 16, True, None),
    (2, 90, 2, 256, 1, True, (90, 41)),            # H_256 as two 128-column blocks, per token
    (1, 50, 1, 256, 1, False, None),
], ids=["token_h64", "block256_len", "block64_norotate", "h32_empty", "h256_block16",
        "h256_token_len", "h256_norotate"])
def test_fused_pass_matches_xla_in_interpret_mode(b, l, n, d, block, rotate, lengths):
  x = _inputs(b, l, n, d, seed=l + d)
  lens = None if lengths is None else jnp.array(lengths, jnp.int32)
  codes, scale = fq.quantize(x, lens, rotate=rotate, scale_block=block, interpret=True)
  ref = _xla(x, lens, rotate=rotate, block=block)
  assert codes.dtype == jnp.float8_e4m3fn and codes.shape == x.shape
  assert scale.dtype == jnp.float32 and scale.shape == (b, n, l)
  np.testing.assert_array_equal(np.asarray(scale), np.asarray(ref.scale))
  np.testing.assert_array_equal(np.asarray(codes.astype(jnp.float32)),
                                np.asarray(ref.codes.astype(jnp.float32)))
  if block > 1:          # one scale per block of tokens
    s = np.asarray(scale)[..., :(l // block) * block].reshape(b, n, -1, block)
    assert (s == s[..., :1]).all()


def test_quantize_inputs_fused_is_the_xla_path():
  """``quantize_inputs(fused=True)`` gives the XLA path's Q, K and V exactly (interpret mode);
  float32 inputs, which the kernel does not serve, take the XLA path."""
  q, k, v = (_inputs(2, 130, 2, 128, seed=s) for s in (1, 2, 3))
  lens = jnp.array([130, 77], jnp.int32)
  fused = fp8.quantize_inputs(q, k, v, kv_lengths=lens, fused=True, interpret=True)
  plain = fp8.quantize_inputs(q, k, v, kv_lengths=lens)
  for a, b in zip(fused, plain):
    np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
    np.testing.assert_array_equal(np.asarray(a.codes.astype(jnp.float32)),
                                  np.asarray(b.codes.astype(jnp.float32)))
  q32 = q.astype(jnp.float32)
  for a, b in zip(fp8.quantize_inputs(q32, q32, q32, fused=True),
                  fp8.quantize_inputs(q32, q32, q32)):
    np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))


def test_flash_attention_fp8_with_fused_quantize():
  q, k, v = (_inputs(2, 96, 2, 64, seed=s) for s in (4, 5, 6))
  out = fp8.flash_attention_fp8(q, k, v, causal=True, implementation="xla", fused_quantize=True)
  ref = fp8.flash_attention_fp8(q, k, v, causal=True, implementation="xla")
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


def test_unsupported_inputs_raise_not_implemented():
  x = jnp.zeros((1, 32, 1, 128), jnp.float32)
  with pytest.raises(NotImplementedError, match="16-bit"):
    fq.quantize(x, interpret=True)
  with pytest.raises(NotImplementedError, match="scale_block"):
    fq.quantize(x.astype(jnp.bfloat16), scale_block=100, interpret=True)
  with pytest.raises(NotImplementedError, match="head dim"):
    fq.quantize(jnp.zeros((1, 32, 1, 96), jnp.bfloat16), interpret=True)
  assert not fq.supported(head_dim=512, dtype=jnp.bfloat16, scale_block=1)
  assert fq.supported(head_dim=64, dtype=jnp.float16, scale_block=256)


@pytest.mark.parametrize("d,block", [(128, 1), (128, 256), (64, 1), (256, 64)])
def test_lowers_to_triton_for_h200(d, block):
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  dev = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  x = jax.ShapeDtypeStruct((2, 512, 4, d), jnp.bfloat16)
  lens = jax.ShapeDtypeStruct((2,), jnp.int32)
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=dev)):
    text = jax.jit(lambda x, n: fq.quantize(x, n, scale_block=block)).trace(x, lens).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "fp8_quantize" in text


@pytest.mark.gpu
@pytest.mark.parametrize("d,block,lengths", [(128, 1, None), (128, 256, (1000, 555)),
                                            (256, 1, (1000, 700)), (256, 256, None)])
def test_fused_pass_compiled(d, block, lengths):
  """Compiled: the scales agree to the bf16 rounding of a block's amax and the codes, as
  values, to one e4m3 step (2^-3 relative) wherever they differ at all, which is rare."""
  x = _inputs(2, 1000, 4, d, seed=7)
  lens = None if lengths is None else jnp.array(lengths, jnp.int32)
  codes, scale = fq.quantize(x, lens, scale_block=block)
  ref = _xla(x, lens, rotate=True, block=block)
  np.testing.assert_allclose(np.asarray(scale), np.asarray(ref.scale), rtol=1e-2)
  got = np.asarray(codes.astype(jnp.float32)) * np.asarray(scale).transpose(0, 2, 1)[..., None]
  want = (np.asarray(ref.codes.astype(jnp.float32))
          * np.asarray(ref.scale).transpose(0, 2, 1)[..., None])
  diff = np.abs(got - want)
  assert np.mean(diff > 0) < 1e-2
  np.testing.assert_array_less(diff, 0.13 * np.abs(want) + 1e-6 + 0.02 * np.abs(want).max())

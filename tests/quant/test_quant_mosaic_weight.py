"""A prepared ``layout.MosaicWeight`` through the public API: ``layout.to_quantized`` (the
inverse of ``prepare_mosaic``), ``quant.int4_matmul`` dispatch, and ``QuantLinear(mosaic=True)``.
On CPU the matmul runs the XLA reference (or a Pallas kernel in interpret mode when asked)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import quant
from quant.matmul import api, layout
from quant.matmul import mosaic as w4_mosaic
from quant.matmul import mosaic_io as nnx_ops      # QuantLinear's Hopper check (patched below)
from test_int4_matmul_triton import _check, _weight as _codes_weight, _x


def _weight(k, n, group_size, sym, act_order=False, seed=0):
  w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32)
  qw = quant.rtn(w, bits=4, group_size=group_size, sym=sym)
  if act_order:                      # a permuted row order, as GPTQ act-order stores it
    perm = jax.random.permutation(jax.random.key(seed + 1), k).astype(jnp.int32)
    qw = quant.QuantizedWeight.from_codes(qw.codes, qw.scales, qw.zeros, bits=4,
                                          group_size=group_size, perm=perm)
  return qw


CASES = [(512, 256, 128, False, False), (520, 200, None, True, False),
         (256, 130, 32, False, True), (1024, 64, 64, True, False)]


@pytest.mark.parametrize("k,n,gs,sym,act", CASES, ids=["g128", "per_channel_sym_odd",
                                                       "g32_act_order", "g64_sym"])
@pytest.mark.parametrize("tile_major", [False, True], ids=["rows", "tiles"])
def test_to_quantized_inverts_prepare_mosaic(k, n, gs, sym, act, tile_major):
  qw = _weight(k, n, gs, sym, act)
  back = layout.to_quantized(layout.prepare_mosaic(qw, tile_major=tile_major))
  assert (back.bits, back.group_size, back.sym, back.shape) == (qw.bits, qw.group_size, qw.sym,
                                                                qw.shape)
  np.testing.assert_array_equal(back.qweight, qw.qweight)
  np.testing.assert_array_equal(back.scales, qw.scales)
  assert (back.zeros is None) == sym
  if not sym:
    assert back.zeros.dtype == qw.zeros.dtype
    np.testing.assert_array_equal(back.zeros, qw.zeros)
  if act:
    np.testing.assert_array_equal(back.perm, qw.perm)


def test_to_quantized_rejects_other_types():
  with pytest.raises(TypeError, match="MosaicWeight"):
    layout.to_quantized(_weight(256, 64, 128, False))


@pytest.mark.parametrize("impl", [None, "xla", "triton"])
def test_int4_matmul_takes_a_prepared_weight(impl):
  """Every backend serves a MosaicWeight with the same result as the QuantizedWeight it came
  from (M = 100 > 64: the Mosaic decode kernel would decline on a GPU too)."""
  qw = _weight(512, 256, 128, False, act_order=True)
  mw = layout.prepare_mosaic(qw)
  x = jax.random.normal(jax.random.key(3), (100, 512), jnp.bfloat16)
  bias = jnp.linspace(-1, 1, 256).astype(jnp.bfloat16)
  y = jax.jit(lambda x, w: api.int4_matmul(x, w, bias=bias, implementation=impl,
                                           interpret=True))(x, mw)
  y0 = api.int4_matmul(x, qw, bias=bias, implementation=impl, interpret=True)
  assert y.shape == (100, 256) and y.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y0, np.float32))


def test_int4_matmul_checks_a_prepared_weight():
  mw = layout.prepare_mosaic(_weight(512, 256, 128, False))
  with pytest.raises(ValueError, match="K=512"):
    api.int4_matmul(jnp.ones((2, 256), jnp.bfloat16), mw)
  with pytest.raises(ValueError, match="bias"):
    api.int4_matmul(jnp.ones((2, 512), jnp.bfloat16), mw, bias=jnp.ones((3,), jnp.bfloat16))


def test_quant_linear_mosaic_storage_matches_default():
  lin = nnx.Linear(512, 192, rngs=nnx.Rngs(0))
  qw = quant.rtn(lin.kernel[...], group_size=128)
  plain = quant.QuantLinear.from_linear(lin, qw, mosaic=False)
  prepared = quant.QuantLinear.from_linear(lin, qw, mosaic=True)
  assert isinstance(prepared.weight, layout.MosaicWeight) and prepared.mosaic and not plain.mosaic
  assert isinstance(plain.weight, quant.QuantizedWeight)
  np.testing.assert_array_equal(prepared.quantized_weight.qweight, qw.qweight)
  x = jax.random.normal(jax.random.key(2), (3, 512), jnp.float32)
  np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(prepared, x)),
                                np.asarray(plain(x)))
  # A MosaicWeight is taken as is.
  direct = quant.QuantLinear(layout.prepare_mosaic(qw, tile_major=True))
  assert direct.mosaic_block_k == layout.default_block_k(512, 192, 128)
  assert direct.qweight[...].ndim == 2                 # stored row-major (2-D, shardable)
  assert not nnx.state(prepared, nnx.Param).get("qweight")


def test_quant_linear_default_layout_is_the_packed_format_off_hopper():
  qw = quant.rtn(jax.random.normal(jax.random.key(0), (256, 128)), group_size=128)
  assert not nnx_ops.on_hopper()                       # the CPU test machine
  assert isinstance(quant.QuantLinear(qw).weight, quant.QuantizedWeight)


@pytest.mark.parametrize("kw,want", [
    (dict(), True),
    (dict(dtype=jnp.bfloat16), True),
    (dict(implementation="mosaic"), True),
    (dict(implementation="triton"), False),          # asked for a backend that reads our format
    (dict(dtype=jnp.float32), False),                # the Mosaic kernel takes 16-bit x only
    (dict(bits=8), False),                           # the layout holds 4-bit codes
    (dict(mosaic=False), False),
], ids=["default", "bf16", "mosaic_backend", "triton_backend", "f32", "8_bit", "forced_off"])
def test_quant_linear_default_layout_on_hopper(monkeypatch, kw, want):
  """``mosaic=None`` on a Hopper GPU (faked here): the Mosaic layout wherever it serves the layer,
  our packed format otherwise, never an error; both compute the same outputs."""
  monkeypatch.setattr(nnx_ops, "on_hopper", lambda: True)
  kw = dict(kw)
  w = jax.random.normal(jax.random.key(0), (256, 128))
  qw = quant.rtn(w, bits=kw.pop("bits", 4), group_size=128)
  layer = quant.QuantLinear(qw, **kw)
  assert layer.mosaic == want
  assert isinstance(layer.weight, layout.MosaicWeight if want else quant.QuantizedWeight)
  if "implementation" in kw:
    return                            # a forced backend needs the GPU (or bf16 x in interpret)
  x = jax.random.normal(jax.random.key(1), (2, 256), jnp.float32)
  plain = quant.QuantLinear(qw, **{**kw, "mosaic": False})
  np.testing.assert_allclose(np.asarray(layer(x), np.float32), np.asarray(plain(x), np.float32),
                             rtol=1e-5, atol=1e-5)


def test_quant_linear_mosaic_sharding_names_follow_the_transpose():
  init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"),
                               eager_sharding=False)
  lin = nnx.Linear(256, 128, kernel_init=init, rngs=nnx.Rngs(0))
  qw = quant.rtn(lin.kernel[...], group_size=128)
  prepared = quant.QuantLinear.from_linear(lin, qw, mosaic=True)
  assert prepared.qweight.get_metadata()["out_sharding"] == ("mlp", "embed")   # [N, K/4]
  assert prepared.scales.get_metadata()["out_sharding"] == (None, "mlp")


def test_mosaic_serves_a_prepared_weight_above_128_rows_in_chunks():
  """M > 128 on a prepared weight: one call up to 256 rows (the default's one accumulator),
  equal chunks above (here two of 130 rows), one kernel call each (interpret mode), with
  leading batch dims, bias and the gradient with respect to x."""
  qw = _codes_weight(256, 128, group_size=64, sym=False, act_order=True)
  mw = layout.prepare_mosaic(qw)
  x = _x(260, 256, jnp.bfloat16, seed=5)
  b = _x(1, 128, jnp.bfloat16, seed=6)[0]
  y = api.int4_matmul(x.reshape(2, 130, 256), mw, bias=b, implementation="mosaic",
                      interpret=True)
  assert y.shape == (2, 130, 128)
  _check(y.reshape(260, 128), x, qw, b)
  assert w4_mosaic.chunk_rows(260, mw) == 130 and w4_mosaic.chunk_rows(130, mw) == 130
  # A plain QuantizedWeight above 256 rows is declined (dispatch then runs Triton on it).
  with pytest.raises(NotImplementedError, match="M <= 128"):
    api.int4_matmul(x, qw, implementation="mosaic", interpret=True)
  g = jax.grad(lambda x: jnp.sum(api.int4_matmul(x, mw, implementation="mosaic",
                                                 interpret=True).astype(jnp.float32)))(x)
  g_ref = jax.grad(lambda x: jnp.sum(api.int4_matmul(x, qw, implementation="xla")
                                     .astype(jnp.float32)))(x)
  np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(g_ref, np.float32),
                             rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("m,chunks", [(400, 2), (2400, 10)])
def test_chunked_compiled_form_lowers_for_h200(m, chunks):
  """The compiled form above 256 rows: up to ``MAX_UNROLLED_CHUNKS`` chunks are unrolled (one
  Mosaic GPU launch each, no XLA while loop: 400 rows are two of 200), more run in a loop
  around one launch (2400 rows: ten of 240)."""
  from test_int4_matmul_mosaic import _lowered_text
  qw = _codes_weight(1024, 256, group_size=128, sym=False, act_order=False)
  mw = jax.eval_shape(layout.prepare_mosaic, qw)
  assert -(-m // w4_mosaic.chunk_rows(m, mw)) == chunks
  text = _lowered_text(jax.ShapeDtypeStruct((m, 1024), jnp.bfloat16), mw, None)
  unrolled = chunks <= w4_mosaic.MAX_UNROLLED_CHUNKS
  assert "mosaic_gpu" in text and ("stablehlo.while" in text) != unrolled

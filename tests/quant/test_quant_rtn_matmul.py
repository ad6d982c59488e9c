"""RTN, int4_matmul (reference backend and dispatch) and the bad-input table of every public function."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quant
from quant import calibration, formats
from quant.matmul import api


def _w(k=256, n=32, seed=0):
  return jax.random.normal(jax.random.key(seed), (k, n), jnp.float32)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("gs,sym", [(128, False), (64, True), (None, False)])
def test_rtn_error_bounded_by_half_a_step(bits, gs, sym):
  w = _w()
  qw = quant.rtn(w, bits=bits, group_size=gs, sym=sym)
  assert qw.bits == bits and qw.sym == sym and (qw.zeros is None) == sym
  assert qw.group_size == (256 if gs is None else gs)
  err = jnp.abs(quant.dequantize(qw) - w).reshape(256 // qw.group_size, qw.group_size, 32)
  step = qw.scales[:, None, :]
  slack = 1.0 if sym else 0.5      # sym: the top code is one step short of +max (2**(b-1) - 1)
  assert bool((err <= slack * step + 1e-6).all())
  codes = qw.codes
  assert int(codes.min()) >= 0 and int(codes.max()) <= 2 ** bits - 1


def test_rtn_zero_group_and_exact_grid_values():
  w = jnp.zeros((128, 8)).at[:, 1].set(jnp.linspace(-1, 1, 128))
  qw = quant.rtn(w, bits=4, group_size=128)
  w_hat = quant.dequantize(qw)
  assert bool((w_hat[:, 0] == 0).all())             # 0 is exactly representable
  assert bool(jnp.isfinite(qw.scales).all())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_int4_matmul_matches_dequantize(dtype):
  rng = np.random.default_rng(0)
  w = _w(k=256, n=64)
  qw = quant.rtn(w, bits=4, group_size=128)
  x = jnp.asarray(rng.standard_normal((3, 5, 256)), dtype)
  bias = jnp.asarray(rng.standard_normal(64), jnp.float32)
  y = quant.int4_matmul(x, qw, bias=bias)
  assert y.shape == (3, 5, 64) and y.dtype == dtype
  ref = np.asarray(x, np.float64) @ np.asarray(quant.dequantize(qw), np.float64) + np.asarray(bias)
  # TESTING.md: mean relative error < 1e-3 against the float reference rounded to x's dtype
  # (the weight must not be rounded to bf16 first: that alone gave ~1.7e-3).
  rounded = np.asarray(jnp.asarray(ref, dtype), np.float64)
  rel = np.abs(np.asarray(y, np.float64) - rounded).mean() / np.abs(ref).mean()
  assert rel < {jnp.float32: 1e-6, jnp.bfloat16: 1e-3, jnp.float16: 1e-3}[dtype]
  # jit and vmap agree bitwise with eager.
  yj = jax.jit(lambda a, q: quant.int4_matmul(a, q, bias=bias))(x, qw)
  np.testing.assert_array_equal(np.asarray(yj), np.asarray(y))
  yv = jax.vmap(lambda a: quant.int4_matmul(a, qw, bias=bias))(x)
  np.testing.assert_allclose(np.asarray(yv, np.float32), np.asarray(y, np.float32), rtol=1e-6)


def test_int4_matmul_act_order_permutation():
  w = _w(k=128, n=16)
  h = jnp.diag(jnp.linspace(1, 2, 128))
  qw = quant.gptq(w, h, group_size=32, act_order=True).qweight
  assert qw.perm is not None
  x = jax.random.normal(jax.random.key(1), (4, 128))
  np.testing.assert_allclose(np.asarray(quant.int4_matmul(x, qw)),
                             np.asarray(x @ quant.dequantize(qw)), rtol=1e-5, atol=1e-5)


def test_dispatch_falls_back_on_not_implemented(monkeypatch):
  calls = []

  def declining(x, qw, *, bias, config, interpret):
    calls.append(interpret)
    raise NotImplementedError("group size not supported")

  real = api._backend
  monkeypatch.setattr(api, "_backend", lambda name: declining if name == "triton" else real(name))
  monkeypatch.setattr(api, "default_order", lambda: ("triton", "xla"))
  qw = quant.rtn(_w(k=128, n=8), group_size=64)
  x = jnp.ones((2, 128))
  y = quant.int4_matmul(x, qw)
  assert calls == [True]                               # no GPU here: interpret defaults to True
  np.testing.assert_allclose(np.asarray(y), np.asarray(x @ quant.dequantize(qw)), rtol=1e-6)
  with pytest.raises(NotImplementedError, match="group size"):
    quant.int4_matmul(x, qw, implementation="triton")


def test_default_order_on_cpu_is_reference_only():
  assert api.default_order() == ("xla",)


_QW = None


def _qw():
  global _QW
  if _QW is None:
    _QW = quant.rtn(_w(k=128, n=16), group_size=64)
  return _QW


BAD = [
    # (callable, exception, message regex)
    (lambda: quant.rtn(_w(k=100), group_size=64), ValueError, "divisible by group_size"),
    (lambda: quant.rtn(_w(k=12), group_size=None), ValueError, "divisible by 8"),
    (lambda: quant.rtn(_w(), bits=1), ValueError, "bits must be"),
    (lambda: quant.rtn(_w(), bits=9), ValueError, "bits must be"),
    (lambda: quant.rtn(_w(), group_size=0), ValueError, "group_size"),
    (lambda: quant.rtn(jnp.ones((4, 4, 4))), ValueError, "2-D"),
    (lambda: quant.rtn(jnp.ones((128, 4), jnp.int32)), TypeError, "floating"),
    (lambda: quant.pack(jnp.ones((8, 2), jnp.float32)), TypeError, "integer"),
    (lambda: quant.pack(jnp.ones((7, 2), jnp.int32)), ValueError, "divisible by 8"),
    (lambda: quant.unpack(jnp.ones((1, 2), jnp.uint32)), TypeError, "int32"),
    (lambda: quant.dequantize(jnp.ones((8, 8))), TypeError, "QuantizedWeight"),
    (lambda: quant.dequantize(formats.QuantizedWeight(
        jnp.ones((16, 16), jnp.float32), _qw().scales, _qw().zeros, None, 4, 64, False, (128, 16))),
     TypeError, "qweight must be int32"),
    (lambda: formats.QuantizedWeight.from_codes(jnp.zeros((128, 16), jnp.int32),
                                                jnp.ones((3, 16)), None, bits=4, group_size=64),
     ValueError, "scales must have shape"),
    (lambda: formats.QuantizedWeight.from_codes(jnp.zeros((128, 16), jnp.int32),
                                                jnp.ones((2, 16), jnp.int32), None, bits=4,
                                                group_size=64), TypeError, "floating"),
    (lambda: quant.int4_matmul(jnp.ones((2, 64)), _qw()), ValueError, "K=128"),
    (lambda: quant.int4_matmul(jnp.ones((2, 128), jnp.int32), _qw()), ValueError, "bfloat16"),
    (lambda: quant.int4_matmul(jnp.ones((2, 128)), _qw(), bias=jnp.ones(3)), ValueError, "bias"),
    (lambda: quant.int4_matmul(jnp.ones((2, 128)), _qw(), implementation="cuda"), ValueError,
     "implementation"),
    (lambda: quant.int4_matmul(jnp.ones((2, 128)), _qw(), implementation="mosaic"),
     NotImplementedError, "mosaic"),
    (lambda: quant.int4_matmul(jnp.ones((2, 128)), _qw(), config=object(), implementation="xla"),
     NotImplementedError, "config"),
    (lambda: quant.gptq(_w(k=128), jnp.eye(64)), ValueError, "hessian must have shape"),
    (lambda: quant.gptq(_w(k=128), jnp.eye(128), group_size=48), ValueError, "divisible"),
    (lambda: quant.gptq(_w(k=128), jnp.eye(128, dtype=jnp.int32)), TypeError, "floating"),
    (lambda: quant.gptq(_w(k=128), jnp.eye(128), damp=-1.0), ValueError, "damp"),
    (lambda: quant.gptq(_w(k=128), jnp.eye(128), block_size=0), ValueError, "block_size"),
    (lambda: quant.gptq(_w(k=128).at[0, 0].set(jnp.nan), jnp.eye(128)), ValueError, "w contains NaN"),
    (lambda: quant.awq(_w(k=128), jnp.eye(128), jnp.ones(64)), ValueError, "act_scale"),
    (lambda: quant.awq(_w(k=128), jnp.eye(128), jnp.ones(128), n_grid=0), ValueError, "n_grid"),
    (lambda: quant.awq(_w(k=128), jnp.eye(128), jnp.ones(128).at[3].set(jnp.inf)), ValueError,
     "act_scale contains NaN"),
    (lambda: calibration.init(0), ValueError, "positive"),
    (lambda: calibration.update(calibration.init(8), jnp.ones((3, 4))), ValueError, r"\[\.\.\., 8\]"),
    (lambda: calibration.update(calibration.init(8), jnp.ones((3, 8), jnp.int32)), TypeError,
     "floating"),
    (lambda: calibration.hessian(calibration.init(8)), ValueError, "no calibration tokens"),
    (lambda: calibration.from_batches([]), ValueError, "no calibration batches"),
    (lambda: formats.to_gptq(_qw(), version=3), ValueError, "version"),
    (lambda: formats.to_gptq(quant.rtn(_w(k=128, n=16), bits=3)), NotImplementedError, "3-bit"),
    (lambda: formats.to_awq(quant.rtn(_w(k=128, n=16), bits=3)), NotImplementedError, "4-bit"),
    (lambda: formats.to_awq(quant.rtn(_w(k=128, n=12))), ValueError, "divisible by 8"),
    (lambda: formats.from_gptq(np.zeros((16, 16), np.float32), np.zeros((2, 2), np.int32),
                               np.ones((2, 16), np.float16)), TypeError, "qweight must be int32"),
    (lambda: formats.from_gptq(np.zeros((16, 16), np.int32), np.zeros((2, 2), np.int32),
                               np.ones((3, 16), np.float16)), ValueError, "scales shape"),
    (lambda: formats.from_gptq(np.zeros((16, 16), np.int32), np.zeros((2, 2), np.int32),
                               np.ones((2, 16), np.float16), sym=True), ValueError, "sym=True"),
    (lambda: formats.from_gptq(np.zeros((16, 16), np.int32), np.zeros((2, 2), np.int32),
                               np.ones((2, 16), np.float16), np.zeros(100, np.int32)), ValueError,
     "g_idx must have shape"),
    (lambda: formats.from_awq(np.zeros((128, 2), np.int32), np.zeros((2, 2), np.int32),
                              np.ones((3, 16), np.float16)), ValueError, "inconsistent"),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input(i):
  fn, exc, msg = BAD[i]
  with pytest.raises(exc, match=msg):
    fn()

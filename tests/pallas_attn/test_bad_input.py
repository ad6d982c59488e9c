"""Invalid calls raise ValueError naming the argument; unsupported ones NotImplementedError; and
dispatch with ``implementation=None`` serves every valid call."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness as H
from harness import Case
from pallas_attn import flash_attention, reference

B, T, S, N, K, HD = 2, 16, 24, 4, 2, 32


def _arr(shape, dtype=jnp.float32, seed=0):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


Q, KV = _arr((B, T, N, HD)), _arr((B, S, K, HD), seed=1)
QS, KS = jnp.zeros((B, T), jnp.int32), jnp.zeros((B, S), jnp.int32)

# (id, args, kwargs, regex)
BAD = [
    ("q_rank3", (Q[0], KV, KV), {}, r"q must be rank 4"),
    ("k_rank5", (Q, KV[None], KV[None]), {}, r"k must be rank 4"),
    ("v_rank3", (Q, KV, KV[0]), {}, r"v must be rank 4"),
    ("not_an_array", ([[1.0]], KV, KV), {}, r"q must be rank 4"),
    ("head_dim_mismatch", (Q, _arr((B, S, K, 2 * HD)), _arr((B, S, K, 2 * HD))), {},
     r"head dim"),
    ("k_v_shape_mismatch", (Q, KV, _arr((B, S + 1, K, HD))), {}, r"k and v must have the same"),
    ("batch_mismatch", (Q, _arr((B + 1, S, K, HD)), _arr((B + 1, S, K, HD))), {}, r"batch"),
    ("dtype_mismatch", (Q.astype(jnp.bfloat16), KV, KV), {}, r"share a dtype"),
    ("int_dtype", (Q.astype(jnp.int32), KV.astype(jnp.int32), KV.astype(jnp.int32)), {},
     r"dtype must be bfloat16, float16 or float32"),
    ("int8_q", (Q.astype(jnp.int8), KV, KV), {}, r"q dtype"),
    ("heads_not_multiple", (_arr((B, T, 5, HD)), KV, KV), {}, r"multiple of k/v heads"),
    ("more_kv_heads", (_arr((B, T, 2, HD)), _arr((B, S, 4, HD)), _arr((B, S, 4, HD))), {},
     r"multiple of k/v heads"),
    ("empty_seq", (_arr((B, 0, N, HD)), KV, KV), {}, r"empty dimension"),
    ("q_segments_only", (Q, KV, KV), dict(q_segment_ids=QS), r"given together"),
    ("kv_segments_only", (Q, KV, KV), dict(kv_segment_ids=KS), r"given together"),
    ("q_segments_shape", (Q, KV, KV), dict(q_segment_ids=KS, kv_segment_ids=KS),
     r"q_segment_ids must have shape"),
    ("kv_segments_shape", (Q, KV, KV), dict(q_segment_ids=QS, kv_segment_ids=QS),
     r"kv_segment_ids must have shape"),
    ("segments_rank1", (Q, KV, KV), dict(q_segment_ids=QS[0], kv_segment_ids=KS[0]),
     r"q_segment_ids must have shape"),
    ("segments_float", (Q, KV, KV), dict(q_segment_ids=QS.astype(jnp.float32),
                                         kv_segment_ids=KS.astype(jnp.float32)),
     r"q_segment_ids must be an integer"),
    ("kv_lengths_shape", (Q, KV, KV), dict(kv_lengths=jnp.zeros((B, 1), jnp.int32)),
     r"kv_lengths must have shape"),
    ("kv_lengths_scalar", (Q, KV, KV), dict(kv_lengths=jnp.int32(3)),
     r"kv_lengths must have shape"),
    ("kv_lengths_float", (Q, KV, KV), dict(kv_lengths=jnp.zeros((B,), jnp.float32)),
     r"kv_lengths must be an integer"),
    ("window_negative", (Q, KV, KV), dict(window=(-1, 0)), r"window"),
    ("window_len3", (Q, KV, KV), dict(window=(1, 2, 3)), r"window"),
    ("window_int", (Q, KV, KV), dict(window=4), r"window"),
    ("window_float", (Q, KV, KV), dict(window=(1.5, 0)), r"window"),
    ("softcap_negative", (Q, KV, KV), dict(softcap=-1.0), r"softcap must be a positive"),
    ("softcap_zero", (Q, KV, KV), dict(softcap=0.0), r"softcap must be a positive"),
    ("scale_array", (Q, KV, KV), dict(scale=jnp.float32(0.1)), r"scale must be a Python float"),
    ("scale_nan", (Q, KV, KV), dict(scale=float("nan")), r"scale must be a Python float"),
    ("softcap_inf", (Q, KV, KV), dict(softcap=float("inf")), r"softcap must be a positive"),
    ("softcap_nan", (Q, KV, KV), dict(softcap=float("nan")), r"softcap must be a positive"),
    ("softcap_bool", (Q, KV, KV), dict(softcap=True), r"softcap must be a positive"),
    ("window_bool", (Q, KV, KV), dict(window=(True, False)), r"window"),
    ("unknown_implementation", (Q, KV, KV), dict(implementation="cuda"), r"implementation"),
]


@pytest.mark.parametrize("args,kwargs,regex", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
@pytest.mark.parametrize("implementation", [None, "xla", "triton"])
def test_bad_input_raises_value_error(args, kwargs, regex, implementation):
  kwargs = {"implementation": implementation, **kwargs}
  with pytest.raises(ValueError, match=regex):
    flash_attention(*args, **kwargs)


def test_unsupported_head_dim_raises_not_implemented(pallas_backend):
  q, kv = _arr((1, 8, 2, 512)), _arr((1, 8, 1, 512), seed=1)
  with pytest.raises(NotImplementedError, match=r"head_dim|head dim"):
    flash_attention(q, kv, kv, implementation=pallas_backend)


VALID_CALLS = [
    Case(t=8, s=8, h=512, n=2, kh=1, b=1, dtype="float32"),         # no Pallas backend serves it
    Case(t=20, s=33, h=64, causal=True),
    Case(t=20, s=33, h=8, n=4, kh=4, dtype="float32"),             # tiny head dim
    Case(t=40, s=24, h=64, window=(3, 2), softcap=10.0, segments=2, kv_lengths=(0, 24)),
    Case(t=1, s=1, h=32, n=3, kh=1, b=1),
]


@pytest.mark.parametrize("case", VALID_CALLS, ids=lambda c: c.id)
def test_dispatch_none_serves_valid_calls(case):
  """implementation=None never fails on a valid call and matches the reference."""
  x, hi, lo = H.case_data(case)
  res = H.runner(case, implementation=None)(x)
  H.assert_dtypes(case, res)
  H.assert_ratio_rule(res, hi, lo, case.dtype, what=f"implementation=None {case.id}")


def test_numpy_scalars_are_accepted_and_a_config_does_not_stop_dispatch():
  """NumPy scalars are as good as Python ones for scale / softcap / window; with
  implementation=None a Pallas Config does not make the last resort ("xla") decline, so the
  call is still served (audit, session 23)."""
  from pallas_attn.triton import Config as TritonConfig
  x = jax.random.normal(jax.random.key(0), (1, 16, 2, 32), jnp.float32)
  want = flash_attention(x, x, x, scale=0.5, softcap=20.0, window=(3, 0), implementation="xla")
  got = flash_attention(x, x, x, scale=np.float32(0.5), softcap=np.float64(20.0),
                        window=(np.int64(3), 0), implementation="xla")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  if not jax.default_backend() == "gpu":
    served = flash_attention(x, x, x, config=TritonConfig())
    np.testing.assert_allclose(np.asarray(served), np.asarray(flash_attention(x, x, x)))


def test_dispatch_order():
  import pallas_attn
  order = pallas_attn.default_order()
  assert order[-1] == "xla"
  if jax.default_backend() != "gpu":
    assert order == ("xla",), "on CPU only the reference is dispatched to automatically"


def test_xla_backend_ignores_interpret_and_equals_reference():
  q, kv = _arr((2, 10, 4, 32)), _arr((2, 12, 2, 32), seed=1)
  # The xla backend is the reference with float32 products kept in float32 (and, for float32
  # inputs, HIGHEST precision: XLA:GPU would otherwise use TF32).
  ref = reference.attention(q, kv, kv, causal=True, accumulate_f32=True,
                            precision=jax.lax.Precision.HIGHEST)
  got = flash_attention(q, kv, kv, causal=True, implementation="xla", interpret=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))

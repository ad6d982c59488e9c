"""2^x on the FMA pipe (``fastexp``) and the forward that uses it (``Config.exp2_poly_cols``).

The polynomial is checked against ``jnp.exp2`` over the softmax's whole input range; the forward
with part of its exponentials on the polynomial runs in interpret mode against the reference and
against the same forward without it; the compiled form is lowered for sm90 on CPU.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness as H
from pallas_attn import flash_attention, reference
from pallas_attn.mosaic import Config, default_config, fastexp


def _rel_err(out, ref):
  return float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))


def test_exp2_poly_relative_error_over_the_softmax_range():
  # Every float32 spacing near 0 (f close to +-1/2 and to 0) and a dense sweep to -125.
  x = jnp.concatenate([-jnp.linspace(0.0, 125.0, 1_000_001, dtype=jnp.float32),
                       jnp.array([-0.0, -1e-30, -0.49999997, -0.5, -0.50000006, -1.5],
                                 jnp.float32)])
  got = np.asarray(jax.jit(fastexp.exp2_poly)(x), np.float64)   # jit: nothing folds the rounding
  want = np.exp2(np.asarray(x, np.float64))
  rel = np.abs(got - want) / want
  assert rel.max() < 8e-5                     # the degree-3 fit's bound, 7.5e-5, plus rounding
  assert got[0] == pytest.approx(1.0, rel=1e-4)


def test_exp2_poly_far_below_the_max_is_tiny_and_not_negative():
  x = jnp.array([-126.0, -200.0, -1e4, -3e38], jnp.float32)
  got = np.asarray(fastexp.exp2_poly(x))
  assert np.all(np.isfinite(got)) and np.all(got >= 0) and np.all(got <= 2.0 ** -125)


@pytest.mark.parametrize("poly_cols", [0, 8, 48, 64, 128])
def test_exp2_split_matches_exp2(poly_cols):
  x = -jnp.abs(jax.random.normal(jax.random.key(0), (64, 64), jnp.float32)) * 20
  got = fastexp.exp2_split(x, poly_cols)
  np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.exp2(x)), rtol=1e-4, atol=0)
  if poly_cols == 0:
    assert jnp.array_equal(got, jnp.exp2(x))   # off means untouched


def test_config_takes_multiples_of_eight():
  assert Config().exp2_poly_cols == 0
  assert Config(exp2_poly_cols=64).exp2_poly_cols == 64
  for bad in (-8, 12):
    with pytest.raises(ValueError, match="exp2_poly_cols"):
      Config(exp2_poly_cols=bad)


# One batch row (no mask here differs between rows; the interpreter's cost grows with batch x
# heads x tiles); GQA (4 heads over 2) once, one k/v head elsewhere.
@pytest.mark.parametrize("t,s,n,kh,h,poly_cols,kw", [
    (256, 256, 4, 2, 64, 64, dict()),                             # every column on the FMA pipe
    (200, 300, 2, 1, 64, 32, dict(causal=True)),                  # masked + unmasked blocks
    (130, 190, 2, 1, 128, 16, dict(window=(70, 20), softcap=15.0)),   # S off the block
], ids=["full_all_poly", "causal_half", "window_softcap_h128"])
def test_forward_with_poly_exponentials_matches_reference_in_interpret_mode(t, s, n, kh, h,
                                                                           poly_cols, kw):
  q, k, v = H.qkv_inputs(1, t, s, n, kh, h)
  cfg = Config(block_kv=64, exp2_poly_cols=poly_cols)
  out, lse = flash_attention(q, k, v, implementation="mosaic", config=cfg, interpret=True,
                             return_lse=True, **kw)
  f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
  ref, ref_lse = reference.attention(*f32, precision=jax.lax.Precision.HIGHEST, return_lse=True,
                                     **kw)
  assert _rel_err(out, ref) < 1e-2
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-3)
  base = flash_attention(q, k, v, implementation="mosaic", config=Config(block_kv=64),
                         interpret=True, **kw)
  # The polynomial's 8e-5 relative error is far below P's bf16 rounding: the outputs agree to
  # about one bf16 rounding of O.
  assert _rel_err(out, base.astype(jnp.float32)) < 8e-3


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_poly_exponentials_lower_for_sm90(causal):
  """Compiled form: the column split is a register slice of the wgmma layout (8-column tiles),
  so it must lower, and it must change the kernel."""
  base = default_config(head_dim=64, seq_k=1024, masked=causal)
  lowered = lambda cols: H.lower_mosaic_forward(
      dataclasses.replace(base, exp2_poly_cols=cols), causal=causal)
  with_poly, without = lowered(64), lowered(0)
  assert "flash_attention_fwd" in with_poly
  assert with_poly != without

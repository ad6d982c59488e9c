"""The harness itself: the ratio rule accepts the references and rejects planted errors."""
from __future__ import annotations

import numpy as np
import pytest

import harness as H
from harness import Case

CASE = Case(t=40, s=60, h=32, n=4, kh=2, causal=True, kv_lengths=(60, 25), seed=11)
EMPTY = Case(t=50, s=20, h=32, n=2, kh=1, causal=True, seed=12)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_references_pass_their_own_rule(dtype):
  case = CASE.replace(dtype=dtype)
  _, hi, lo = H.case_data(case)
  H.assert_ratio_rule(lo, hi, lo, dtype, what="ref_lo as kernel")
  H.assert_ratio_rule(hi, hi, lo, dtype, what="ref_hi as kernel")


def _perturbed(res: dict, name: str, fn) -> dict:
  out = dict(res)
  a = np.array(np.asarray(res[name], np.float32))
  out[name] = fn(a)
  return out


@pytest.mark.parametrize("name", H.TENSORS)
def test_rule_rejects_errors(name):
  _, hi, lo = H.case_data(CASE)
  finite = np.isfinite(np.asarray(hi[name]))
  idx = tuple(np.argwhere(finite)[len(np.argwhere(finite)) // 2])

  def bump(a, by):
    a[idx] += by
    return a

  mag = float(np.abs(np.asarray(hi[name], np.float32)[finite]).max())
  # A single element off by 5% of the largest value breaks the max bound and CAP.
  with pytest.raises(AssertionError, match=rf"{name}: max\|kernel-ref_hi\|"):
    H.assert_ratio_rule(_perturbed(lo, name, lambda a: bump(a, 0.05 * mag)), hi, lo, "bfloat16")
  # A NaN breaks the finite pattern.
  with pytest.raises(AssertionError, match=rf"{name}: finite pattern differs"):
    H.assert_ratio_rule(_perturbed(lo, name, lambda a: bump(a, np.nan)), hi, lo, "bfloat16")
  # A small bias everywhere breaks the mean bound (but not CAP).
  diff = np.abs(np.asarray(lo[name], np.float64) - np.asarray(hi[name], np.float64))[finite]
  bias = 2 * (1.5 * float(diff.mean()) + H.noise(np.asarray(hi[name], np.float32), "bfloat16"))
  with pytest.raises(AssertionError, match=rf"{name}: mean\|kernel-ref_hi\|"):
    H.assert_ratio_rule(_perturbed(lo, name, lambda a: a + bias), hi, lo, "bfloat16")


def test_rule_checks_non_finite_values():
  _, hi, lo = H.case_data(EMPTY)
  lse = np.asarray(hi["lse"])
  assert np.isneginf(lse).any(), "EMPTY must have rows with no visible key"
  H.assert_ratio_rule(hi, hi, lo, "bfloat16")
  flipped = _perturbed(hi, "lse", lambda a: np.where(np.isneginf(a), np.inf, a))
  with pytest.raises(AssertionError, match=r"lse: non-finite values differ"):
    H.assert_ratio_rule(flipped, hi, lo, "bfloat16")
  nan = _perturbed(hi, "lse", lambda a: np.where(np.isneginf(a), np.nan, a))
  with pytest.raises(AssertionError, match=r"lse: non-finite values differ"):
    H.assert_ratio_rule(nan, nan, lo, "bfloat16")         # NaN never equals NaN


def test_noise_term():
  # bf16 spacing in [1, 2) is 2**-7: (1 + 0.3) - 0.3 rounds away from 1 by at most one spacing.
  r = np.linspace(-3, 3, 1001, dtype=np.float32)
  nz = H.noise(r, "bfloat16")
  assert 0 < nz <= 2 ** -6
  assert H.noise(r, "float32") <= 2 ** -22
  assert H.noise(np.full(4, -np.inf, np.float32), "float32") == 0.0


def test_generators():
  neg = Case(t=16, s=24, h=64, inputs="negative")
  x = H.make_inputs(neg)
  logits = H._logits64(np.asarray(x.q, np.float32), np.asarray(x.k, np.float32), neg)
  assert logits.max() <= -1e5 and logits.max() - logits.min() < 100
  heavy = Case(t=16, s=24, h=64, inputs="heavy")
  x = H.make_inputs(heavy)
  logits = H._logits64(np.asarray(x.q, np.float32), np.asarray(x.k, np.float32), heavy)
  assert 5e3 <= np.abs(logits).max() <= 2e4
  seg = H.segment_ids(np.random.default_rng(0), 50, 4, 2)
  assert seg.shape == (2, 50) and (np.diff(seg, axis=1) >= 0).all() and seg.max() == 3
  a, b = H.make_inputs(CASE), H.make_inputs(CASE)
  assert np.array_equal(np.asarray(a.q), np.asarray(b.q)), "inputs must be reproducible"
  assert str(a.q.dtype) == CASE.dtype and a.dlse.dtype == np.float32

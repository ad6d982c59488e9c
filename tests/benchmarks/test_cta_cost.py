"""``benchmarks/cta_cost.py``: a backward kernel's fixed cost per CTA from paired.py tables.

The fit recovers a known line, reads session 45's committed H100 table the way NOTES does
(~8-9 us a CTA for both backward kernels), and refuses tables it cannot read."""
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cta_cost  # noqa: E402  pylint: disable=wrong-import-position

S45 = ROOT / "benchmarks/results/attention/s45/fwdbwd/paired.json"


def test_fit_recovers_a_line():
  pts = [cta_cost.Point("r", "dq", 1, s, 7.5 + 1.25 * s, False) for s in (16, 64, 256)]
  a, b = cta_cost.fit(pts)
  assert a == pytest.approx(7.5) and b == pytest.approx(1.25)
  with pytest.raises(ValueError, match="two lengths"):
    cta_cost.fit(pts[:1])


def test_launch_shapes_of_the_defaults():
  # 4x4096x16x128: 64-row consumers, 128-row dQ CTAs over 64-key steps; 128-key dK/dV CTAs
  # over 64-query steps; both 2048 CTAs. 16x1024: the dK/dV kernel is persistent.
  assert cta_cost.launch_shape(4, 4096, 16, 128, "dq") == (2048, 64, False)
  assert cta_cost.launch_shape(4, 4096, 16, 128, "dkdv") == (2048, 64, False)
  assert cta_cost.launch_shape(16, 1024, 16, 128, "dkdv")[2]


def test_session_45_table():
  pts = cta_cost.points(json.loads(S45.read_text()), sms=132)
  assert {p.row for p in pts} == {"4x4096x16x128", "2x8192x16x128", "1x16384x16x128",
                                  "16x1024x16x128", "8x2048x16x128"}     # unmasked rows only
  for kernel, step_us in (("dq", 1.05), ("dkdv", 1.485)):
    a, b = cta_cost.fit([p for p in pts if p.kernel == kernel and not p.persistent])
    assert 6.0 < a < 12.0
    assert b == pytest.approx(step_us, rel=0.03)


def test_refuses_tables_it_cannot_read():
  with pytest.raises(ValueError, match="fwd\\+bwd"):
    cta_cost.points({"mode": "fwd", "rows": []}, sms=132)
  with pytest.raises(ValueError, match="--against"):      # ours on both sides
    cta_cost.points({"mode": "fwdbwd", "variant": "fold232", "rows": []}, sms=132)

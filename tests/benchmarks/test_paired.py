"""``benchmarks/paired.py``: two implementations in one jitted function, in a fixed order.

CPU: the pair's outputs equal each implementation run alone (the barrier changes no value),
and the lowered module carries the optimization barrier that keeps XLA from interleaving the
two implementations' kernels.
"""
import dataclasses
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import paired  # noqa: E402  pylint: disable=wrong-import-position


def _xla(causal):
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                      implementation="xla")


def _scaled(q, k, v):          # a second, different implementation: the order must show
  return 2.0 * _xla(False)(q, k, v)


@pytest.mark.parametrize("mode", ["fwd", "fwdbwd"])
def test_pair_outputs_match_each_alone(mode):
  keys = jax.random.split(jax.random.key(1), 4)
  data = tuple(jax.random.normal(kk, (1, 64, 2, 32), jnp.float32) for kk in keys)
  first, second = _xla(False), _scaled
  run = jax.jit(paired.in_order(first, second, mode))
  a, b = run(*data)
  want_a = jax.jit(paired._wrap(first, mode))(*data)   # pylint: disable=protected-access
  want_b = jax.jit(paired._wrap(second, mode))(*data)  # pylint: disable=protected-access
  assert len(a) == len(want_a) == (4 if mode == "fwdbwd" else 1)
  for got, want in zip(a + b, want_a + want_b):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(b[0]), 2.0 * np.asarray(a[0]), rtol=1e-6, atol=1e-6)
  text = jax.jit(paired.in_order(first, second, mode)).lower(*data).as_text()
  assert text.count("optimization_barrier") == 1


def test_split_goes_by_name_when_kernels_are_hoisted():
  # Session 39: in the peer-first order XLA hoisted our causal mask-table kernels ahead of the
  # peer's, so splitting by position gave the peer's time to us and the ratio read 0.001x.
  ours = ["mask_tables", "flash_fwd", "flash_dq", "flash_dkdv"]
  peer = ["cudnn_fprop", "cudnn_bprop"]
  launched = [("mask_tables", 0.01), ("cudnn_fprop", 1.0), ("cudnn_bprop", 2.0),
              ("flash_fwd", 0.9), ("flash_dq", 1.1), ("flash_dkdv", 1.4)]
  kernels = [{"kernel": n, "ms": ms} for n, ms in launched]
  first, second, unassigned = paired.split_kernels(kernels, peer, ours)
  assert first == pytest.approx(3.0) and second == pytest.approx(3.41) and unassigned == 0
  # A name both sides launch goes by position.
  shared = [{"kernel": "copy", "ms": 0.5}, {"kernel": "a", "ms": 1.0},
            {"kernel": "copy", "ms": 0.25}, {"kernel": "b", "ms": 2.0}]
  assert paired.split_kernels(shared, ["copy", "a"], ["copy", "b"]) == (1.5, 2.25, 0.0)


def test_replot_draws_the_ratios(tmp_path, monkeypatch):
  payload = {"mode": "fwdbwd", "peer": "cudnn", "preheat_s": 2.0, "meta": {},
             "rows": [{"shape": [1, 64, 2, 32], "causal": c, "ratio": r,
                       "ratio_by_order": [r - 0.002, r + 0.002]}
                      for c, r in ((False, 0.97), (True, 1.02))]
             + [{"shape": [1, 64, 2, 32], "causal": False, "error": "skipped"}]}
  src = tmp_path / "paired.json"
  src.write_text(json.dumps(payload))
  monkeypatch.setattr(sys, "argv", ["paired.py", "--out", str(tmp_path), "--replot", str(src)])
  assert paired.main() == 0
  assert (tmp_path / "paired.png").stat().st_size > 1000


def test_split_of_a_variant_goes_by_launch_order_per_name():
  # A variant of ours against the default: every name is launched by both sides. Hoisting
  # keeps each name's launches in order, so the n-th launch of a name is still attributable.
  names = ["mask_tables", "flash_fwd", "flash_dkdv"]
  launched = [("mask_tables", 0.01), ("mask_tables", 0.02), ("flash_fwd", 1.0),
              ("flash_dkdv", 2.0), ("flash_fwd", 0.5), ("flash_dkdv", 1.5)]
  kernels = [{"kernel": n, "ms": ms} for n, ms in launched]
  first, second, _ = paired.split_kernels(kernels, names, names)
  assert first == pytest.approx(3.01) and second == pytest.approx(2.02)
  # Two identical mask kernels merged into one by XLA count for the first side.
  merged = kernels[:1] + kernels[2:]
  assert paired.split_kernels(merged, names, names) == pytest.approx((3.01, 2.0, 0.0))
  # A name launched more often than both sides launch it alone belongs to neither.
  extra = kernels + [{"kernel": "flash_fwd", "ms": 1.0}, {"kernel": "scatter_fusion_3", "ms": 0.1}]
  assert paired.split_kernels(extra, names, names) == pytest.approx((3.01, 2.02, 1.1))


def test_split_matches_xla_fusions_across_programs_without_their_number():
  # Session 41, on the H100: XLA numbers fusions per program, so the lone programs'
  # "loop_pad_fusion" is "loop_pad_fusion_1" in the pair; that must not read as a third program.
  first, second = ["loop_pad_fusion", "flash_fwd"], ["loop_pad_fusion", "flash_fwd.2"]
  launched = [("loop_pad_fusion_1", 0.1), ("flash_fwd_1", 1.0), ("loop_pad_fusion_7", 0.2),
              ("flash_fwd.3", 2.0)]
  kernels = [{"kernel": n, "ms": ms} for n, ms in launched]
  assert paired.split_kernels(kernels, first, second) == pytest.approx((1.1, 2.2, 0.0))
  assert paired.canonical("input_scatter_fusion_3") == "input_scatter_fusion"
  assert paired.canonical("sm90_xmma_gemm_bf16") == "sm90_xmma_gemm_bf16"


def test_against_builds_our_variant_over_the_row_default():
  fns = paired.implementations(True, "tail", variant=("tail", {"stream_tail": True}),
                               head_dim=128, seq_k=4096)
  assert set(fns) == {"ours", "tail"}
  cfgs = {name: fn.__defaults__[0] for name, fn in fns.items()}   # the bound Config
  base = paired.default_config(head_dim=128, seq_k=4096, masked=True)
  assert cfgs["ours"] == base
  assert cfgs["tail"] == dataclasses.replace(base, stream_tail=True) != base
  with pytest.raises(TypeError):     # a field Config does not have fails before any device work
    paired.implementations(False, "x", variant=("x", {"no_such_field": 1}), head_dim=128,
                           seq_k=4096)


def test_main_with_against_records_the_variant(tmp_path, monkeypatch):
  # The CLI path without a GPU: timed_pair replaced by fixed kernel times (first side 2 ms,
  # second 1 ms), so both orders give the variant's time over the default's as 0.5 and 2.
  seen = []

  def fake_pair(first, second, args, **_):
    seen.append((first, second))
    return {"first_ms": 2.0, "second_ms": 1.0}
  monkeypatch.setattr(paired, "timed_pair", fake_pair)
  monkeypatch.setattr(paired, "plot", lambda payload, path: None)
  monkeypatch.setattr(sys, "argv", ["paired.py", "--out", str(tmp_path), "--rows", "1x256x2x64",
                                    "--causal", "1", "--against", "r232:bwd_registers=232"])
  assert paired.main() == 0
  payload = json.loads((tmp_path / "paired.json").read_text())
  assert payload["peer"] == "r232" and payload["variant"] == {"bwd_registers": 232}
  (row,) = payload["rows"]
  assert row["causal"] and row["ratio_by_order"] == [0.5, 2.0] and row["ratio"] == 1.25
  (ours, variant), (variant2, ours2) = seen   # ours first, then the variant first
  assert ours is ours2 and variant is variant2
  assert variant.__defaults__[0].bwd_registers == 232


class _NoSampler:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False

  def summary(self, skip_s=0.0):   # pylint: disable=unused-argument
    return {}


@pytest.mark.parametrize("glue_ms", [0.01, 0.2])
def test_timed_pair_tolerates_a_little_unassigned_glue(monkeypatch, glue_ms):
  # CUPTI faked on the CPU: each side alone launches one kernel, the pair launches both and a
  # fusion neither has alone; up to 1% of the pair's time it is recorded, above it raises.
  lists = iter([[{"kernel": "a_kernel", "ms": 1.0}], [{"kernel": "b_kernel", "ms": 1.0}],
                [{"kernel": "a_kernel", "ms": 1.0}, {"kernel": "input_scatter_fusion_3",
                                                      "ms": glue_ms},
                 {"kernel": "b_kernel", "ms": 2.0}]])
  monkeypatch.setattr(paired.timing, "kernel_breakdown", lambda fn, args, iterations: next(lists))
  data = tuple(jnp.ones((1, 16, 1, 8), jnp.float32) for _ in range(4))
  call = lambda: paired.timed_pair(_xla(False), _scaled, data, mode="fwd", preheat=0.0,
                                   iterations=1, sampler=_NoSampler())
  if glue_ms > 0.01 * 3.0:
    with pytest.raises(ValueError, match="belong to neither side"):
      call()
    return
  got = call()
  assert (got["first_ms"], got["second_ms"], got["unassigned_ms"]) == (1.0, 2.0, glue_ms)
  assert got["max_abs_diff"][0] > 0      # the second side is twice the first

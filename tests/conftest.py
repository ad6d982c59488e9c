"""CI's sample of the slowest interpret-mode grids.

Pallas interpret mode runs a Mosaic GPU kernel as a Python-level simulation, 10-80 s a case on
CI's 2 cores. ``make test`` (and so CI) runs ``pytest -m "not slow"``; ``make test-all`` runs
everything. This file is the one place that says which cases CI skips: for each test listed in
``SAMPLED`` the cases it keeps (by parameter id, or by a rule over the item), and every other
case of that test is marked ``slow``; a test in ``LEFT_OUT`` is marked whole. A test not listed
here is never marked. The tests sampled are those of opt-in forms (fused dQ, split rings, three
consumers, ...) and lowering checks that repeat one config under several masks; what stays
covers each form at least once, under a mask case that combines several features (causal or
window, softcap, segments, kv_lengths, GQA, padded head dims); the shared suite
(``test_attention.py``) covers every mask feature on the default forms.
The forms' compiled tests (``-m gpu``, cheap there) run on the GPU machine. A listed test of
which no case is kept (an id renamed, say) stops the collection, so that a form cannot drop out
of CI unnoticed. Measured on CI (session 18): 3384 s of test time before the
sample (pytest 29 min on 2 workers); the slow cases are ~950 s of it. Session 20: CI hosts had
become ~1.6x slower (pytest 37-44 min), so the forms that kept two mask cases (split backward,
lazy rescale, three consumers, sum in PV) now keep one: ~250 s of worker time less. Session 21:
the persistent and dynamic-schedule forward checks likewise keep one case each (~25 s).
Session 23 (the FP8 forward's tests added ~250 s of worker time; CI was at 29-30 min): the fused
dQ forms keep the fastest one (``dq_lag``), narrow-swizzle blocks and the H = 256 persistent O
chunks one case each, jit-vs-eager its Triton and xla cases (vmap still runs Mosaic), and two
opt-in forms' second interpret checks leave CI (~250 s).
"""
from __future__ import annotations

import os
import pathlib

import pytest

_HERE = pathlib.Path(__file__).parent

# Compiled runs: XLA's GEMM autotuning of the float32 references (every case has its own shapes)
# was most of a compiled case's wall time. A sample of six mosaic grid cases took 66 s with it and
# 15 s without, same passes; the whole mosaic grid (266 cases) then ran in 214 s on one H100
# (session 31, benchmarks/results/compiled_tests/s31/). The references' speed does not matter and
# their float32 results differ between GEMM algorithms only by rounding, far inside the ratio
# rule's tolerance. XLA reads the flag when the GPU backend starts, after this file is
# imported; a flag the caller set wins. No effect on CPU.
_FLAGS = os.environ.get("XLA_FLAGS", "")
if "--xla_gpu_autotune_level" not in _FLAGS:
  os.environ["XLA_FLAGS"] = f"{_FLAGS} --xla_gpu_autotune_level=0".strip()


def _rotate(item) -> bool:
  """Lowering checks of N configs x C mask cases: keep config i on case i mod C, so every config
  and every case still lowers at least once."""
  params, module = item.callspec.params, item.module
  if "cfg_name" in params:                     # the backward's configs on LOWER_CASES[:3]
    configs, cases, name = module.BWD_CONFIGS, module.LOWER_CASES[:3], params["cfg_name"]
  else:
    configs, cases, name = module.FORMS, module.LOWER_CASES, params["form"]
  case = cases.index((params["h"], params["kw"]))
  return case == list(configs).index(name) % len(cases)


SAMPLED: dict = {
    "pallas_attn/test_mosaic_config.py::test_fused_dq_backward_matches_reference_in_interpret_mode":
        {"dq_lag-h64_alternate_steps-full"},
    "pallas_attn/test_mosaic_config.py::"
    "test_backward_tiles_differ_between_dq_and_dkdv_in_interpret_mode":
        {"window_softcap"},
    "pallas_attn/test_mosaic_config.py::"
    "test_tuned_persistent_forward_matches_reference_in_interpret_mode":
        {"10tiles-window_softcap"},
    "pallas_attn/test_mosaic_config.py::test_dynamic_schedule_matches_reference_in_interpret_mode":
        {"window_softcap-10tiles"},
    "pallas_attn/test_mosaic_config.py::test_compiled_backward_lowers_for_sm90": _rotate,
    "pallas_attn/test_mosaic_config.py::test_compiled_form_lowers_for_sm90": _rotate,
    "pallas_attn/test_mosaic_backward_split.py::"
    "test_split_backward_matches_reference_in_interpret_mode":
        {"causal_softcap"},
    "pallas_attn/test_mosaic_lazy_rescale.py::"
    "test_lazy_forward_matches_reference_in_interpret_mode":
        {"h256_growing"},
    "pallas_attn/test_mosaic_consumers.py::test_three_consumers_match_reference_in_interpret_mode":
        {"causal_kvlen_h128"},
    "pallas_attn/test_mosaic_dq_rings.py::test_split_rings_match_reference_in_interpret_mode":
        {"window_softcap"},
    "pallas_attn/test_mosaic_sum_in_pv.py::test_sum_in_pv_is_bitwise_the_default_in_interpret_mode":
        {"window_softcap_kvlen_h128"},
    "pallas_attn/test_mosaic_fastexp.py::"
    "test_forward_with_poly_exponentials_matches_reference_in_interpret_mode":
        {"window_softcap_h128"},
    "pallas_attn/test_mosaic_blocks.py::"
    "test_narrow_swizzle_blocks_match_the_reference_in_interpret_mode":
        {"96-window_softcap_kvlen_h128"},
    "pallas_attn/test_mosaic_blocks.py::"
    "test_persistent_head_dim_256_stores_o_in_chunks_in_interpret_mode":
        {"causal"},
    # Session 45 (CI at 24 of its 30 minutes): two opt-in forms that measured no faster keep one
    # case per test: the ring's free-first order and the backward kernels' Stream-K tails.
    "pallas_attn/test_mosaic_free_first.py::test_close_to_the_default_order_in_interpret_mode":
        {"window1"},
    "pallas_attn/test_mosaic_free_first.py::test_matches_reference_in_interpret_mode":
        {"T200S300-H64-4:2-B2-bf16-causal-seg2-len300,170-seed871"},
    "pallas_attn/test_mosaic_stream_tail.py::"
    "test_backward_tail_same_outside_close_inside_in_interpret_mode":
        {"256-640-2-1-1"},
    "pallas_attn/test_mosaic_stream_tail.py::"
    "test_dq_tail_same_outside_close_inside_in_interpret_mode":
        {"640-256-1-1"},
    "pallas_attn/test_transforms.py::test_jit_matches_eager":
        {"T72S100-H64-4:2-B2-bf16-causal-len100,37-seed3-triton",
         "T72S100-H64-4:2-B2-bf16-causal-len100,37-seed3-xla"},
}


# Single tests CI leaves out whole, each with what still covers it there.
LEFT_OUT: dict = {
    "pallas_attn/test_mosaic_grid_order.py::"
    "test_seq_major_gradients_are_bitwise_equal_in_interpret_mode":
        "~65 s; the forward's interpret check stays, the compiled -m gpu test covers gradients",
    "pallas_attn/test_mosaic_v_stages.py::test_split_rings_match_plain_forward_in_interpret_mode":
        "~35 s; an opt-in measured slower: the persistent split-ring interpret test stays",
    "pallas_attn/test_mosaic_consumers.py::"
    "test_three_consumer_forward_feeds_the_backward_in_interpret_mode":
        "~30 s; the three-consumer forward's own interpret check stays",
}


def _key(item) -> str:
  path = pathlib.Path(str(item.path)).resolve().relative_to(_HERE.resolve())
  return f"{path.as_posix()}::{getattr(item, 'originalname', item.name)}"


def kept_by_ci(item) -> bool:
  """Whether ``make test`` runs this item (False: marked ``slow``)."""
  if _key(item) in LEFT_OUT:
    return False
  rule = SAMPLED.get(_key(item))
  if rule is None:
    return True
  if callable(rule):
    return rule(item)
  return item.callspec.id in rule


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  seen, kept = set(), set()
  for item in items:
    key = _key(item)
    seen.add(key)
    if kept_by_ci(item):
      kept.add(key)
    else:
      item.add_marker(pytest.mark.slow)
  lost = sorted((seen - kept) & set(SAMPLED))
  if lost and not config.getoption("keyword"):   # (-k may select only sampled-out cases)
    raise pytest.UsageError(f"tests/conftest.py keeps no case of {lost}: update SAMPLED")

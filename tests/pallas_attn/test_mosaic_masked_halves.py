"""``Config.bwd_masked_halves``: masked 128-query dK/dV steps run as two 64-query halves.

The halves take the same inputs as the whole step (one Q / dO slot, the step's lse and D) and
add the same products to dK and dV, split over the queries; only the masked steps change, so
the mask-free loop is the 128-wide one. Checked here: gradients against the reference under the
ratio rule in interpret mode (causal with segment ids and kv_lengths, window with softcap, GQA,
T and S off the tiles), closeness to the whole-step form, the flag's scope in the statics,
sm90 lowering of the compiled form, and compiled runs on the GPU.
"""
import dataclasses

import jax
import numpy as np
import pytest

import harness as H
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, default_config

PAIR = dict(bwd_dkdv_block_q=128, bwd_dq_block_kv=128, bwd_early_stats="",
            bwd_persistent=False)

CASES = [
    H.Case(t=200, s=300, n=4, kh=2, h=64, causal=True, segments=2, kv_lengths=(300, 170),
           seed=841),
    H.Case(t=300, s=200, n=2, kh=1, h=64, window=(70, 10), softcap=20.0, seed=842),
    H.Case(t=256, s=256, n=4, kh=4, h=64, causal=True, seed=843),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_reference_in_interpret_mode(case):
  H.check_mosaic_default_with(case, bwd_masked_halves=True, **PAIR)


def test_close_to_the_whole_step_in_interpret_mode():
  """Same products split over the queries: the gradients differ from the whole 128-query
  step's only by the order of float32 additions (and the bf16 rounding that follows)."""
  q, k, v = H.qkv_inputs(2, 256, 256, 4, 2, 64, seed=844)
  do = jax.random.normal(jax.random.key(845), q.shape, q.dtype)

  def grads(halves):
    cfg = Config(backward="mosaic", bwd_masked_halves=halves, **PAIR)
    f = lambda q, k, v: flash_attention(q, k, v, causal=True, implementation="mosaic",
                                        config=cfg, interpret=True)
    out, vjp = jax.vjp(f, q, k, v)
    return [out, *vjp(do)]
  for a, b, name in zip(grads(True), grads(False), ("out", "dq", "dk", "dv")):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.max(np.abs(a - b)) <= 0.02 * np.max(np.abs(b)), name
    if name in ("out", "dq"):                   # the forward and the dQ kernel are untouched
      assert np.array_equal(a, b), name


def test_the_flag_reaches_the_dkdv_statics():
  assert H.dkdv_statics(Config(bwd_masked_halves=True, bwd_dkdv_block_q=128)).masked_halves
  assert not H.dkdv_statics(Config(bwd_dkdv_block_q=128)).masked_halves


def test_lowers_for_sm90():
  """The compiled form (register P^T, in-place accumulators) lowers for sm90 on a CPU host."""
  cfg = dataclasses.replace(default_config(head_dim=64, seq_k=512, masked=True),
                            bwd_masked_halves=True, bwd_registers=240, **PAIR)
  assert "flash_attention_dkdv" in H.lower_mosaic_backward(cfg, h=64)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [
    H.Case(t=2048, s=2048, n=4, kh=2, h=64, causal=True, seed=846),
    H.Case(t=1000, s=1500, n=4, kh=1, h=64, window=(300, 0), seed=847)], ids=lambda c: c.id)
def test_matches_reference_compiled(case):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  H.check_mosaic_default_with(case, bwd_masked_halves=True, bwd_registers=240, **PAIR)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    H.Case(t=512, s=512, n=4, kh=2, h=64, causal=True, seed=848),         # from 512 keys
    H.Case(t=1000, s=1536, n=4, kh=1, h=64, window=(300, 0), seed=849),   # dQ: 64-key steps
    H.Case(t=600, s=640, n=2, kh=2, h=64, window=(100, 20), softcap=30.0, segments=2,
           seed=850),
    # over 4096 keys: the windowed forward's 128-key persistent form (session 36)
    H.Case(t=4200, s=4500, n=2, kh=1, h=64, window=(700, 0), seed=851)],
    ids=lambda c: c.id)
def test_defaults_compiled(case):
  """The defaults that carry the halves since session 35 (causal and windowed H = 64 calls from
  512 keys), run as the library runs them, against the reference."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  cfg = H.mosaic_default_config(case)
  assert cfg.bwd_masked_halves and cfg.bwd_dkdv_block_q == 128
  H.check_mosaic_default_with(case)

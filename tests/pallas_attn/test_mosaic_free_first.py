"""``Config.bwd_free_first``: the grid dK/dV kernel visits a tile's mask-free Q blocks first.

The producer's ring and the consumers' loops take each head's blocks in the order [lo, hi)
rotated to start at the first mask-free block (then the masked high end, then the masked low
end), so only the order of dK's and dV's float32 additions changes. Checked here: gradients
against the reference under the ratio rule in interpret mode (causal with segment ids and
kv_lengths, window with softcap, GQA, T and S off the tiles), closeness to the default order
(out and dQ bitwise: other kernels), the flag's scope in the statics, and sm90 lowering of the
compiled form.
"""
import dataclasses

import jax
import numpy as np
import pytest

import harness as H
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, default_config

CASES = [
    H.Case(t=200, s=300, n=4, kh=2, h=64, causal=True, segments=2, kv_lengths=(300, 170),
           seed=871),
    H.Case(t=300, s=200, n=2, kh=1, h=128, window=(70, 10), softcap=20.0, seed=872),
    H.Case(t=256, s=256, n=4, kh=4, h=64, causal=True, seed=873),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_reference_in_interpret_mode(case):
  H.check_mosaic_default_with(case, bwd_free_first=True, bwd_persistent=False)


@pytest.mark.parametrize("window", [None, (96, 32)])
def test_close_to_the_default_order_in_interpret_mode(window):
  """Same products in another order: dK and dV differ from the default's by float32
  reordering only; the forward and the dQ kernel are untouched (bitwise)."""
  q, k, v = H.qkv_inputs(2, 256, 256, 4, 2, 64, seed=874)
  do = jax.random.normal(jax.random.key(875), q.shape, q.dtype)

  def grads(free_first):
    cfg = Config(backward="mosaic", bwd_free_first=free_first)
    f = lambda q, k, v: flash_attention(q, k, v, causal=window is None, window=window,
                                        implementation="mosaic", config=cfg, interpret=True)
    out, vjp = jax.vjp(f, q, k, v)
    return [out, *vjp(do)]
  for a, b, name in zip(grads(True), grads(False), ("out", "dq", "dk", "dv")):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.max(np.abs(a - b)) <= 0.02 * np.max(np.abs(b)), name
    if name in ("out", "dq"):
      assert np.array_equal(a, b), name


def test_the_flag_reaches_the_dkdv_statics():
  assert H.dkdv_statics(Config(bwd_free_first=True)).free_first
  assert not H.dkdv_statics(Config()).free_first


def test_lowers_for_sm90():
  """The compiled form (register P^T, in-place accumulators) lowers for sm90 on a CPU host."""
  cfg = dataclasses.replace(default_config(head_dim=128, seq_k=512, masked=True),
                            bwd_free_first=True)
  assert "flash_attention_dkdv" in H.lower_mosaic_backward(cfg, h=128)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [
    H.Case(t=2048, s=2048, n=4, kh=2, h=128, causal=True, seed=876),
    H.Case(t=1000, s=1500, n=4, kh=1, h=128, window=(300, 0), seed=877),
    H.Case(t=600, s=640, n=2, kh=2, h=128, causal=True, segments=2, kv_lengths=(640, 300),
           seed=878)], ids=lambda c: c.id)
def test_matches_reference_compiled(case):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  H.check_mosaic_default_with(case, bwd_free_first=True, bwd_persistent=False)

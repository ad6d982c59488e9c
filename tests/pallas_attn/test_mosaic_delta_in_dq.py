"""``Config.bwd_delta_in_dq``: D = rowsum(dO * O) - dlse computed by the dQ kernel's consumers.

The two-kernel backward otherwise runs a pre-pass kernel over dO and O for D (~0.04 ms per 2^25
elements each, 3-5% of fwd+bwd at 16x1024x16x128). With the flag each dQ consumer loads its O
tile once beside Q and dO, forms D for its rows, uses it, and TMA-writes the finished [L2, D]
record that the dK/dV kernel then reads. Served only where O's buffer fits next to the dQ
kernel's full rings (H <= 128); at H = 256 the pre-pass stays.
"""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import harness as H
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, default_config, ops


def _statics(h, *, flag=True, segments=False):
  q = jnp.zeros((1, 512, 2, h), jnp.bfloat16)
  seg = jnp.zeros((1, 512), jnp.int32) if segments else None
  return ops._backward_statics(q, q, seg, None, causal=True, scale=1.0, window=None,
                               softcap=None, cfg=Config(bwd_delta_in_dq=flag),
                               interpret=False)[0]


@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("segments", [False, True], ids=["plain", "segments"])
def test_served_at_h128_and_below_without_costing_ring_slots(h, segments):
  with_d, without = _statics(h, segments=segments), _statics(h, flag=False, segments=segments)
  assert with_d.delta_in_dq and not without.delta_in_dq
  assert (with_d.num_stages, with_d.v_ring) == (without.num_stages, without.v_ring)
  assert ops.dq_smem_bytes(st=with_d, head_dim=h) <= ops.SMEM_LIMIT_BYTES
  assert (ops.dq_smem_bytes(st=with_d, head_dim=h) - ops.dq_smem_bytes(st=without, head_dim=h)
          == 2 * 64 * h * 2)                       # one bf16 O tile per consumer


def test_not_served_at_h256():
  """Its dQ kernel already fills shared memory (two K slots and one V slot): the pre-pass."""
  assert not _statics(256).delta_in_dq


def _kernel_names(cfg, h=64):
  q = jnp.ones((1, 128, 2, h), jnp.bfloat16)
  f = jax.grad(lambda q: flash_attention(q, q, q, implementation="mosaic", config=cfg,
                                         interpret=True).astype(jnp.float32).sum())
  return str(jax.make_jaxpr(f)(q))


def test_no_pre_pass_kernel():
  base = dataclasses.replace(default_config(head_dim=64, seq_k=128, masked=False),
                             bwd_delta_in_dq=False)
  assert "flash_attention_delta" in _kernel_names(base)
  assert "flash_attention_delta" not in _kernel_names(
      dataclasses.replace(base, bwd_delta_in_dq=True))


# GQA, T and S off the tiles, every mask kind, and lse's cotangent (the harness's dlse): D must
# take -dlse as well.
CASES = [
    H.Case(t=150, s=130, n=4, kh=2, h=64, causal=True, segments=2, kv_lengths=(130, 57),
           seed=701),
    H.Case(t=100, s=200, n=2, kh=1, h=128, window=(30, 5), softcap=20.0, seed=702),
    H.Case(t=65, s=63, n=2, kh=2, h=96, seed=703),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_reference_in_interpret_mode(case):
  H.check_mosaic_default_with(case, bwd_delta_in_dq=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [H.Case(t=1024, s=1024, n=4, kh=4, h=128, causal=True,
                                                 seed=704)], ids=lambda c: c.id)
def test_matches_reference_compiled(case):
  H.check_mosaic_default_with(case, bwd_delta_in_dq=True)

"""The dQ kernel with a V ring shallower than its K ring (``Statics.v_stages``).

At H = 256 two K/V slots do not fit next to both consumers' Q and dO (128 KB), and with one the
K/V loads never overlapped the matmuls (session 16: the dQ kernel at 378 TFLOP/s against the
split dK/dV kernel's 639). Two K slots and one V slot fit: ``ops._backward_statics`` tries that
before giving up a K slot. Interpret mode runs it at a small head dim (the fit is forced there:
the interpreter stages dS through SMEM, so at H = 256 only one slot fits in interpret mode).
"""
import jax.numpy as jnp
import pytest

import harness as H
from pallas_attn.mosaic import Config, backward_dq, ops


def _statics(h, *, segments=False, interpret=False):
  q = jnp.zeros((1, 256, 2, h), jnp.bfloat16)
  seg = jnp.zeros((1, 256), jnp.int32) if segments else None
  return ops._backward_statics(q, q, seg, None, causal=True, scale=1.0, window=None,
                               softcap=None, cfg=Config(), interpret=interpret)


def test_rings_by_head_dim():
  """Compiled: H = 256 gets 2 K slots and 1 V slot inside the SMEM limit, except with segment
  ids (their buffers put it 1160 bytes over by Mosaic's count: one slot each, as before); H = 128
  and 64 keep equal two-slot rings (their kernels unchanged)."""
  st_dq, _ = _statics(256)
  assert (st_dq.num_stages, st_dq.v_ring, st_dq.v_stages) == (2, 1, 1)
  assert ops.dq_smem_bytes(st=st_dq, head_dim=256) <= ops.SMEM_LIMIT_BYTES
  assert ops.dq_compiler_params(st_dq) == dict(reduction_scratch_bytes=0)
  st_dq, _ = _statics(256, segments=True)
  assert (st_dq.num_stages, st_dq.v_ring) == (1, 1)
  for h in (64, 128):
    st_dq, _ = _statics(h)
    assert (st_dq.num_stages, st_dq.v_stages) == (2, 0)
    assert ops.dq_compiler_params(st_dq) == {}
  # Interpret mode stages dS through SMEM: one slot each at H = 256, as before.
  st_dq, _ = _statics(256, interpret=True)
  assert (st_dq.num_stages, st_dq.v_ring) == (1, 1)


@pytest.mark.parametrize("kw", [dict(causal=True, segments=True, kv_lengths=True),
                                dict(window=(30, 5), softcap=20.0)],
                         ids=["causal_seg_len", "window_softcap"])
def test_split_rings_match_reference_in_interpret_mode(kw, monkeypatch):
  """H = 64, GQA 4:2, T and S off the tiles, with the fit forced to 2 K slots and 1 V slot:
  every K/V block goes through both rings at different slots (several steps per CTA)."""
  real = ops.dq_smem_bytes
  monkeypatch.setattr(ops, "dq_smem_bytes", lambda *, st, head_dim: (
      real(st=st, head_dim=head_dim) if st.v_stages else ops.SMEM_LIMIT_BYTES + 1))
  seen = []
  real_kernel = backward_dq.dq_kernel
  monkeypatch.setattr(backward_dq, "dq_kernel",
                      lambda *a, **k: seen.append(k["st"]) or real_kernel(*a, **k))
  cfg = Config(block_kv=64, backward="mosaic")
  b = 2 if kw.get("kv_lengths") else 1  # the interpreter's time grows with b
  got, want = H.grads_against_reference(cfg, kw, b=b, t=150, s=330, n=4, kh=2, h=64, seed=5,
                                         segments=2, kv_len=201)
  assert seen and all((st.num_stages, st.v_ring) == (2, 1) for st in seen)
  for name, x, r in zip(("out", "dq", "dk", "dv"), got, want):
    err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
    assert err < 2e-2, (name, err)

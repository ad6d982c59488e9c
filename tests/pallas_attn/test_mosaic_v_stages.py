"""K and V rings of different depths in the Mosaic forward (``Config.v_stages``).

The ring depths only decide when the producer may refill a slot, never what a step computes, so
a forward with a deeper K ring (or a shallower V ring) must be bitwise equal to the plain one.
Checked in interpret mode (grid and persistent launches, masks that skip blocks, segment ids
that ride with K), with the float32 reference as a second witness; the compiled form by its
sm90 lowering and by the ratio rule on the GPU.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness as H
from pallas_attn import flash_attention, masks, reference
from pallas_attn.mosaic import Config, kernels, ops


def test_config_rejects_bad_v_stages():
  with pytest.raises(ValueError, match="v_stages"):
    Config(v_stages=5)
  with pytest.raises(ValueError, match="v_stages"):
    Config(v_stages=-1)
  with pytest.raises(ValueError, match="overlap"):
    Config(v_stages=1, overlap=True)
  assert Config(num_stages=3, v_stages=2).v_stages == 2


def test_smem_budget_at_h256():
  """Three 64-key K slots and two V slots fit next to Q at H = 256 (the point of the field);
  three of each do not."""
  st = kernels.Statics(scale=1.0, softcap=None,
                       spec=masks.MaskSpec(left=None, right=None, offset=0), has_kv_len=False, has_segments=False, groups=1, block_q=64, block_kv=64,
                       num_stages=3, num_kv_blocks=64, registers_pv=True, v_stages=2)
  assert st.v_ring == 2
  assert kernels.smem_bytes(st=st, head_dim=256, itemsize=2) <= ops.SMEM_LIMIT_BYTES
  both = dataclasses.replace(st, v_stages=0)
  assert kernels.smem_bytes(st=both, head_dim=256, itemsize=2) > ops.SMEM_LIMIT_BYTES


def _forward(cfg, q, k, v, kw):
  return flash_attention(q, k, v, implementation="mosaic", config=cfg, interpret=True,
                         return_lse=True, **kw)


@pytest.mark.parametrize("h,rings,kw", [
    (64, (3, 2), dict(causal=True, kv_lengths=True)),
    (64, (2, 1), dict(window=(40, 5), segments=True)),
    (64, (2, 3), dict(softcap=20.0)),
    (256, (2, 1), dict()),
], ids=["h64_k3v2_causal_len", "h64_k2v1_window_seg", "h64_k2v3_softcap", "h256_k2v1"])
def test_split_rings_match_plain_forward_in_interpret_mode(h, rings, kw):
  b, t, s, n, kh = 2, 140, 330, 4, 2
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h, seed=7)
  kw = H.flag_kwargs(kw, t=t, s=s)
  k_stages, v_stages = rings
  got = _forward(Config(block_kv=64, num_stages=k_stages, v_stages=v_stages), q, k, v, kw)
  plain = _forward(Config(block_kv=64, num_stages=2), q, k, v, kw)
  for name, x, y in zip(("out", "lse"), got, plain):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                  err_msg=name)
  out, lse = reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                 precision=jax.lax.Precision.HIGHEST, return_lse=True, **kw)
  fin = np.isfinite(np.asarray(lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(got[1])), fin)
  err = np.abs(np.asarray(got[0], np.float32) - np.asarray(out)).max()
  assert err < 2e-2 * max(1.0, float(np.abs(np.asarray(out)).max())), err


def test_split_rings_persistent_in_interpret_mode():
  """The persistent launch counts ring positions across tiles: with 3 K and 2 V slots a CTA's
  second tile starts mid-ring in each (different) ring."""
  b, t, s, n, kh, h = 1, 256, 192, 4, 4, 64
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h, seed=11)
  base = Config(block_kv=64, persistent=True)
  got = _forward(dataclasses.replace(base, num_stages=3, v_stages=2), q, k, v, {})
  plain = _forward(base, q, k, v, {})
  for name, x, y in zip(("out", "lse"), got, plain):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                  err_msg=name)


@pytest.mark.parametrize("cfg,h,causal", [
    (Config(block_kv=64, num_stages=3, v_stages=2), 256, False),
    (Config(block_kv=64, num_stages=3, v_stages=2, pin_softmax=True, named_free=True), 256, True),
    (Config(num_stages=3, v_stages=2, persistent=True), 128, False),
], ids=["h256_full", "h256_causal_named_free", "h128_persistent"])
def test_split_rings_lower_for_sm90(cfg, h, causal):
  text = H.lower_mosaic_forward(cfg, h=h, t=1024, causal=causal)
  assert "flash_attention_fwd" in text


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    H.Case(t=1000, s=1100, h=256, n=4, kh=2, seed=511),
    H.Case(t=1000, s=1100, h=256, n=4, kh=2, causal=True, seed=512),
    H.Case(t=600, s=900, h=128, n=4, kh=2, window=(100, 20), softcap=30.0, segments=2,
           kv_lengths=(900, 555), seed=513),
], ids=lambda c: c.id)
def test_split_rings_compiled(case):
  """Compiled on the GPU: the ratio rule (TESTING.md) with 3 K slots and 2 V slots."""
  H.check_mosaic_default_with(case, num_stages=3, v_stages=2)


@pytest.mark.parametrize("fields,lazy", [(dict(num_stages=3, v_stages=2), False),
                                         (dict(block_kv=80), False), (dict(), True)],
                         ids=["k3v2", "kv80", "default_rings"])
def test_lazy_rescale_gives_way_where_its_scratch_does_not_fit(monkeypatch, fields, lazy):
  """``lazy_rescale``'s warpgroup-wide max reduces across warps, so its kernels keep the 2 KB
  reduction scratch; at H = 256 with 3 K + 2 V slots or FA3's 80-key blocks (the masked
  default's lazy form on) that is over the limit, so the plain online softmax runs instead:
  the call lowers and the lazy step is never traced. With the default 2 + 2 rings it is."""
  traced = []
  lazy_step = kernels._exp_block_lazy
  monkeypatch.setattr(kernels, "_exp_block_lazy",
                      lambda *a, **k: (traced.append(1), lazy_step(*a, **k))[1])
  jax.clear_caches()
  cfg = dataclasses.replace(Config(block_kv=64, lazy_rescale=8.0, pin_softmax=True,
                                   named_free=True), **fields)
  text = H.lower_mosaic_forward(cfg, h=256, t=1024, causal=True)
  assert "flash_attention_fwd" in text
  assert bool(traced) == lazy

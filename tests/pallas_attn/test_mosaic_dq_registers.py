"""``Config.bwd_dq_registers``: the dQ kernel's consumer registers apart from the dK/dV kernel's,
and the causal H = 64 default (128-key dQ steps, 128-query dK/dV steps with masked halves, both
kernels at 240 registers since session 35; before it the dQ kernel alone took 240).

Checked here: the statics each kernel gets, the field's validation, which calls take which
registers by default, and compiled gradients of the causal default against the reference."""
import jax
import jax.numpy as jnp
import pytest

import harness as H
from pallas_attn.mosaic import Config, default_config, ops


def _statics(cfg, *, causal=True, window=None):
  q = jnp.zeros((1, 2048, 2, 64), jnp.bfloat16)
  return ops._backward_statics(q, q, None, None, causal=causal, scale=1.0, window=window,
                               softcap=None, cfg=cfg, interpret=False)


def test_each_kernel_gets_its_registers():
  st_dq, st_dkdv = _statics(Config(bwd_registers=232, bwd_dq_registers=240))
  assert (st_dq.consumer_registers, st_dkdv.consumer_registers) == (240, 232)
  st_dq, st_dkdv = _statics(Config(bwd_registers=240))            # 0: bwd_registers
  assert (st_dq.consumer_registers, st_dkdv.consumer_registers) == (240, 240)


def test_bad_value_raises():
  with pytest.raises(ValueError, match="bwd_dq_registers"):
    Config(bwd_dq_registers=248)


@pytest.mark.parametrize("kw,want", [
    # (dQ keys a step, bwd_registers, bwd_dq_registers, bwd_masked_halves)
    (dict(masked=True), (128, 240, 0, True)),               # H100 session 35: the halves
    (dict(masked=True, windowed=True), (64, 240, 0, True)),   # dQ 208 B spilled with 128 keys
    (dict(masked=True, key_masks=True), (128, 240, 0, False)),  # halves 1% slower (s35)
    (dict(masked=True, windowed=True, key_masks=True), (64, 240, 0, True)),
    (dict(masked=False, key_masks=True), (128, 240, 0, False)),
    (dict(masked=False), (128, 232, 0, False))])            # the unmasked pair, 232 for both
def test_default_config(kw, want):
  cfg = default_config(head_dim=64, seq_k=4096, **kw)
  got = (cfg.bwd_dq_block_kv, cfg.bwd_registers, cfg.bwd_dq_registers, cfg.bwd_masked_halves)
  assert got == want
  assert cfg.bwd_dkdv_block_q == 128                                 # with 128-query dK/dV
  # No default sets bwd_dq_registers since session 35 (the causal pair takes 240 for both
  # kernels). From 512 keys causal calls take the pair with halves; with key masks they keep
  # 64-wide steps under 1024 keys; under 512 every call does.
  short = default_config(head_dim=64, seq_k=512, masked=True)
  assert (short.bwd_dkdv_block_q, short.bwd_masked_halves) == (128, True)
  keyed = default_config(head_dim=64, seq_k=512, masked=True, key_masks=True)
  assert (keyed.bwd_dkdv_block_q, keyed.bwd_masked_halves) == (0, False)
  shorter = default_config(head_dim=64, seq_k=384, masked=True)
  assert (shorter.bwd_dkdv_block_q, shorter.bwd_masked_halves) == (0, False)
  assert default_config(head_dim=128, seq_k=4096, masked=True).bwd_dq_registers == 0


def test_causal_default_in_interpret_mode():
  # Interpret mode takes no register counts; this runs the 128-wide steps the default picks.
  case = H.Case(t=200, s=300, n=4, kh=2, h=64, causal=True, seed=821)
  H.check_mosaic_default_with(case, bwd_dq_block_kv=128, bwd_dq_registers=240,
                              bwd_dkdv_block_q=128, bwd_early_stats="")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    H.Case(t=2048, s=2048, n=4, kh=2, h=64, causal=True, seed=822),
    H.Case(t=1000, s=1536, n=4, kh=1, h=64, causal=True, softcap=30.0, seed=823)],
    ids=lambda c: c.id)
def test_causal_default_compiled(case):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  cfg = default_config(head_dim=64, seq_k=case.s, masked=True)
  assert (cfg.bwd_dq_block_kv, cfg.bwd_registers, cfg.bwd_masked_halves) == (128, 240, True)
  H.check_mosaic_default_with(case)

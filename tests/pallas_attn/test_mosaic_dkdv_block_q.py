"""``Config.bwd_dkdv_block_q``: the dK/dV kernel's queries per step apart from the dQ kernel's.

With it the two backward kernels tile T differently (dQ: 2 x ``bwd_block_q`` rows a CTA; dK/dV:
``bwd_dkdv_block_q`` queries a step), so T is padded to both, and the dQ kernel's grid, its
mask metadata and the D pre-pass keep the dQ kernel's rows. Checked here: the statics, then
the gradients against the reference under the ratio rule in interpret mode (T off both tiles,
causal with segments and kv_lengths, window with softcap, GQA, lse's cotangent), and compiled.
"""
import jax
import jax.numpy as jnp
import pytest

import harness as H
from pallas_attn.mosaic import Config, default_config, ops


def _statics(t, **fields):
  q = jnp.zeros((1, t, 2, 64), jnp.bfloat16)
  return ops._backward_statics(q, q, None, None, causal=True, scale=1.0, window=None,
                               softcap=None, cfg=Config(**fields), interpret=True)


def test_tiles_and_padding():
  st_dq, st_dkdv = _statics(200, bwd_dkdv_block_q=128)
  assert (st_dq.block_q, st_dkdv.block_q) == (64, 128)
  assert st_dkdv.num_kv_blocks * st_dkdv.block_q == 256     # T = 200 padded to 128 and 2 x 64
  st_dq, st_dkdv = _statics(200, bwd_block_q=128, bwd_dkdv_block_q=64)
  assert (st_dq.block_q, st_dkdv.block_q) == (128, 64)
  assert st_dkdv.num_kv_blocks * st_dkdv.block_q == 256
  st_dq, st_dkdv = _statics(200)                             # 0: the dQ kernel's rows
  assert (st_dq.block_q, st_dkdv.block_q, st_dkdv.num_kv_blocks) == (64, 64, 4)


def test_bad_value_raises():
  with pytest.raises(ValueError, match="bwd_dkdv_block_q"):
    Config(bwd_dkdv_block_q=96)


@pytest.mark.parametrize("seq_k,masked,key_masks,want", [
    (4096, False, False, (128, 128, "")),          # H100 session 32: fwd+bwd 0.92 -> 0.99x cuDNN
    (16384, False, False, (128, 128, "")),
    (4096, True, False, (128, 128, "")),           # causal: -2..-3% dK/dV (s32), halves (s35)
    (4096, False, True, (128, 128, "")),           # kv_lengths: 0.913 -> 0.99x (session 33)
    (4000, False, False, (128, 128, "")),          # keys padded to 128: masked, as kv_lengths
    (4096, True, True, (128, 128, "")),            # causal + kv_lengths: 0.96 -> 1.02x
    (1024, False, False, (128, 128, "")),          # persistent dK/dV: 0.93 -> 1.07x (s33)
    (1024, True, False, (128, 128, "")),           # causal: 0.93 -> 0.95x (session 33)
    (1000, False, False, (128, 128, "")),          # 512 keys unmasked: 1.06 -> 1.21x (s34)
    (512, False, False, (128, 128, "")),
    (512, False, True, (128, 128, "")),            # kv_lengths: as at 1024 (untimed)
    (512, True, False, (128, 128, "")),            # causal with halves: -1.4..-2.5% (s35)
    (512, True, True, (0, 64, "lse+delta")),       # causal + kv_lengths: no halves, 64-wide
    (384, False, False, (0, 64, "lse+delta"))])    # shorter rows: untimed, 64-wide steps
def test_default_config_h64_steps(seq_k, masked, key_masks, want):
  cfg = default_config(head_dim=64, seq_k=seq_k, masked=masked, key_masks=key_masks)
  assert (cfg.bwd_dkdv_block_q, cfg.bwd_dq_block_kv, cfg.bwd_early_stats) == want
  # Key masks (or padded keys on unmasked rows), 1024-key rows and causal calls (with masked
  # halves, session 35): 240 registers in both kernels (0 B spilled offline; ~100 B at 232
  # unmasked with key masks, 48 B at 1024; causal: the dK/dV kernel 484 B at 232).
  keyed = want[0] == 128 and (masked or key_masks or seq_k % 128 or seq_k <= 1024)
  assert cfg.bwd_registers == (240 if keyed else 232)
  assert cfg.bwd_masked_halves == (want[0] == 128 and masked and not key_masks)
  assert default_config(head_dim=128, seq_k=seq_k, masked=masked).bwd_dkdv_block_q == 0


CASES = [
    H.Case(t=200, s=130, n=4, kh=2, h=64, causal=True, segments=2, kv_lengths=(130, 57),
           seed=811),
    H.Case(t=100, s=200, n=2, kh=1, h=128, window=(30, 5), softcap=20.0, seed=812),
    H.Case(t=200, s=130, n=4, kh=2, h=64, seed=815),     # unmasked: the persistent dK/dV kernel
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_reference_in_interpret_mode(case):
  H.check_mosaic_default_with(case, bwd_dkdv_block_q=128)


def test_with_128_key_dq_steps_in_interpret_mode():
  # The unmasked H = 64 default's pair (both kernels' steps 128 wide); interpret mode ignores
  # bwd_early_stats. T = 200 pads to 256 queries, S = 300 to 384 keys.
  case = H.Case(t=200, s=300, n=4, kh=2, h=64, seed=817)
  H.check_mosaic_default_with(case, bwd_dkdv_block_q=128, bwd_dq_block_kv=128,
                              bwd_early_stats="", bwd_persistent=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    H.Case(t=2048, s=2048, n=4, kh=2, h=64, seed=818),
    H.Case(t=1000, s=1536, n=4, kh=1, h=64, softcap=30.0, seed=819),
    H.Case(t=1024, s=1024, n=4, kh=2, h=64, seed=836),               # the persistent dK/dV
    H.Case(t=1024, s=1024, n=4, kh=4, h=64, causal=True, seed=837)], ids=lambda c: c.id)
def test_h64_default_compiled(case):
  """Compiled, the unmasked H = 64 default (128-query dK/dV and 128-key dQ steps) itself."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  assert H.mosaic_default_config(case).bwd_dkdv_block_q == 128
  H.check_mosaic_default_with(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    H.Case(t=2048, s=2048, n=4, kh=2, h=64, kv_lengths=(2048, 1500), seed=831),
    H.Case(t=1000, s=2000, n=4, kh=1, h=64, segments=3, seed=832),
    H.Case(t=1000, s=1500, n=2, kh=2, h=64, seed=833),
    H.Case(t=2048, s=2048, n=4, kh=2, h=64, causal=True, kv_lengths=(2048, 1300), seed=835)],
    ids=lambda c: c.id)
def test_h64_key_masked_default_compiled(case):
  """Compiled, the same pair at 240 registers where keys are masked (kv_lengths, segment ids,
  keys padded to 128; causal with kv_lengths)."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  cfg = H.mosaic_default_config(case)
  assert (cfg.bwd_dkdv_block_q, cfg.bwd_registers) == (128, 240)
  H.check_mosaic_default_with(case)


def test_h64_key_masked_pair_in_interpret_mode():
  # kv_lengths and segment ids with both kernels' 128-wide steps (S = 300 pads to 384 keys).
  case = H.Case(t=200, s=300, n=4, kh=2, h=64, segments=2, kv_lengths=(300, 170), seed=834)
  H.check_mosaic_default_with(case, bwd_dkdv_block_q=128, bwd_dq_block_kv=128,
                              bwd_early_stats="", bwd_persistent=False, bwd_registers=240)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [
    H.Case(t=1024, s=1024, n=4, kh=4, h=64, seed=813),
    H.Case(t=1000, s=1024, n=4, kh=2, h=64, causal=True, seed=814)], ids=lambda c: c.id)
def test_matches_reference_compiled(case):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  H.check_mosaic_default_with(case, bwd_dkdv_block_q=128)

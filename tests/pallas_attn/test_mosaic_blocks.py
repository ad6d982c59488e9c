"""Mosaic forward tiles that fill shared memory to the limit (head dim 256):

* key blocks that are not multiples of 64 (FA3's 80 at head dim 256, 176 at 128), made possible
  by the narrower swizzle of the V ring and P (``operands.pv_swizzle``);
* the persistent launch with O stored through two 64-column slots per consumer
  (``Statics.o_chunked``) where a whole O buffer does not fit next to Q and the ring.

Interpret mode checks the arithmetic (masked and unmasked blocks, ragged S, segments,
kv_lengths, GQA); the compiled (sm90) form is lowered on CPU, which also runs Mosaic's own
shared-memory check (both fit only without Pallas's reduction scratch).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness as H
from pallas_attn import flash_attention, reference
from pallas_attn.mosaic import Config, default_config, kernels, operands, ops


@pytest.mark.parametrize("block_kv,swizzle", [(64, 128), (128, 128), (256, 128), (96, 64),
                                              (192, 128), (160, 64), (80, 32), (176, 32), (112, 32)])
def test_pv_swizzle_is_the_widest_row_that_divides_the_block(block_kv, swizzle):
  assert operands.pv_swizzle(block_kv, 2) == swizzle
  assert block_kv % (swizzle // 2) == 0


@pytest.mark.parametrize("block_kv", [48, 72, 100, 272])
def test_block_kv_must_be_a_multiple_of_16_in_range(block_kv):
  with pytest.raises(ValueError, match="block_kv"):
    Config(block_kv=block_kv)


# (block_kv, b, t, s, n, kh, h, kw). The interpreter's cost grows with batch x heads x tiles: one
# batch row where no mask differs between rows, two (the per-row masks) with kv_lengths and
# segments; GQA (4 heads over 2) once, one k/v head elsewhere.
@pytest.mark.parametrize("block_kv,b,t,s,n,kh,h,kw", [
    (80, 1, 200, 230, 4, 2, 64, dict()),
    (80, 1, 200, 300, 2, 1, 64, dict(causal=True)),
    (96, 2, 130, 190, 2, 1, 128, dict(window=(70, 20), softcap=15.0, kv_lengths=True)),
    (176, 2, 160, 370, 2, 1, 64, dict(segments=True)),
], ids=["80-full", "80-causal", "96-window_softcap_kvlen_h128", "176-segments"])
def test_narrow_swizzle_blocks_match_the_reference_in_interpret_mode(block_kv, b, t, s, n, kh, h,
                                                                      kw):
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h)
  kw = H.flag_kwargs(kw, t=t, s=s, segment_lengths=(60, 45))
  out, lse = flash_attention(q, k, v, implementation="mosaic", config=Config(block_kv=block_kv),
                             interpret=True, return_lse=True, **kw)
  ref, ref_lse = reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                     precision=jax.lax.Precision.HIGHEST, return_lse=True, **kw)
  out, ref = np.asarray(out, np.float32), np.asarray(ref)
  assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-2
  assert np.abs(out - ref).mean() / np.abs(ref).mean() < 1e-2
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
  seen = np.isfinite(ref_lse)
  np.testing.assert_array_equal(np.isfinite(lse), seen)
  np.testing.assert_allclose(lse[seen], ref_lse[seen], atol=2e-2)


@pytest.mark.parametrize("h,block_kv,causal", [(256, 80, False), (256, 80, True),
                                               (128, 176, False), (128, 96, True),
                                               (64, 192, True)])
def test_narrow_swizzle_blocks_lower_for_sm90(h, block_kv, causal):
  """FA3's tiles: 80 keys at H = 256 (224 KB of K/V ring and Q: Mosaic rejects it unless the 2 KB
  reduction scratch is given back), 176 at H = 128; 96 (64-byte rows); 192 at H = 64 (three
  128-byte groups, a tile the old Config rejected)."""
  cfg = dataclasses.replace(default_config(head_dim=h, seq_k=4096, masked=causal),
                            block_kv=block_kv)
  text = H.lower_mosaic_forward(cfg, h=h, t=1280, n=1, causal=causal)
  swizzle = operands.pv_swizzle(block_kv, 2)
  assert f"swizzle<{swizzle} : i32>" in text
  assert "swizzle<128 : i32>" in text                          # Q and the K ring keep 128 B


def test_default_blocks_keep_the_128_byte_swizzle():
  cfg = default_config(head_dim=128, seq_k=4096)
  text = H.lower_mosaic_forward(cfg, h=128, t=1024, n=1)
  assert "swizzle<128 : i32>" in text
  assert "swizzle<64 : i32>" not in text and "swizzle<32 : i32>" not in text


# Batch rows cost interpreter time (grid programs): one row unmasked, two (the tiles cross the
# batch) causal.
@pytest.mark.parametrize("kw,b", [(dict(), 1), (dict(causal=True), 2)],
                         ids=["full", "causal"])
def test_persistent_head_dim_256_stores_o_in_chunks_in_interpret_mode(kw, b, launched,
                                                                       monkeypatch):
  """Persistent at H = 256: O leaves through two [64, 64] slots per consumer, four chunks a
  tile, several tiles per CTA. Interpret mode stages P through SMEM too (16 KB more), so the
  limit is raised to where the chunked form fits and the whole-O form does not (~248 / 281 KB)."""
  monkeypatch.setattr(ops, "SMEM_LIMIT_BYTES", 250_000)
  t, s, h = 200, 150, 256                  # b x 3 heads x 2 q tiles over 3 interpret CTAs
  q, k, v = H.qkv_inputs(b, t, s, 3, 3, h)
  kw = H.flag_kwargs(kw, t=t, s=s)
  cfg = Config(block_kv=64, persistent=True, dynamic_schedule="causal" in kw)
  out = flash_attention(q, k, v, implementation="mosaic", config=cfg, interpret=True, **kw)
  assert launched[-1].persistent and launched[-1].o_chunked
  assert ops.INTERPRET_CTAS < launched[-1].num_tiles               # several tiles per CTA
  ref = reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                            precision=jax.lax.Precision.HIGHEST, **kw)
  out, ref = np.asarray(out, np.float32), np.asarray(ref)
  assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-2


def test_persistent_head_dim_256_lowers_for_sm90(launched):
  """Compiled (registers for P), the chunked O fits at 224 KB + small buffers; Mosaic's own
  shared-memory check passes only because the reduction scratch is given back."""
  cfg = Config(block_kv=64, persistent=True)
  text = H.lower_mosaic_forward(cfg, h=256, t=1024, n=4)
  st = launched[-1]
  assert st.persistent and st.o_chunked and st.num_ctas == min(st.num_tiles, 132)
  assert "mosaic_gpu" in text


def test_head_dim_128_persistent_keeps_the_whole_o_buffer(launched):
  """Where it fits, O keeps its single store (the measured H = 128 default is unchanged)."""
  H.lower_mosaic_forward(default_config(head_dim=128, seq_k=1024), h=128, t=1024, n=2)
  assert launched[-1].persistent and not launched[-1].o_chunked

"""Mosaic forward with P's row sum inside the P V wgmma scope (``Config.sum_in_pv``).

The same float32 sum of the same P, only later in the step: the outputs must be bitwise those of
the default in interpret mode (masked and unmasked blocks, segments, kv_lengths, GQA). The
compiled form (the sum between the P V issue and its wait) is lowered for sm90 on CPU.
"""
import dataclasses

import numpy as np
import pytest

import harness as H
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, default_config


# (b, t, s, n, kh, h, kw). The interpreter's cost grows with the grid (batch x heads x tiles):
# one batch row where no mask differs between rows, two (the per-row masks) with kv_lengths and
# segments; GQA (4 heads over 2) once, one k/v head elsewhere.
@pytest.mark.parametrize("b,t,s,n,kh,h,kw", [
    (1, 256, 256, 4, 2, 64, dict()),
    (1, 200, 300, 2, 1, 64, dict(causal=True)),
    (2, 130, 190, 2, 1, 128, dict(window=(70, 20), softcap=15.0, kv_lengths=True)),
    (2, 160, 150, 2, 1, 64, dict(segments=True)),
], ids=["full", "causal", "window_softcap_kvlen_h128", "segments"])
def test_sum_in_pv_is_bitwise_the_default_in_interpret_mode(b, t, s, n, kh, h, kw):
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h)
  kw = H.flag_kwargs(kw, t=t, s=s, segment_lengths=(60, 45))
  run = lambda cfg: flash_attention(q, k, v, implementation="mosaic", config=cfg,
                                    interpret=True, return_lse=True, **kw)
  out, lse = run(Config(block_kv=64, sum_in_pv=True))
  base_out, base_lse = run(Config(block_kv=64))
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(base_out, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(base_lse))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal_pinned"])
def test_sum_in_pv_lowers_for_sm90(causal):
  """Compiled: the sum moves inside the P V scope (with ``pin_softmax`` on for the masked call,
  whose barrier then carries no row sum)."""
  base = default_config(head_dim=64, seq_k=1024, masked=causal)
  assert base.pin_softmax == causal
  lowered = lambda on: H.lower_mosaic_forward(dataclasses.replace(base, sum_in_pv=on),
                                              causal=causal)
  moved, default = lowered(True), lowered(False)
  assert "flash_attention_fwd" in moved and moved != default

"""Which grid axis is fastest in the Mosaic kernels (``Config.seq_major``).

The order decides only which CTAs are resident together (and so what they share in L2); every
CTA finds its head, tile and batch by name. So forward and gradients with sequence tiles
slowest must be bitwise those of the default (launched batch, then tiles, then heads; see
ops._grid): checked in interpret mode on a small causal case (the gradients' check, ~1 minute
here, only in ``make test-all``: see tests/conftest.py), and compiled on the GPU (GQA, causal
and full).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness as H
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, default_config


def _grads(cfg, q, k, v, kw, *, interpret):
  def loss(q, k, v):
    out, lse = flash_attention(q, k, v, implementation="mosaic", config=cfg, return_lse=True,
                               interpret=interpret, **kw)
    return jnp.sum(out.astype(jnp.float32) * jnp.cos(out.astype(jnp.float32))) + jnp.sum(lse)
  out = flash_attention(q, k, v, implementation="mosaic", config=cfg, interpret=interpret, **kw)
  return [out, *jax.grad(loss, argnums=(0, 1, 2))(q, k, v)]


def _assert_bitwise(a, b, names=("out", "dq", "dk", "dv")):
  for x, y, name in zip(a, b, names):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                  err_msg=name)


def test_seq_major_forward_is_bitwise_equal_in_interpret_mode():
  # Two q tiles and two heads on the forward's grid (the smallest case where the order shows).
  b, t, s, n, kh, h = 1, 136, 136, 2, 2, 64
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h, seed=3)
  run = lambda cfg: flash_attention(q, k, v, implementation="mosaic", config=cfg, causal=True,
                                    return_lse=True, interpret=True)
  _assert_bitwise(run(Config(block_kv=64, seq_major=True)), run(Config(block_kv=64)),
                  names=("out", "lse"))


def test_seq_major_gradients_are_bitwise_equal_in_interpret_mode():
  # Two tiles and two heads on every kernel's grid.
  b, t, s, n, kh, h = 1, 136, 136, 2, 2, 64
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h, seed=3)
  kw = dict(causal=True)
  base = Config(block_kv=64)
  got = _grads(Config(block_kv=64, seq_major=True), q, k, v, kw, interpret=True)
  _assert_bitwise(got, _grads(base, q, k, v, kw, interpret=True))


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_seq_major_is_bitwise_equal_compiled(causal):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  b, t, n, kh, h = 1, 2048, 8, 4, 128
  q, k, v = H.qkv_inputs(b, t, t, n, kh, h, seed=5)
  kw = dict(causal=causal)
  cfg = default_config(head_dim=h, seq_k=t, masked=causal)
  got = _grads(dataclasses.replace(cfg, seq_major=True), q, k, v, kw, interpret=False)
  _assert_bitwise(got, _grads(cfg, q, k, v, kw, interpret=False))


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(40, 0))], ids=["causal", "window"])
def test_dq_heavy_first_tiles_match_reference_in_interpret_mode(kw):
  """The dQ kernel maps its grid's Q tiles in reverse under masks with a right bound (the
  heaviest tiles launch first, as the forward's ``heavy_first``): with three Q tiles and T != S
  (bottom-right alignment, the first tile partly fully masked) the gradients still match the
  float32 reference."""
  cfg = Config(block_kv=64, backward="mosaic")
  got, want = H.grads_against_reference(cfg, kw, b=1, t=300, s=260, n=2, kh=1, h=64, seed=13)
  for name, x, r in zip(("out", "dq", "dk", "dv"), got, want):
    err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
    assert err < 2e-2, (name, err)

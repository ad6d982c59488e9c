"""``Config.bwd_persistent``: the dK/dV and dQ kernels as persistent launches.

One CTA per SM (``ops.INTERPRET_CTAS`` in interpret mode) loops over the kernel's tiles
round-robin; the producer's ring (Q/dO for dK/dV, K/V for dQ) runs on across tiles and each
consumer double-buffers its own tile (K/V; Q, dO, L2/D), so tile boundaries overlap work
instead of idling the SM. Served for unmasked calls (S a multiple of the CTA's keys, no mask,
kv_lengths or segment ids) where the second buffers fit, without the fused dQ or the split
backward; otherwise the grid kernels run. The products and their order are the grid kernels':
the gradients are bitwise the same.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness as H
from pallas_attn import flash_attention
from pallas_attn.mosaic import default_config, ops


def _grads(cfg, b, t, s, n, kh, h, seed, **kw):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, kh, h), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, kh, h), jnp.bfloat16)
  do = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)
  f = lambda q, k, v: flash_attention(q, k, v, implementation="mosaic", config=cfg,
                                      interpret=True, **kw)
  out, vjp = jax.vjp(f, q, k, v)
  return [np.asarray(x, np.float32) for x in (out, *vjp(do))], f, (q, k, v)


def _bwd_grid_names(f, args) -> list[str]:
  """The grid names of the backward's Mosaic kernels (dQ, dK/dV) in ``f``'s gradient."""
  text = str(jax.make_jaxpr(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(),
                                     argnums=(0, 1, 2)))(*args))
  return [g[:40] for g in text.split("grid_names=")[1:]
          if "kv_seq" in g[:40] or "cta" in g[:20] or "q_seq" in g[:40]][-2:]


# (b, t, s, n, kh, h): more tiles than the interpreter's 3 CTAs (a CTA runs 2-3 tiles, so both
# K/V buffers and the ring's wrap across tiles are used), GQA / MQA, and fewer tiles than CTAs.
SHAPES = [(2, 256, 256, 4, 2, 64), (1, 130, 384, 2, 1, 128), (1, 64, 128, 2, 2, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bitwise_the_grid_kernel_in_interpret_mode(shape):
  b, t, s, n, kh, h = shape
  base = dataclasses.replace(default_config(head_dim=h, seq_k=s, masked=False),
                             backward="mosaic", bwd_persistent=False, bwd_delta_in_dq=False)
  want, _, _ = _grads(base, b, t, s, n, kh, h, seed=11)
  got, f, args = _grads(dataclasses.replace(base, bwd_persistent=True), b, t, s, n, kh, h,
                        seed=11)
  assert [("cta" in g) for g in _bwd_grid_names(f, args)] == [True, True]
  for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(softcap=20.0)], ids=["causal", "softcap"])
def test_masked_or_ragged_calls_keep_the_grid(kw):
  """A mask (causal here) needs per-tile ranges: the grid kernel runs. A softcap alone is no
  mask: persistent."""
  cfg = dataclasses.replace(default_config(head_dim=64, seq_k=256, masked=True),
                            bwd_persistent=True)
  q = jnp.ones((1, 256, 2, 64), jnp.bfloat16)
  f = lambda q, k, v: flash_attention(q, k, v, implementation="mosaic", config=cfg,
                                      interpret=True, **kw)
  names = _bwd_grid_names(f, (q, q, q))
  assert len(names) == 2 and all(("cta" in g) == ("softcap" in kw) for g in names)
  ragged = lambda q, k, v: flash_attention(q, k, v, implementation="mosaic", config=cfg,
                                           interpret=True)
  k200 = jnp.ones((1, 200, 2, 64), jnp.bfloat16)      # S off the CTA's 128 keys: kv_lengths
  assert not any("cta" in g for g in _bwd_grid_names(ragged, (q, k200, k200)))


def test_second_buffers_fit_at_h128():
  q = jnp.zeros((1, 1024, 2, 128), jnp.bfloat16)
  cfg = dataclasses.replace(default_config(head_dim=128, seq_k=1024, masked=False),
                            bwd_delta_in_dq=False)
  st_dq, st = ops._backward_statics(q, q, None, None, causal=False, scale=1.0, window=None,
                                    softcap=None, cfg=cfg, interpret=False)
  assert ops.backward_smem_bytes(st=st, head_dim=128, persistent=True) <= ops.SMEM_LIMIT_BYTES
  assert (ops.backward_smem_bytes(st=st, head_dim=128, persistent=True)
          - ops.backward_smem_bytes(st=st, head_dim=128) == 2 * 2 * 64 * 128 * 2)
  assert ops.dq_smem_bytes(st=st_dq, head_dim=128, persistent=True) <= ops.SMEM_LIMIT_BYTES
  # With D in the dQ kernel (O buffered too) a second set no longer fits at H = 128: that
  # dQ kernel keeps the grid.
  with_d = dataclasses.replace(st_dq, delta_in_dq=True)
  assert ops.dq_smem_bytes(st=with_d, head_dim=128, persistent=True) > ops.SMEM_LIMIT_BYTES


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    H.Case(t=1024, s=1024, n=16, kh=16, h=128, b=4, seed=801),
    H.Case(t=700, s=2048, n=8, kh=2, h=128, seed=802),
    H.Case(t=512, s=512, n=4, kh=1, h=64, softcap=30.0, seed=803),
], ids=lambda c: c.id)
def test_matches_reference_compiled(case):
  H.check_mosaic_default_with(case, bwd_persistent=True)


def test_default_takes_it_on_short_unmasked_rows():
  """``default_config`` (H100, session 28): persistent backward kernels on unmasked rows up to
  ``PERSISTENT_BWD_KEYS`` keys (16x1024 fwd+bwd -3.4%; +3% at 4096 keys); D in the dQ kernel
  at H <= 128 (-2.7..-4.5% at 16x1024)."""
  from pallas_attn.mosaic.config import PERSISTENT_BWD_KEYS  # pylint: disable=import-outside-toplevel
  assert default_config(head_dim=128, seq_k=PERSISTENT_BWD_KEYS, masked=False).bwd_persistent
  assert not default_config(head_dim=128, seq_k=2 * PERSISTENT_BWD_KEYS,
                            masked=False).bwd_persistent
  assert not default_config(head_dim=128, seq_k=1024, masked=True).bwd_persistent
  assert default_config(head_dim=128, seq_k=4096, masked=True).bwd_delta_in_dq
  assert not default_config(head_dim=256, seq_k=4096, masked=False).bwd_delta_in_dq

"""Sequences that end inside a tile, compiled: no padded copies of Q, K, V, O and dO.

TMA zero-fills the rows of a load past the array's end and drops the rows of a store past it,
so ``ops.tma_tails`` lets the compiled kernels take the operands as they are (session 33: five
XLA pads and two slices were ~0.33 ms, 7% of fwd+bwd at 4x4000x32x64). Interpret mode keeps
the padding (its copies clamp), so the whole shared suite still runs the padded form on CPU;
the compiled suite's off-tile cases (T, S = 1000, 1500, ...) run this one. Checked here: the
conditions, the traced program's pads, and sm90 lowering of both directions.
"""
import functools

import jax
import jax.numpy as jnp
import pytest

import harness as H
from pallas_attn.mosaic import default_config, ops


@pytest.mark.parametrize("kw,want", [
    (dict(t=4000, s=4000), True),
    (dict(t=1000, s=1496), True),
    (dict(t=4000, s=4000, interpret=True), False),     # the interpreter's copies clamp
    (dict(t=4000, s=4000, h=72, hp=128), False),       # the head dim pads anyway
    (dict(t=200, s=4000), False),                      # a slice may not exceed its axis
    (dict(t=4001, s=4000), False),                     # Mosaic tiles the array by 8 rows
    (dict(t=4000, s=4004), False)])
def test_conditions(kw, want):
  kw = {"interpret": False, "h": 64, "hp": 64, **kw}
  assert ops.tma_tails(**kw) == want


def _pads(jaxpr) -> list[tuple[int, ...]]:
  """Shapes of every rank-4 array padded anywhere in ``jaxpr``."""
  return [tuple(eqn.invars[0].aval.shape) for eqn in H.walk_eqns(jaxpr)
          if eqn.primitive.name == "pad" and eqn.invars[0].aval.ndim == 4]


def _vjp(t, s, h, *, causal, interpret, lens=None):
  q = jnp.zeros((2, t, 4, h), jnp.bfloat16)
  k = jnp.zeros((2, s, 2, h), jnp.bfloat16)
  cfg = default_config(head_dim=h, seq_k=s, masked=causal, key_masks=lens is not None)

  def f(q, k, v):
    out, _ = ops._attention(q, k, v, None, None, lens, causal, h ** -0.5, None, None, cfg,
                            ops.padded_head_dim(h), interpret)
    return out.astype(jnp.float32).sum()
  return jax.grad(f, argnums=(0, 1, 2)), (q, k, k)


# H = 256 runs the D pre-pass (a Triton kernel over whole tiles: dO and O padded for it only),
# which needs a GPU even to trace; the compiled test below covers that head dim.
@pytest.mark.parametrize("h,causal", [(64, False), (128, True)])
def test_no_padded_operands_compiled(h, causal):
  lens = jnp.array([1500, 700], jnp.int32)
  g, args = _vjp(1000, 1496, h, causal=causal, interpret=False, lens=lens)
  assert _pads(jax.make_jaxpr(g)(*args).jaxpr) == []
  g, args = _vjp(1000, 1496, h, causal=causal, interpret=True, lens=lens)
  assert len(_pads(jax.make_jaxpr(g)(*args).jaxpr)) >= 5        # Q, K, V, O, dO at least


@pytest.mark.parametrize("h,causal", [(64, False), (64, True), (128, False), (128, True)])
def test_unpadded_forms_lower_for_sm90(h, causal):
  """Mosaic accepts the tiles that run past T and S (the TMA descriptors span the real
  arrays) in the forward, the dQ and the dK/dV kernels."""
  g, args = _vjp(1000, 1496, h, causal=causal, interpret=False)
  text = jax.jit(g).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  for name in ("flash_attention_fwd", "flash_attention_dq", "flash_attention_dkdv"):
    assert name in text


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    H.Case(t=1000, s=1496, n=4, kh=2, h=64, seed=841),
    H.Case(t=1496, s=1000, n=4, kh=1, h=128, causal=True, seed=842),
    H.Case(t=776, s=1032, n=2, kh=2, h=128, segments=3, kv_lengths=(1032, 517), seed=843),
    H.Case(t=1000, s=1000, n=2, kh=1, h=256, window=(200, 30), softcap=25.0, seed=844)],
    ids=lambda c: c.id)
def test_matches_reference_compiled(case):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  assert ops.tma_tails(interpret=False, h=case.h, hp=case.h, t=case.t, s=case.s)
  H.check_mosaic_default_with(case)

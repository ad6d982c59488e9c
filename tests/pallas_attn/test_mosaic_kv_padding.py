"""Keys past ``kv_lengths`` on the Mosaic backend: zeroed once, inside the custom VJP.

Padded keys may hold NaN (the shared suite's ``test_nan_padding``). The Mosaic entry point zeroes
V (and, where a backward follows, K) past each row's length inside its custom VJP, so no second
select over dK and dV runs after the backward kernels: they already leave those rows 0. These
tests pin both halves: the forward alone and the Triton-backward fallback stay NaN-free and
bitwise equal to clean inputs, and the traced program holds exactly the selects it needs.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness as H
from pallas_attn import flash_attention

CASE = H.Case(t=70, s=190, n=2, kh=1, h=64, kv_lengths=(190, 61), seed=811)


def _poisoned(x: H.Inputs, case: H.Case) -> tuple[H.Inputs, np.ndarray]:
  pad = np.arange(case.s)[None, :] >= np.asarray(case.kv_lengths)[:, None]
  pad4 = jnp.asarray(pad[:, :, None, None])
  return x._replace(k=jnp.where(pad4, jnp.nan, x.k).astype(x.k.dtype),
                    v=jnp.where(pad4, jnp.nan, x.v).astype(x.v.dtype)), pad


def test_forward_alone_ignores_nan_padding():
  """Without a VJP only V is zeroed: NaN in K must still not reach out or lse (S is masked with a
  select, not an add)."""
  x, _, _ = H.case_data(CASE)
  dirty, _ = _poisoned(x, CASE)
  fwd = jax.jit(lambda q, k, v, lens: flash_attention(
      q, k, v, kv_lengths=lens, implementation="mosaic", return_lse=True))
  clean_out, clean_lse = fwd(x.q, x.k, x.v, x.kv_lengths)
  out, lse = fwd(dirty.q, dirty.k, dirty.v, dirty.kv_lengths)
  assert np.isfinite(np.asarray(out, np.float32)).all()
  H.assert_bitwise({"out": clean_out, "lse": clean_lse}, {"out": out, "lse": lse},
                   "forward alone, NaN padding", names=("out", "lse"))


def test_triton_backward_fallback_leaves_padding_zero():
  """``Config.backward="triton"`` runs the FA2 backward on the same (zeroed) residuals: its dK and
  dV must be 0 past the lengths without the select that used to follow."""
  cfg = dataclasses.replace(H.mosaic_default_config(CASE), backward="triton")
  x, _, _ = H.case_data(CASE)
  dirty, pad = _poisoned(x, CASE)
  run = H.runner(CASE, implementation="mosaic", config=cfg)
  clean, res = run(x), run(dirty)
  H.assert_bitwise(clean, res, "triton backward, NaN padding", names=("out", "lse", "dq"))
  for name in ("dk", "dv"):
    assert (np.asarray(res[name], np.float32)[pad] == 0).all(), f"{name} of padding is not 0"
  hi, lo = H.references(CASE, dirty)
  H.assert_ratio_rule(res, hi, lo, CASE.dtype, what="triton backward, NaN padding")


def _key_selects(jaxpr, shape) -> int:
  """Selects over a key-shaped array anywhere in ``jaxpr`` (sub-jaxprs included)."""
  return sum(eqn.primitive.name == "select_n" and tuple(eqn.outvars[0].aval.shape) == shape
             for eqn in H.walk_eqns(jaxpr))


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "fwd+bwd"])
def test_one_select_per_operand_and_none_after_the_backward(grad):
  x, _, _ = H.case_data(CASE)

  def loss(q, k, v):
    return flash_attention(q, k, v, kv_lengths=x.kv_lengths,
                           implementation="mosaic").astype(jnp.float32).sum()

  f = jax.grad(loss, argnums=(0, 1, 2)) if grad else loss
  jaxpr = jax.make_jaxpr(f)(x.q, x.k, x.v).jaxpr
  # forward alone: V; with the backward: K and V once each (the residuals), none on dK / dV.
  assert _key_selects(jaxpr, tuple(x.k.shape)) == (2 if grad else 1)

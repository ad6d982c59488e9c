"""``Config.bwd_fold_batch``: the unmasked grid dK/dV kernel with the batch folded into its K/V
tile axis (K, V, dK, dV seen as one [1, B * S] sequence; only the producer derives the batch).

Offline SASS (4x4096x16x128, 232 registers, session 45): the consumers' step loop is then the
one ptxas builds for a single sequence (1x16384), which Nsight Compute had measured 13% faster
per unit of work than the batch >= 2 loop (session 42); timed, the fold tied the default
(H100, session 45), so the gap belonged to the row, not the loop. The arithmetic is the same,
so gradients are bitwise the unfolded kernel's; checked here in interpret mode and compiled."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import harness as H
from pallas_attn import flash_attention
from pallas_attn.mosaic import default_config

FOLD = dict(bwd_fold_batch=True)


def _grid_config(**kw):
  """The row's default with the grid (not persistent) backward, where the fold applies; short
  rows like these take the persistent one by default."""
  return dataclasses.replace(default_config(head_dim=64, **kw), bwd_persistent=False)


def _run(cfg, *, b, t, s, n, kh, h, seed, interpret, **kw):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (b, s, kh, h), jnp.bfloat16) for kk in keys[1:])
  f = lambda q, k, v: flash_attention(q, k, v, implementation="mosaic", config=cfg,
                                      interpret=interpret, **kw).astype(jnp.float32).sum()
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)


def _dkdv_shapes(cfg, *, b, t, s, n, kh, h, **kw):
  """The output shapes of the dK/dV kernel call in the traced backward."""
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, s, kh, h), jnp.bfloat16)
  f = lambda q, k, v: flash_attention(q, k, v, implementation="mosaic", config=cfg,
                                      interpret=True, **kw).astype(jnp.float32).sum()
  text = str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, k))
  return "dkdv" in text, f"bf16[1,{b * s},{kh},{h}]" in text


def test_folds_only_where_it_applies():
  base = _grid_config(seq_k=256, batch=3)
  shape = dict(b=3, t=256, s=256, n=2, kh=1, h=64)
  assert _dkdv_shapes(dataclasses.replace(base, **FOLD), **shape) == (True, True)
  assert _dkdv_shapes(base, **shape) == (True, False)
  masked = dataclasses.replace(_grid_config(seq_k=256, batch=3, masked=True), **FOLD)
  assert _dkdv_shapes(masked, causal=True, **shape) == (True, False)   # per-batch records


def test_interpret_bitwise():
  # GQA 2:1, three sequences, unmasked (the fold's only form); H = 64 keeps CI time down.
  shape = dict(b=3, t=128, s=256, n=2, kh=1, h=64, seed=451)
  base = _grid_config(seq_k=256, batch=3)
  H.assert_same_value_and_grads(_run(dataclasses.replace(base, **FOLD), interpret=True, **shape),
               _run(base, interpret=True, **shape))


@pytest.mark.gpu
@pytest.mark.parametrize("registers", [232, 240])
def test_compiled_bitwise(registers):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  shape = dict(b=4, t=2048, s=2048, n=4, kh=2, h=128, seed=453)
  base = default_config(head_dim=128, seq_k=2048, batch=4)
  cfg = dataclasses.replace(base, bwd_registers=registers)
  H.assert_same_value_and_grads(_run(dataclasses.replace(cfg, **FOLD), interpret=False, **shape),
               _run(cfg, interpret=False, **shape))

"""``Config.bwd_turns``: the two consumers of the grid dK/dV kernel issue each step's S^T and
dP^T in turn, on a pair of hardware barriers (``ring.consumer_turns``), as the forward's
ping-pong does. The default for unmasked H = 128 rows from 4096 keys (H100, session 46: that
kernel ~1% faster at 4096 keys; the same turns slowed the dQ kernel, the persistent dK/dV
kernel and H = 64, so they are not served there).

Compiled only (the interpreter cannot run ``bar.sync``): checked here on the kernels' MLIR
lowered for sm90 on the CPU host (one wait and one signal in the dK/dV kernel, causal calls
too when asked; none with ``bwd_masked_halves``), and compiled on the GPU, where the gradients
must be bitwise those without turns (same products, same order)."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import mosaic_mlir
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, default_config

TURNS = dict(bwd_turns=True)


def _named(cfg, *, causal: bool, head_dim: int = 128):
  """(bar.sync, bar.arrive) counts of 256 threads in each kernel of forward + backward."""
  low = mosaic_mlir.lower_attention(cfg, head_dim=head_dim, grad=True, causal=causal)
  return [(len(re.findall(r"bar\.sync \$0, 256", t)), len(re.findall(r"bar\.arrive \$0, 256", t)))
          for t in mosaic_mlir.kernel_texts(low)]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled runs lower it for real")
def test_one_wait_and_one_signal_in_the_dkdv_kernel():
  base = dataclasses.replace(default_config(head_dim=128, seq_k=4096, batch=4), bwd_turns=False)
  plain, turns = _named(base, causal=False), _named(dataclasses.replace(base, **TURNS),
                                                    causal=False)
  assert len(plain) == len(turns) == 3                  # forward, dQ, dK/dV
  assert turns[:2] == plain[:2]                          # the forward and dQ kernels untouched
  assert (turns[2][0] - plain[2][0], turns[2][1] - plain[2][1]) == (1, 1)


def test_default_only_on_unmasked_h128_grid_rows():
  assert Config().bwd_turns is False
  assert default_config(head_dim=128, seq_k=4096, batch=4).bwd_turns
  assert default_config(head_dim=128, seq_k=16384, batch=1).bwd_turns
  assert not default_config(head_dim=128, seq_k=4096, masked=True).bwd_turns
  assert not default_config(head_dim=128, seq_k=1024).bwd_turns      # persistent dK/dV
  assert not default_config(head_dim=128, seq_k=2048).bwd_turns      # grid, not timed
  assert not default_config(head_dim=64, seq_k=4096).bwd_turns
  assert not default_config(head_dim=256, seq_k=4096).bwd_turns


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled runs lower it for real")
def test_masked_calls_take_turns_when_asked():
  """Both consumers visit the CTA's masked and mask-free steps in the same order, so the turns
  serve causal calls too (opt-in: the default leaves them off, untimed)."""
  base = default_config(head_dim=128, seq_k=4096, masked=True, batch=4)
  assert not base.bwd_turns
  plain, turns = (_named(dataclasses.replace(base, bwd_turns=t), causal=True)
                  for t in (False, True))
  assert turns[:2] == plain[:2]
  # one wait and one signal in each of _visit's three loops (masked, mask-free, masked)
  assert (turns[2][0] - plain[2][0], turns[2][1] - plain[2][1]) == (3, 3)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled runs lower it for real")
def test_no_turns_with_masked_halves():
  """``bwd_masked_halves`` issues S^T twice a step (two query halves): no turns there."""
  base = default_config(head_dim=64, seq_k=4096, masked=True, batch=4)
  assert base.bwd_masked_halves and base.bwd_dkdv_block_q == 128
  turns = _named(dataclasses.replace(base, bwd_turns=True), causal=True, head_dim=64)
  assert turns == _named(base, causal=True, head_dim=64)


def _run(cfg, *, b, t, n, kh, h, seed, causal=False):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (b, t, kh, h), jnp.bfloat16) for kk in keys[1:])
  f = lambda q, k, v: flash_attention(q, k, v, causal=causal, implementation="mosaic",
                                      config=cfg).astype(jnp.float32).sum()
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("h,causal", [(128, False), (64, False), (128, True)])
def test_compiled_bitwise(h, causal):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  shape = dict(b=2, t=2048, n=4, kh=2, h=h, seed=461, causal=causal)   # GQA 2:1, grid kernels
  base = default_config(head_dim=h, seq_k=2048, batch=2, masked=causal)
  (val_a, grads_a), (val_b, grads_b) = (_run(dataclasses.replace(base, bwd_turns=on), **shape)
                                        for on in (True, False))
  np.testing.assert_array_equal(np.asarray(val_a), np.asarray(val_b))
  for ga, gb in zip(grads_a, grads_b):
    np.testing.assert_array_equal(np.asarray(ga), np.asarray(gb))

"""``Config.bwd_turns``: the backward's two consumers issue their first two products of each
step (S and dP in the dQ kernel, S^T and dP^T in the dK/dV kernel) in turn, on a pair of
hardware barriers (``ring.consumer_turns``), as the forward's ping-pong does.

Compiled only (the interpreter cannot run ``bar.sync``): checked here on the kernels' MLIR
lowered for sm90 on the CPU host (one wait and one signal per backward kernel, none for masked
calls, where the two consumers may take different steps), and compiled on the GPU, where the
gradients must be bitwise the default's (same products, same order)."""
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


def _named(cfg, *, causal: bool):
  """(bar.sync, bar.arrive) counts of 256 threads in each kernel of forward + backward."""
  low = mosaic_mlir.lower_attention(cfg, head_dim=128, grad=True, causal=causal)
  return [(len(re.findall(r"bar\.sync \$0, 256", t)), len(re.findall(r"bar\.arrive \$0, 256", t)))
          for t in mosaic_mlir.kernel_texts(low)]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled runs lower it for real")
def test_one_wait_and_one_signal_per_backward_kernel():
  base = default_config(head_dim=128, seq_k=4096, batch=4)
  plain, turns = _named(base, causal=False), _named(dataclasses.replace(base, **TURNS),
                                                    causal=False)
  assert len(plain) == len(turns) == 3                  # forward, dQ, dK/dV
  assert turns[0] == plain[0]                            # the forward is untouched
  for p, t in zip(plain[1:], turns[1:]):
    assert (t[0] - p[0], t[1] - p[1]) == (1, 1)
  assert Config().bwd_turns is False


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled runs lower it for real")
def test_masked_calls_take_no_turns():
  base = default_config(head_dim=128, seq_k=4096, masked=True, batch=4)
  assert _named(dataclasses.replace(base, **TURNS), causal=True) == _named(base, causal=True)


def _run(cfg, *, b, t, n, kh, h, seed):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (b, t, kh, h), jnp.bfloat16) for kk in keys[1:])
  f = lambda q, k, v: flash_attention(q, k, v, implementation="mosaic",
                                      config=cfg).astype(jnp.float32).sum()
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("t,h", [(2048, 128), (1024, 128), (2048, 64)])
def test_compiled_bitwise(t, h):
  # 2048 keys: the grid kernels; 1024: the persistent dK/dV kernel (the default there).
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  shape = dict(b=2, t=t, n=4, kh=2, h=h, seed=461)
  base = default_config(head_dim=h, seq_k=t, batch=2)
  (val_a, grads_a), (val_b, grads_b) = (_run(c, **shape)
                                        for c in (dataclasses.replace(base, **TURNS), base))
  np.testing.assert_array_equal(np.asarray(val_a), np.asarray(val_b))
  for ga, gb in zip(grads_a, grads_b):
    np.testing.assert_array_equal(np.asarray(ga), np.asarray(gb))

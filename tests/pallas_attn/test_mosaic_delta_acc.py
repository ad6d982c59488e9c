"""-D as dP's starting accumulator: ``Config.bwd_early_stats="lse_pre+delta_acc"`` (the dK/dV
kernel) and ``Config.bwd_dq_delta_acc`` (the dQ kernel).

dS = P (dP - D) (FA2 Algorithm 2 line 16). Starting the dP wgmma's accumulator from -D instead
of zero makes the tensor cores return dP - D, so the kernel's subtraction goes (and, in the
dK/dV kernel, the wait on D's shared-memory loads behind it). Compiled only: interpret mode has
no wgmma accumulators to start from a value and runs the plain form.

On the CPU host the kernels are lowered for sm90 and their MLIR compared with the switch off
and on: the switch changes only its own kernel, and there the tile's float subtractions of D
are gone and a negation of the D vector (before it is broadcast) takes their place. The ``gpu`` case
checks the numbers: the subtraction moves inside the wgmma's float32 sum, so the kernel's own
gradient moves by float32 rounding and every other output is bitwise the plain form's. The
dQ switch is the default at H = 64 and 128 (session 44); the dK/dV one is opt-in.
"""
import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import mosaic_mlir
from pallas_attn import flash_attention
from pallas_attn.mosaic import default_config

_OPS = ("arith.subf", "arith.negf")


def _kernels(cfg, causal: bool, head_dim: int = 128) -> dict[str, str]:
  """The backward's lowered kernels by role (forward, dq, dkdv) as MLIR text."""
  low = mosaic_mlir.lower_attention(cfg, head_dim=head_dim, grad=True, causal=causal)
  texts = mosaic_mlir.kernel_texts(low)
  roles = {}
  for text in texts:
    role = "dkdv" if "dkdv" in text else "dq" if "_dq" in text else "fwd"
    # (the module names carry a per-process count: flash_attention_fwd_0, _3, ...)
    roles[role] = re.sub(r"(flash_attention_[a-z]+)_\d+", r"\1", text)
  assert set(roles) == {"fwd", "dq", "dkdv"}, list(roles)
  return roles


def _counts(text: str) -> collections.Counter:
  return collections.Counter(op for op in re.findall(r"arith\.\w+", text) if op in _OPS)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled runs lower it for real")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("field,off,on,kernel", [
    ("bwd_dq_delta_acc", False, True, "dq"),
    ("bwd_early_stats", "lse_pre", "lse_pre+delta_acc", "dkdv")])
def test_only_its_kernel_loses_the_subtraction(causal, field, off, on, kernel):
  base = default_config(head_dim=128, seq_k=4096, masked=causal)
  before = _kernels(dataclasses.replace(base, **{field: off}), causal)
  after = _kernels(dataclasses.replace(base, **{field: on}), causal)
  for role in before:
    if role != kernel:
      assert after[role] == before[role], role
  b, a = _counts(before[kernel]), _counts(after[kernel])
  # Each step form that takes it (the dQ kernel: all three of a causal call, the mask-free
  # one between its masked ends; the dK/dV kernel: its unmasked form only) loses the 16
  # subtractions of D (one op per two floats of the 64 x 64 tile a thread holds) and negates
  # D once, before the broadcast: a dQ row's D is 2 ops, the dK/dV step's 16 columns 8.
  forms = 3 if causal and kernel == "dq" else 1
  assert b["arith.negf"] == 0
  assert a["arith.negf"] == forms * (2 if kernel == "dq" else 8)
  assert a["arith.subf"] == b["arith.subf"] - 16 * forms


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled runs lower it for real")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dq_switch_at_head_dim_64(causal):
  # The H = 64 default over 4096 keys: 128-key dQ steps (a 64 x 128 dP tile), 240 registers.
  base = default_config(head_dim=64, seq_k=4096, masked=causal)
  assert base.bwd_dq_block_kv == 128
  before = _kernels(dataclasses.replace(base, bwd_dq_delta_acc=False), causal, head_dim=64)
  after = _kernels(base, causal, head_dim=64)
  assert after["fwd"] == before["fwd"] and after["dkdv"] == before["dkdv"]
  b, a = _counts(before["dq"]), _counts(after["dq"])
  assert b["arith.negf"] == 0 < a["arith.negf"]
  # twice the H = 128 tile's columns: 32 subtractions of D a step form go
  forms = 3 if causal else 1
  assert a["arith.subf"] == b["arith.subf"] - 32 * forms


@pytest.mark.parametrize("head_dim,on", [(64, True), (128, True), (256, False)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dq_switch_is_the_default_where_it_was_timed(head_dim, on, causal):
  # Timed at H = 64 and 128 (fwd+bwd 0.98-0.99x, H100, session 44); H = 256's dQ kernel (the
  # split backward's) is not.
  for seq_k in (1024, 4096, 16384):
    cfg = default_config(head_dim=head_dim, seq_k=seq_k, masked=causal)
    assert cfg.bwd_dq_delta_acc is on, (head_dim, seq_k)
    assert cfg.bwd_early_stats != "lse_pre+delta_acc"   # the dK/dV form stays opt-in


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_close_to_the_default_compiled(causal):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  keys = jax.random.split(jax.random.key(43), 3)
  q, k, v = (jax.random.normal(kk, (2, 1024, 4, 128), jnp.bfloat16) for kk in keys)
  base = dataclasses.replace(default_config(head_dim=128, seq_k=1024, masked=causal),
                             bwd_persistent=False, bwd_dq_delta_acc=False)

  def run(cfg):
    f = lambda q, k, v: flash_attention(q, k, v, causal=causal, implementation="mosaic",
                                        config=cfg).astype(jnp.float32).sum()
    return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

  ref_val, ref = run(base)
  # Which gradient each switch may move (by float32 rounding before the cast to bf16).
  for changes, moved in ((dict(bwd_dq_delta_acc=True), 0),
                         (dict(bwd_early_stats="lse_pre+delta_acc"), 1)):
    val, grads = run(dataclasses.replace(base, **changes))
    np.testing.assert_array_equal(np.asarray(val), np.asarray(ref_val))
    for i, (g, g0) in enumerate(zip(grads, ref)):
      g, g0 = np.asarray(g, np.float32), np.asarray(g0, np.float32)
      if i == moved:
        assert np.abs(g - g0).max() <= 2.0 ** -7 * np.abs(g0).max(), changes
      else:
        np.testing.assert_array_equal(g, g0)

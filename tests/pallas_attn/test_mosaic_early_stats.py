"""``Config.bwd_early_stats``: the dK/dV kernel reads a step's lse (and D) from the stats ring
while the S^T (dP^T) wgmma runs instead of after waiting for it.

Compiled only (interpret mode has no async wgmma and ignores it). Checked on the kernel lowered
for sm90 on the CPU host: in the step's instruction stream, the shared-memory loads of the
statistics move in front of the wait for the product they feed. The gradients are the same
loads and the same arithmetic, so a compiled run must give them bitwise (the ``gpu`` case).
"""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import mosaic_mlir
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, default_config


def _step_events(cfg) -> list[tuple[str, int]]:
  """The dK/dV kernel's lowered text as runs of (event, count): "mma" (wgmma issues), "wait"
  (wgmma.wait_group) and "lds" (loads from shared memory, address space 3)."""
  low = mosaic_mlir.lower_attention(cfg, head_dim=128, grad=True, causal=False)
  (text,) = [t for t in mosaic_mlir.kernel_texts(low) if "dkdv" in t]
  runs: list[list] = []
  for line in text.splitlines():
    if "wgmma.mma_async" in line:
      ev = "mma"
    elif "wgmma.wait_group" in line:
      ev = "wait"
    elif re.search(r"llvm\.load .*ptr<3>", line):
      ev = "lds"
    else:
      continue
    if runs and runs[-1][0] == ev:
      runs[-1][1] += 1
    else:
      runs.append([ev, 1])
  return [tuple(r) for r in runs]


def _loads_before_waits(events) -> list[int]:
  """Shared-memory loads between each run of wgmma issues and the wait that follows it."""
  counts, inside = [], None
  for ev, n in events:
    if ev == "mma":
      inside = 0 if inside is None else inside
    elif ev == "lds" and inside is not None:
      inside += n
    elif ev == "wait" and inside is not None:
      counts.append(inside)
      inside = None
  return counts


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled runs lower it for real")
def test_stats_loads_move_before_the_waits():
  # Unmasked, 4096 keys: the grid kernel with its one (unmasked) step form.
  base = default_config(head_dim=128, seq_k=4096, masked=False)
  got = {mode: _loads_before_waits(_step_events(dataclasses.replace(base, bwd_early_stats=mode)))
         for mode in ("", "lse", "lse+delta")}
  # The step waits twice with one group left in flight (S^T, then dP^T behind dV's issue),
  # then for the rest; a stats row is 8 loads of two floats a thread (64 columns).
  assert got[""][:2] == [0, 0]
  assert got["lse"][:2] == [8, 0]
  assert got["lse+delta"][:2] == [8, 8]
  assert Config().bwd_early_stats == ""


def test_bad_value_raises():
  with pytest.raises(ValueError, match="bwd_early_stats"):
    Config(bwd_early_stats="delta")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_early_stats_gradients_bitwise_compiled(causal):
  """Compiled: the same loads, earlier, so out and every gradient equal the default's."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  keys = jax.random.split(jax.random.key(30), 4)
  q, k, v = (jax.random.normal(kk, (2, 1024, 4, 128), jnp.bfloat16) for kk in keys[:3])
  base = default_config(head_dim=128, seq_k=1024, masked=causal)
  base = dataclasses.replace(base, bwd_persistent=False)

  def run(cfg):
    f = lambda q, k, v: flash_attention(q, k, v, causal=causal, implementation="mosaic",
                                        config=cfg).astype(jnp.float32).sum()
    return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)
  ref_val, ref_grads = run(base)
  for mode in ("lse", "lse+delta"):
    val, grads = run(dataclasses.replace(base, bwd_early_stats=mode))
    np.testing.assert_array_equal(np.asarray(val), np.asarray(ref_val))
    for g, g0 in zip(grads, ref_grads):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(g0))

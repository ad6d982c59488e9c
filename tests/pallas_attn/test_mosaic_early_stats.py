"""``Config.bwd_early_stats``: the dK/dV kernel reads a step's lse (and D) from the stats ring
while the S^T (dP^T) wgmma runs instead of after waiting for it.

Compiled only (interpret mode has no async wgmma and ignores it). Checked on the kernels lowered
for sm90 on the CPU host (the dK/dV kernel at H = 128, the split one at H = 256): in the step's
instruction stream, the shared-memory loads of the statistics move in front of the wait for the
product they follow. The gradients are the same
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


def _step_events(cfg, h: int) -> list[tuple[str, int]]:
  """The dK/dV kernel's lowered text as runs of (event, count): "mma" (wgmma issues), "wait"
  (wgmma.wait_group) and "lds" (loads from shared memory, address space 3)."""
  low = mosaic_mlir.lower_attention(cfg, head_dim=h, grad=True, causal=False)
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


def _early_loads(events) -> int:
  """Runs of shared-memory loads issued before a product finishes: followed by a wgmma wait
  (read while the product runs) or by the 16 wgmmas of a product over the head dim (read
  before it is issued). The late form reads them after the wait, in front of their first use,
  where the consumer stalled on each load's latency."""
  return sum(a[0] == "lds" and (b[0] == "wait" or b == ("mma", 16))
             for a, b in zip(events, events[1:]))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled runs lower it for real")
@pytest.mark.parametrize("h", [128, 256], ids=["dkdv_kernel", "split_kernel"])
def test_stats_loads_move_before_the_waits(h):
  # Unmasked, 4096 keys: the grid kernel (H = 128) or the split one (H = 256), with only the
  # unmasked step form. lse and D are one run of 8 loads each (64 columns, two floats a load).
  base = default_config(head_dim=h, seq_k=4096, masked=False)
  modes = ("", "lse", "lse_pre", "lse+delta", "lse+delta_early", "lse_pre+delta_early",
           "lse_pre+delta_acc")
  got = {mode: _step_events(dataclasses.replace(base, bwd_early_stats=mode), h)
         for mode in modes}
  early = {mode: _early_loads(ev) for mode, ev in got.items()}
  assert early == {"": 0, "lse": 1, "lse_pre": 1, "lse+delta": 2,
                   "lse+delta_early": 2 if h == 256 else 1,
                   "lse_pre+delta_early": 2 if h == 256 else 1,
                   "lse_pre+delta_acc": 2 if h == 256 else 1}
  loads = {mode: sum(n for ev, n in evs if ev == "lds") for mode, evs in got.items()}
  assert {loads[m] for m in modes} == {16}                       # the same loads, moved
  if h == 128:
    # "lse+delta_early": D's run of loads comes before dV's wgmmas are issued, so it follows
    # the S^T wait (S^T, dP^T issued; wait; loads; dV issued), the run "lse+delta" has after.
    ev = got["lse+delta_early"]
    at = [i for i, e in enumerate(ev) if e == ("lds", 8)]
    assert [ev[i - 1][0] for i in at] == ["mma", "wait"] and ev[at[1] + 1][0] == "mma"
    # "lse_pre": lse's run comes before S^T and dP^T are issued (the 16 wgmmas right after
    # it), where "lse" issues them first and reads lse before their wait.
    pre, lse = got["lse_pre"], got["lse"]
    i = pre.index(("lds", 8))
    assert pre[i + 1] == ("mma", 16) and pre[i - 1] != ("mma", 16)
    j = lse.index(("lds", 8))
    assert lse[j - 1] == ("mma", 16) and lse[j + 1][0] == "wait"
    # "lse_pre+delta_early": lse's run as "lse_pre", D's as "lse+delta_early".
    both = got["lse_pre+delta_early"]
    at = [i for i, e in enumerate(both) if e == ("lds", 8)]
    assert both[at[0] + 1] == ("mma", 16) and both[at[0] - 1] != ("mma", 16)
    assert both[at[1] - 1][0] == "wait" and both[at[1] + 1][0] == "mma"
    # "lse_pre+delta_acc": D's loads join lse's in one run before S^T and dP^T are issued
    # (-D is dP^T's starting accumulator), and none follows the products.
    acc = got["lse_pre+delta_acc"]
    assert acc[:2] == [("lds", 16), ("mma", 16)] and acc.count(("lds", 16)) == 1
  assert Config().bwd_early_stats == ""


@pytest.mark.parametrize("h,seq_k,masked,want", [
    (128, 4096, False, "lse_pre"),      # the unmasked grid kernel (session 43: -0.4..-2.3%)
    (128, 1024, False, "lse_pre"),      # the persistent dK/dV kernel (-1.9%)
    (128, 4096, True, "lse_pre"),       # causal: -3.6..-7.5% fwd+bwd (H100, session 43)
    (64, 4096, True, ""),               # causal and windowed too (session 35)
    (64, 4096, False, ""),              # 128-query dK/dV steps instead (session 32)
    (256, 4096, True, "lse+delta")])
def test_default_config_reads_early(h, seq_k, masked, want):
  # H100, sessions 31 and 43 (benchmarks/NOTES.md): the dK/dV kernel 1-16% faster with these.
  assert default_config(head_dim=h, seq_k=seq_k, masked=masked).bwd_early_stats == want
  if h == 128:    # every H = 128 form: key masks, windows and one sequence read lse early too
    for kw in (dict(key_masks=True), dict(windowed=True, masked=True), dict(batch=1)):
      assert default_config(head_dim=h, seq_k=seq_k, **kw).bwd_early_stats == "lse_pre"
  if h == 64:     # windowed calls take the 128-wide steps since session 35, key-masked ones
    # since session 33; the 64-wide steps under 512 keys keep reading early
    assert default_config(head_dim=h, seq_k=seq_k, windowed=True,
                          masked=True).bwd_early_stats == ""
    assert default_config(head_dim=h, seq_k=384, masked=True).bwd_early_stats == "lse+delta"
    assert default_config(head_dim=h, seq_k=seq_k, masked=masked,
                          key_masks=True).bwd_early_stats == ""


def test_bad_value_raises():
  for bad in ("delta", "pre", "lse+delta_pre"):
    with pytest.raises(ValueError, match="bwd_early_stats"):
      Config(bwd_early_stats=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("h,causal", [(128, False), (128, True), (256, False)])
def test_early_stats_gradients_bitwise_compiled(h, causal):
  """Compiled: the same loads, earlier, so out and every gradient equal the default's."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  keys = jax.random.split(jax.random.key(30), 4)
  q, k, v = (jax.random.normal(kk, (2, 1024, 4, h), jnp.bfloat16) for kk in keys[:3])
  base = default_config(head_dim=h, seq_k=1024, masked=causal)
  base = dataclasses.replace(base, bwd_persistent=False,     # grid kernels (H = 256: split)
                             bwd_early_stats="")              # the late reads, to compare

  def run(cfg):
    f = lambda q, k, v: flash_attention(q, k, v, causal=causal, implementation="mosaic",
                                        config=cfg).astype(jnp.float32).sum()
    return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)
  ref_val, ref_grads = run(base)
  for mode in ("lse", "lse_pre", "lse+delta", "lse+delta_early", "lse_pre+delta_early"):
    val, grads = run(dataclasses.replace(base, bwd_early_stats=mode))
    np.testing.assert_array_equal(np.asarray(val), np.asarray(ref_val))
    for g, g0 in zip(grads, ref_grads):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(g0))

"""``Config.exit_read_only``: each attention kernel's last TMA-store wait is for the SMEM reads
only (``cp.async.bulk.wait_group.read``), so a CTA leaves its SM a global-write latency sooner.

Compiled only (interpret mode keeps the full wait); checked here on the kernels' MLIR lowered
for sm90 on the CPU host: forward, dQ and dK/dV, and the split dK/dV kernel at H = 256.
"""
import dataclasses
import re

import jax
import pytest

from benchmarks import mosaic_mlir
from pallas_attn.mosaic import Config, default_config


def _bulk_waits(cfg, h):
  low = mosaic_mlir.lower_attention(cfg, head_dim=h, grad=True, causal=False)
  return [re.findall(r"cp\.async\.bulk\.wait_group[^\n]*", t) for t in
          mosaic_mlir.kernel_texts(low)]


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled runs lower it for real")
@pytest.mark.parametrize("h", [64, 256])
def test_last_store_wait_reads_only(h):
  # (the persistent kernels, default up to 1024 keys (backward; the H = 64 forward from 129
  # keys), wait read-only inside their loop)
  base = dataclasses.replace(default_config(head_dim=h, seq_k=1024, masked=False),
                             persistent=False, bwd_persistent=False)
  full = _bulk_waits(base, h)
  read = _bulk_waits(dataclasses.replace(base, exit_read_only=True), h)
  assert len(full) == len(read) == 3                     # forward, dQ, dK/dV
  for f, r in zip(full, read):
    assert f and all(w.strip().endswith("0") for w in f)              # full waits
    assert r and r[-1].strip().endswith("read")                       # the kernel's last one
    assert len(f) == len(r)
  assert Config().exit_read_only is False

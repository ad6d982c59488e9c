"""A backward kernel's fixed cost per CTA, read off `paired.py` tables (CPU only).

Each unmasked attention row launches a known number of CTAs (tiles) of a known number of ring
steps, so a kernel's time per CTA, t = kernel ms / (CTAs / SMs), should follow

    t(steps) = a + b * steps

across rows of different lengths: b is the cost of a step, a what every CTA pays besides its
steps (launch, the first loads, the pipeline's fill and drain, the epilogue's stores). At 4096
keys a CTA runs 64 steps, at 16384 keys 256, so a fixed cost of a few steps shows up as a
per-unit gap between the two rows (session 45: a ~ 10 us for both backward kernels on the
H100, ~13% of the dQ kernel at 4096 keys; cuDNN's backward is persistent and pays it once).

  .venv/bin/python benchmarks/cta_cost.py benchmarks/results/attention/s45/fwdbwd/paired.json

Rows whose dK/dV kernel is persistent (``default_config``: up to 1024 keys) are reported but
left out of that kernel's fit: there a tile is not a launch.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_attn.mosaic.config import default_config  # noqa: E402

KERNELS = {"dq": "flash_attention_dq_mosaic", "dkdv": "flash_attention_dkdv_mosaic"}
COMPUTE_WGS = 2       # consumer warpgroups a CTA (each owns one block of rows / keys)


@dataclasses.dataclass(frozen=True)
class Point:
  """One row's kernel: its CTAs (tiles), ring steps a CTA, time a CTA (us), whether the launch
  is persistent."""
  row: str
  kernel: str
  ctas: int
  steps: int
  us_per_cta: float
  persistent: bool


def kernel_ms(row: dict, kernel: str) -> float:
  """The row's mean time of ``kernel`` over the two timing orders (ours first, peer first)."""
  times = [k["ms"] for order in ("ours_first", "peer_first")
           for k in row[order]["kernels"] if k["kernel"].startswith(KERNELS[kernel])]
  if not times:
    raise ValueError(f"row {row['shape']} has no {kernel} kernel")
  return sum(times) / len(times)


def launch_shape(b: int, t: int, n: int, h: int, kernel: str) -> tuple[int, int, bool]:
  """(CTAs or tiles, steps a CTA, persistent) of an unmasked self-attention row's ``kernel``
  with the row's ``default_config`` (no GQA: K/V heads = N)."""
  cfg = default_config(head_dim=h, seq_k=t, batch=b)
  if kernel == "dq":
    rows = COMPUTE_WGS * cfg.bwd_block_q
    return n * math.ceil(t / rows) * b, math.ceil(t / cfg.bwd_dq_block_kv), False
  keys = COMPUTE_WGS * cfg.bwd_block_kv
  q_step = cfg.bwd_dkdv_block_q or cfg.bwd_block_q
  return n * math.ceil(t / keys) * b, math.ceil(t / q_step), cfg.bwd_persistent


def points(payload: dict, *, sms: int) -> list[Point]:
  """Every unmasked fwd+bwd row's (dQ, dK/dV) points."""
  if payload.get("mode") != "fwdbwd":
    raise ValueError("cta_cost reads fwd+bwd tables (paired.py --mode fwdbwd)")
  if payload.get("variant"):     # both sides launch our kernels: their times would mix
    raise ValueError("cta_cost reads tables against another library (paired.py without "
                     "--against)")
  out = []
  for row in payload["rows"]:
    if row["causal"]:
      continue                                  # causal tiles differ in length
    b, t, n, h = row["shape"]
    for kernel in KERNELS:
      ctas, steps, persistent = launch_shape(b, t, n, h, kernel)
      waves = ctas / sms
      out.append(Point(f"{b}x{t}x{n}x{h}", kernel, ctas, steps,
                       kernel_ms(row, kernel) * 1e3 / waves, persistent))
  return out


def fit(pts: list[Point]) -> tuple[float, float]:
  """Least-squares (a, b) of us_per_cta = a + b * steps over ``pts`` (two distinct lengths at
  least)."""
  xs, ys = [p.steps for p in pts], [p.us_per_cta for p in pts]
  if len(set(xs)) < 2:
    raise ValueError("the fit needs rows of at least two lengths")
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
           / sum((x - mx) ** 2 for x in xs))
  return my - slope * mx, slope


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("tables", nargs="+", help="paired.py JSON files (fwd+bwd, no --against)")
  ap.add_argument("--sms", type=int, default=132, help="SMs of the card (H100 / H200: 132)")
  args = ap.parse_args()
  pts = [p for path in args.tables for p in points(json.load(open(path)), sms=args.sms)]
  print(f"{'row':>16} {'kernel':>6} {'CTAs':>6} {'steps':>6} {'us/CTA':>8}  launch")
  for p in pts:
    print(f"{p.row:>16} {p.kernel:>6} {p.ctas:>6} {p.steps:>6} {p.us_per_cta:>8.1f}  "
          f"{'persistent' if p.persistent else 'grid'}")
  for kernel in KERNELS:
    grid = [p for p in pts if p.kernel == kernel and not p.persistent]
    a, b = fit(grid)
    share = ", ".join(f"{p.row} {a / p.us_per_cta:.1%}" for p in grid)
    print(f"{kernel}: a = {a:.1f} us a CTA, b = {b:.3f} us a step (fixed share: {share})")
  return 0


if __name__ == "__main__":
  sys.exit(main())

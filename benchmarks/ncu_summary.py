"""Summarise an Nsight Compute per-SASS-line export (``run_ncu.sh`` writes ``NAME.sass.csv.gz``).

Prints the instruction mix (warp instructions executed per opcode, with its share of the stall
samples), the stall reasons over all samples, and the source lines with the most samples. Runs
on any machine (no GPU needed):

  python3 benchmarks/ncu_summary.py benchmarks/results/ncu/2026-12-03_s9_w4a16_m1_lop3.sass.csv.gz
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re


def summarise(path: str, top: int = 25) -> None:
  rows = list(csv.reader(gzip.open(path, "rt")))
  header, data = rows[1], [r for r in rows[2:] if len(r) >= len(rows[1])]
  col = {h: i for i, h in enumerate(header)}
  stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
  as_int = lambda r, name: int(r[col[name]] or 0)
  executed, sampled = collections.Counter(), collections.Counter()
  stalls, lines = collections.Counter(), []
  for r in data:
    src = r[col["Source"]].strip()
    op = re.sub(r"^@!?U?P\w+\s+", "", src).split(" ")[0]       # opcode without its predicate
    n_exec, n_samp = as_int(r, "Instructions Executed"), as_int(r, "Warp Stall Sampling (All Samples)")
    executed[op] += n_exec
    sampled[op] += n_samp
    per_line = {c: as_int(r, c) for c in stall_cols}
    stalls.update(per_line)
    lines.append((n_samp, n_exec, src, per_line))
  total_exec, total_samp = sum(executed.values()), max(1, sum(sampled.values()))
  print(f"{path}: {total_exec} warp instructions executed, {total_samp} stall samples")
  print("instruction mix (executed, share, share of samples):")
  for op, n in executed.most_common(top):
    print(f"  {op:28s} {n:11d} {n / total_exec:6.1%}  {sampled[op] / total_samp:6.1%}")
  print("stall reasons:")
  for name, n in stalls.most_common(12):
    print(f"  {name:28s} {n / total_samp:6.1%}")
  print("lines with the most samples:")
  for n_samp, n_exec, src, per_line in sorted(lines, key=lambda t: -t[0])[:top]:
    worst = sorted(per_line.items(), key=lambda kv: -kv[1])[:3]
    print(f"  {n_samp:7d} {n_exec:10d} {src[:60]:60s} "
          + " ".join(f"{k[6:]}={v}" for k, v in worst if v))


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("paths", nargs="+")
  ap.add_argument("--top", type=int, default=25)
  args = ap.parse_args()
  for path in args.paths:
    summarise(path, top=args.top)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

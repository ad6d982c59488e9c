"""Summarise an Nsight Compute per-SASS-line export (``run_ncu.sh`` writes ``NAME.sass.csv.gz``).

Prints the instruction mix (warp instructions executed per opcode, with its share of the stall
samples), the stall reasons over all samples, and the source lines with the most samples. Runs
on any machine (no GPU needed):

  python3 benchmarks/ncu_summary.py benchmarks/results/ncu/2026-12-03_s9_w4a16_m1_lop3.sass.csv.gz

A warp-specialised kernel mixes warps that wait by design (a producer parked on its ring's
mbarriers) with the consumers whose stalls cost time, and the all-samples view mixes them too
(session 30: 27% of the dK/dV kernel's samples were one producer ``BRA``). ``--groups`` splits
the lines by how many times each was executed: a loop body's lines share one count (e.g.
consumer warps x CTAs x steps), so each role's loop is one group, with its own stall reasons;
``--count N`` then restricts the whole summary to the lines executed N times.

``--compare A B`` sets two profiles of the same work side by side (e.g. two forms of one
kernel): samples and executions per opcode, the largest differences in samples first.
Samples are taken at a fixed rate per SM, so their totals follow each kernel's time.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re


def _read(path: str):
  rows = list(csv.reader(gzip.open(path, "rt")))
  header, data = rows[1], [r for r in rows[2:] if len(r) >= len(rows[1])]
  col = {h: i for i, h in enumerate(header)}
  stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
  as_int = lambda r, name: int(r[col[name]] or 0)
  return data, col, stall_cols, as_int


def groups(path: str, top: int = 8) -> list[tuple[int, int, int, list[tuple[str, int]]]]:
  """(execution count, lines, samples, top stall reasons) of the ``top`` groups by samples."""
  data, _, stall_cols, as_int = _read(path)
  lines, samples = collections.Counter(), collections.Counter()
  stalls = collections.defaultdict(collections.Counter)
  for r in data:
    n = as_int(r, "Instructions Executed")
    lines[n] += 1
    samples[n] += as_int(r, "Warp Stall Sampling (All Samples)")
    stalls[n].update({c[6:]: as_int(r, c) for c in stall_cols})
  return [(n, lines[n], samp, stalls[n].most_common(4)) for n, samp in samples.most_common(top)]


def _opcode(src: str, modifiers: bool = False) -> str:
  """A SASS line's opcode without its predicate (and without its .modifiers unless asked)."""
  op = re.sub(r"^@!?U?P\w+\s+", "", src).split(" ")[0]
  return op if modifiers else op.split(".")[0]


def compare(path_a: str, path_b: str, top: int = 15) -> list[tuple[str, int, int, int, int]]:
  """(opcode, samples in A, samples in B, executed in A, executed in B), the ``top`` opcodes
  whose samples differ most (B - A, either sign), largest first."""
  per = []
  for path in (path_a, path_b):
    data, col, _, as_int = _read(path)
    samp, exe = collections.Counter(), collections.Counter()
    for r in data:
      op = _opcode(r[col["Source"]].strip())
      samp[op] += as_int(r, "Warp Stall Sampling (All Samples)")
      exe[op] += as_int(r, "Instructions Executed")
    per.append((samp, exe))
  (sa, ea), (sb, eb) = per
  ops = sorted(set(sa) | set(sb), key=lambda o: (-abs(sb[o] - sa[o]), o))[:top]
  return [(o, sa[o], sb[o], ea[o], eb[o]) for o in ops]


def summarise(path: str, top: int = 25, count: int | None = None) -> None:
  data, col, stall_cols, as_int = _read(path)
  if count is not None:
    data = [r for r in data if as_int(r, "Instructions Executed") == count]
  executed, sampled = collections.Counter(), collections.Counter()
  stalls, lines = collections.Counter(), []
  for r in data:
    src = r[col["Source"]].strip()
    op = _opcode(src, modifiers=True)
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
  ap.add_argument("--groups", action="store_true",
                  help="the lines grouped by execution count (one group per role's loop)")
  ap.add_argument("--count", type=int, help="summarise only the lines executed this many times")
  ap.add_argument("--compare", action="store_true",
                  help="two profiles side by side: samples and executions per opcode")
  args = ap.parse_args()
  if args.compare:
    if len(args.paths) != 2:
      ap.error("--compare takes exactly two paths")
    print(f"A = {args.paths[0]}\nB = {args.paths[1]}")
    print(f"  {'opcode':22s} {'samples A':>10s} {'samples B':>10s} {'B - A':>8s} "
          f"{'executed A':>12s} {'executed B':>12s}")
    for op, sa, sb, ea, eb in compare(*args.paths, top=args.top):
      print(f"  {op:22s} {sa:10d} {sb:10d} {sb - sa:+8d} {ea:12d} {eb:12d}")
    return 0
  for path in args.paths:
    if args.groups:
      total = max(1, sum(g[2] for g in groups(path, top=10 ** 6)))
      print(f"{path}: groups by execution count (count, lines, share of samples, stalls)")
      for n, n_lines, samp, worst in groups(path):
        reasons = " ".join(f"{k}={v / max(1, samp):.0%}" for k, v in worst if v)
        print(f"  {n:11d} {n_lines:5d} {samp / total:6.1%}  {reasons}")
    else:
      summarise(path, top=args.top, count=args.count)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

"""``benchmarks/ncu_summary.py``: Nsight Compute's per-SASS-line export summarised by role.

A synthetic export with a "producer" line parked on a barrier (executed 4 times) and two
"consumer" lines (executed 8 times each): the groups split them, and ``count`` keeps only the
consumer loop's lines and stalls. Then the committed session-30 profile of the dK/dV kernel,
whose consumer loop (8 warps x 2048 CTAs x 64 steps) carries the short-scoreboard stalls that
``Config.bwd_early_stats`` is for.
"""
import csv
import gzip
import io
import pathlib
import sys
from contextlib import redirect_stdout

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ncu_summary as N  # noqa: E402  pylint: disable=wrong-import-position

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_long_sb", "stall_short_sb", "stall_barrier"]


def _export(tmp_path, rows):
  path = tmp_path / "k.sass.csv.gz"
  with gzip.open(path, "wt", newline="") as f:
    w = csv.writer(f)
    w.writerow(["Kernel Name", "k"])
    w.writerow(HEADER)
    w.writerows(rows)
  return str(path)


def test_groups_split_roles_and_count_filters(tmp_path):
  path = _export(tmp_path, [
      ["0x0", "@!P1 BRA 0x10", 90, 4, 90, 0, 0],          # producer waiting for a free slot
      ["0x10", "FFMA R1, R2, 0.5, -R3", 30, 8, 0, 30, 0],  # consumer: waits on a load
      ["0x20", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 10, 8, 0, 0, 10],
  ])
  got = N.groups(path)
  assert [(n, lines, samp) for n, lines, samp, _ in got] == [(4, 1, 90), (8, 2, 40)]
  assert got[1][3][:2] == [("short_sb", 30), ("barrier", 10)]
  out = io.StringIO()
  with redirect_stdout(out):
    N.summarise(path, count=8)
  text = out.getvalue()
  assert "40 stall samples" in text and "BRA" not in text
  assert text.index("stall_short_sb") < text.index("stall_barrier")


def test_session30_dkdv_profile_consumer_loop():
  path = str(ROOT / "benchmarks/results/attention/s30/ncu/attn_dkdv.sass.csv.gz")
  (n0, _, s0, w0), (n1, _, s1, w1) = N.groups(path, top=2)
  assert n0 == 8 * 2048 * 64 and w0[0][0] == "short_sb"       # consumers
  assert n1 == 4 * 2048 * 62 and w1[0][0] == "long_sb"        # producer on its ring's barriers
  assert s0 > s1


def test_compare_orders_opcodes_by_sample_difference(tmp_path):
  a = _export(tmp_path, [["0x0", "@!P1 BRA 0x10", 50, 4, 50, 0, 0],
                         ["0x10", "MUFU.EX2 R1, R2", 20, 8, 0, 20, 0]])
  (tmp_path / "b").mkdir()
  b = _export(tmp_path / "b", [["0x0", "@!P1 NANOSLEEP.SYNCS 0x989680", 45, 9, 45, 0, 0],
                               ["0x10", "MUFU.EX2 R1, R2", 22, 8, 0, 22, 0],
                               ["0x20", "BRA 0x0", 1, 4, 0, 0, 1]])
  got = N.compare(a, b)
  assert got[0] == ("BRA", 50, 1, 4, 4)                   # the predicate is not the opcode
  assert got[1] == ("NANOSLEEP", 0, 45, 0, 9)
  assert got[2] == ("MUFU", 20, 22, 8, 8)


def test_session46_persistent_against_grid_dkdv():
  base = ROOT / "benchmarks/results/attention/s46/ncu"
  got = {op: (sa, sb) for op, sa, sb, _, _ in N.compare(str(base / "attn_dkdv.sass.csv.gz"),
                                                        str(base / "attn_dkdv_pers.sass.csv.gz"),
                                                        top=40)}
  # The persistent kernel's waits sleep (NANOSLEEP) where the grid's spin on a branch.
  assert got["NANOSLEEP"][1] > 10 * got["NANOSLEEP"][0]
  assert got["BRA"][0] > 5 * got["BRA"][1]

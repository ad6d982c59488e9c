"""``benchmarks/attention.py --rounds``: each implementation measured in turn, the fastest kept.

CPU smoke run (wall-clock timing of tiny shapes): every record carries one time per round, its
``ms`` is the fastest of them, and the table has one record per (row, mask, mode, impl).
"""
import json
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import attention  # noqa: E402  pylint: disable=wrong-import-position


def test_rounds_keep_the_fastest(tmp_path):
  rc = attention.main(["--quick", "--allow-cpu", "--impls", "xla,ours-triton", "--rounds", "2",
                       "--rows", "1x128x2x64", "--modes", "fwd", "--out", str(tmp_path)])
  assert rc == 0
  results = json.loads((tmp_path / "attention.json").read_text())["results"]
  keys = [(tuple(r["row"]), r["causal"], r["mode"], r["impl"]) for r in results]
  assert len(keys) == len(set(keys)) == 4                 # 2 impls x full / causal, once each
  for r in results:
    assert r["status"] == "ok", r
    assert len(r["round_ms"]) == 2 and r["ms"] == min(r["round_ms"])

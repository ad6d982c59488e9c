"""One line per result of ``mosaic_one.py --out FILE`` (JSON lines): shape, mask, fields, error
against the reference, our time, cuDNN's, the ratio.

  python3 benchmarks/mosaic_one_summary.py $OUT/fwd.jsonl
"""
from __future__ import annotations

import json
import sys


def main(path: str) -> int:
  with open(path) as f:
    for line in f:
      r = json.loads(line)
      print(r["shape"], "causal" if r["causal"] else "full", r["fields"] or "default",
            "err %.2e" % r.get("rel_err", -1), "ms %.4f" % r.get("ms", -1),
            "cudnn %.4f" % r.get("cudnn_ms", -1), "%.3fx" % r.get("speedup_vs_cudnn", 0))
  return 0


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1]))

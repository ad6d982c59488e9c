#!/usr/bin/env bash
# The attention benchmark in one device call: install the carried wheels, run the whole grid,
# leave attention.json, attention.png and attention.log in $OUT. From the repository root:
#
#   bash benchmarks/run_attention_gpu.sh [extra attention.py arguments]      (carry: [".whl"])
#
# The benchmark stops starting new measurements after --budget-s (400 s) and is killed at
# BENCH_TIMEOUT_S (500 s); either way the JSON written so far is kept and plotted, so the call
# ends inside the device's 10-minute limit with results.
set -u
OUT="${OUT:-/tmp/attention_out}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.." || exit 1
{
  source benchmarks/setup_gpu.sh
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,temperature.gpu \
      --format=csv 2>&1 || true
  timeout -k 10 "${BENCH_TIMEOUT_S:-500}" python3 benchmarks/attention.py --out "$OUT" "$@"
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "run_attention_gpu: attention.py exited with $rc (124 = killed at the timeout)"
    if [ -f "$OUT/attention.json" ]; then
      timeout 60 python3 benchmarks/attention.py --plot-only "$OUT/attention.json"
    fi
  fi
  exit "$rc"
} 2>&1 | tee "$OUT/attention.log"
exit "${PIPESTATUS[0]}"

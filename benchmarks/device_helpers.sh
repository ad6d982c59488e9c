# Helpers for the device-call scripts (benchmarks/run_s*_call*.sh). Source after setup_gpu.sh:
#
#   source benchmarks/device_helpers.sh
#   breakdown NAME SECONDS --rows 4x4096x32x64 --causal 1 --variant "x:field=value"
#   one_fwd 32x512x32x64 --causal "block_kv=128,persistent=True"
#   gpu_tests 200 tests/pallas_attn/test_mosaic_masked_halves.py ...
#   paired 200 --out "$OUT/x" --rows 4x4096x16x128 --causal 0,1 [--against n:field=value]
#
# breakdown: bwd_breakdown.py against cuDNN under a timeout, its JSON kept as $OUT/keep/NAME.json.
# one_fwd: one forward config in its own process (mosaic_one.py, cuDNN on the same inputs),
# appended to $OUT/one.jsonl; the causal flag is "" or --causal.
mkdir -p "$OUT/keep"

breakdown() {
  local name=$1 secs=$2; shift 2
  timeout -k 5 "$secs" python3 benchmarks/bwd_breakdown.py --peers cudnn --budget-s "$secs" \
      --out "$OUT/$name" "$@" 2>&1 | grep -i " ms\|rror" | cut -c1-300 | sed "s/^/$name /"
  cp "$OUT/$name/bwd_breakdown.json" "$OUT/keep/$name.json" 2>/dev/null; rm -rf "${OUT:?}/$name"
}

one_fwd() {
  timeout -k 5 "${ONE_TIMEOUT_S:-75}" python3 benchmarks/mosaic_one.py --shape "$1" $2 \
      --fields "$3" --cudnn --out "$OUT/one.jsonl" 2>&1 | grep "cudnn:\|rror" | cut -c1-160 \
      | sed "s|^|$1 $2 [$3] |"
}

gpu_tests() {
  # The files' compiled (-m gpu) tests under a timeout, 8 workers; prints pytest's summary.
  local secs=$1; shift
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 "$secs" python3 -m pytest -q -m gpu -n 8 \
      -p no:cacheprovider -rfE "$@" 2>&1 | tail -3
}

paired() {
  # paired.py (2 s pre-heat, both orders) under a timeout: paired SECONDS --out ... --rows ...
  local secs=$1; shift
  timeout -k 5 "$secs" python3 benchmarks/paired.py --preheat 2 "$@" 2>&1 | grep -v "^WARNING" \
      | cut -c1-400
}

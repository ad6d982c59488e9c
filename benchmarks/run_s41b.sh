# Session 41, the last ~2.5 minutes of device time: run_s41.sh cut down (an H200: the paired
# fwd+bwd rows first; an H100: the 232-register variant against the default only).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$card"
run() { timeout -k 5 "$1" python3 benchmarks/paired.py --preheat 2 "${@:2}" 2>&1 \
          | grep -v "^WARNING" | cut -c1-400; }
if [[ "$card" == *H200* ]]; then
  run 140 --out "$OUT/fwdbwd" --budget-s 100 --rows 16x1024x16x128,4x4096x16x128
else
  run 140 --out "$OUT/r232" --budget-s 100 --against r232:bwd_registers=232 \
      --rows 4x4096x16x128 --causal 0,1
fi

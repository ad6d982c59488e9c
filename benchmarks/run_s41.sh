# Session 41 (~6 minutes): on an H200, the paired H = 128 table (paired.py, 2 s pre-heat, both
# orders; fwd+bwd then forward), the card, unmeasured since session 38; on an H100
# (three paired tables there already, sessions 39-41), the open defaults decided in the same
# clock state (paired.py --against; "ratio" = variant ms / default ms).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$card"
run() { timeout -k 5 "$1" python3 benchmarks/paired.py --preheat 2 "${@:2}" 2>&1 \
          | grep -v "^WARNING" | cut -c1-400; }
if [[ "$card" == *H200* ]]; then
  H128=16x1024x16x128,4x4096x16x128,1x16384x16x128,8x2048x16x128,2x8192x16x128
  run 260 --out "$OUT/fwdbwd" --budget-s 230 --rows "$H128" --causal 0,1
  run 110 --out "$OUT/fwd" --budget-s 80 --mode fwd --rows "$H128" --causal 0,1
else
  run 200 --out "$OUT/r232" --budget-s 170 --against r232:bwd_registers=232 \
      --rows 4x4096x16x128,1x16384x16x128 --causal 0,1
  run 80 --out "$OUT/es" --budget-s 50 --against noes:bwd_early_stats= \
      --rows 1x16384x16x128 --causal 1
  run 80 --out "$OUT/es_full" --budget-s 50 --against lsed:bwd_early_stats=lse+delta \
      --rows 4x4096x16x128 --causal 0
fi

# Session 44, call 1 (~9 minutes), picked by the card.
# H200 (the card, none lent in sessions 39-43): the paired H = 128 table against cuDNN
#   with the lse_pre default (run_s41.sh's H200 branch: fwd+bwd, then forward), then
#   "lse_pre+delta_acc" against the default at 4x4096 (causal and full).
# H100: run_s44.sh (the compiled early-stats / delta-acc tests and the two D forms).
# Predictions in benchmarks/NOTES.md (session 44).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$card"
run() { timeout -k 5 "$1" python3 benchmarks/paired.py --preheat 2 "${@:2}" 2>&1 \
          | grep -v "^WARNING" | cut -c1-400; }
if [[ "$card" == *H200* ]]; then
  H128=16x1024x16x128,4x4096x16x128,1x16384x16x128,8x2048x16x128,2x8192x16x128
  run 260 --out "$OUT/fwdbwd" --budget-s 230 --rows "$H128" --causal 0,1
  run 110 --out "$OUT/fwd" --budget-s 80 --mode fwd --rows "$H128" --causal 0,1
  run 110 --out "$OUT/acc" --budget-s 90 --against acc:bwd_early_stats=lse_pre+delta_acc \
      --rows 4x4096x16x128 --causal 0,1
else
  bash benchmarks/run_s44.sh
fi

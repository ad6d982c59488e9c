# Session 47, call 1 (~9 minutes, any card): the compiled tests of `bwd_joint` and `bwd_turns`,
# then `bwd_joint` (the dQ and dK/dV kernels in one launch) against the default, paired. Then,
# on an H200 (the card, none lent since session 38), the H = 128 fwd+bwd bar rows
# against cuDNN; on an H100, turns against no turns and turns on causal rows (opt-in).
# Predictions in benchmarks/NOTES.md (session 47).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
gpu_tests 150 tests/pallas_attn/test_mosaic_joint.py tests/pallas_attn/test_mosaic_turns.py
paired 170 --out "$OUT/joint" --budget-s 150 --against joint:bwd_joint=True \
    --rows 4x4096x16x128,2x8192x16x128,1x16384x16x128,8x2048x16x128 --causal 0
if [[ "$card" == *H200* ]]; then
  paired 230 --out "$OUT/fwdbwd" --budget-s 205 \
      --rows 4x4096x16x128,1x16384x16x128,16x1024x16x128 --causal 0,1
else
  paired 100 --out "$OUT/noturns" --budget-s 85 --against noturns:bwd_turns=False \
      --rows 4x4096x16x128,2x8192x16x128 --causal 0
  paired 90 --out "$OUT/turns_causal" --budget-s 75 --against turns:bwd_turns=True \
      --rows 4x4096x16x128,1x16384x16x128 --causal 1
fi

# Session 47 (~8.5 minutes, any card): `bwd_joint` (the dQ and dK/dV kernels in one launch) and
# `bwd_turns` (its wait before the accumulators; on causal rows, opt-in). Compiled bitwise
# tests of both first, then paired fwd+bwd against the default (both timing orders).
# Predictions in benchmarks/NOTES.md (session 47).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
gpu_tests 150 tests/pallas_attn/test_mosaic_joint.py tests/pallas_attn/test_mosaic_turns.py
paired 190 --out "$OUT/joint" --budget-s 170 --against joint:bwd_joint=True \
    --rows 4x4096x16x128,2x8192x16x128,1x16384x16x128,8x2048x16x128 --causal 0
paired 100 --out "$OUT/noturns" --budget-s 85 --against noturns:bwd_turns=False \
    --rows 4x4096x16x128,2x8192x16x128 --causal 0
paired 90 --out "$OUT/turns_causal" --budget-s 75 --against turns:bwd_turns=True \
    --rows 4x4096x16x128,1x16384x16x128 --causal 1

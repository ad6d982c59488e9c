# Session 47 (~6 minutes, any card): `bwd_turns` with the wait before the accumulators. The
# default (turns on unmasked H = 128 from 4096 keys) against no turns, paired fwd+bwd at 4x4096,
# 2x8192 and 8x2048 (not a default there yet); turns on causal rows (opt-in, never timed)
# against the causal default; the compiled bitwise tests (causal among them).
# Prediction in benchmarks/NOTES.md (session 47).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
gpu_tests 100 tests/pallas_attn/test_mosaic_turns.py
paired 120 --out "$OUT/noturns" --budget-s 100 --against noturns:bwd_turns=False \
    --rows 4x4096x16x128,2x8192x16x128 --causal 0
paired 60 --out "$OUT/turns2048" --budget-s 45 --against turns:bwd_turns=True \
    --rows 8x2048x16x128 --causal 0
paired 110 --out "$OUT/turns_causal" --budget-s 90 --against turns:bwd_turns=True \
    --rows 4x4096x16x128,1x16384x16x128 --causal 1

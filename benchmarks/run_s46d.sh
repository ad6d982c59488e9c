# Session 46, call 5 (~4 minutes + start, any card): the new default `bwd_turns` (grid dK/dV
# kernel, unmasked H = 128) against the same config without it, paired fwd+bwd, both orders;
# its compiled bitwise tests. Prediction in benchmarks/NOTES.md (session 46, call 5).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
gpu_tests 90 tests/pallas_attn/test_mosaic_turns.py
paired 120 --out "$OUT/noturns" --budget-s 100 --against noturns:bwd_turns=False \
    --rows 4x4096x16x128,2x8192x16x128,8x2048x16x128 --causal 0

# Session 46, call 4 (~6 minutes + start, any card): `Config.bwd_turns` (the backward's two
# consumers issue S / dP in turn on hardware barriers): its compiled bitwise tests, then paired
# fwd+bwd against each row's default on unmasked rows (grid kernels at 4096 / 16384 keys, the
# persistent dK/dV kernel at 1024, H = 64). Prediction in benchmarks/NOTES.md (session 46).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
gpu_tests 170 tests/pallas_attn/test_mosaic_turns.py
paired 170 --out "$OUT/turns" --budget-s 150 --against turns:bwd_turns=True \
    --rows 4x4096x16x128,1x16384x16x128,16x1024x16x128 --causal 0
paired 70 --out "$OUT/turns64" --budget-s 50 --against turns:bwd_turns=True \
    --rows 4x4096x32x64 --causal 0

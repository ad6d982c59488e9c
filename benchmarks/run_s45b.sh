# Next session, call 2 (written in session 44; ~5 minutes, any card): 128-key dQ steps at
# H = 128 without Q / dO in registers (bwd_dq_block_kv=128, bwd_dq_regs=False) against the
# default, after its compiled tests ("ours is Nx" = variant ms / default ms). Offline: 409
# instructions per 128 keys against 238 per 64, no spills unmasked, 136-140 B causal.
# Prediction in benchmarks/NOTES.md (session 44).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
gpu_tests 200 tests/pallas_attn/test_mosaic_dq128_h128.py
DQ128=dq128:bwd_dq_block_kv=128,bwd_dq_regs=False
paired 170 --out "$OUT/dq128" --budget-s 150 --against "$DQ128" \
    --rows 4x4096x16x128,1x16384x16x128,2x8192x16x128,8x2048x16x128 --causal 0
paired 70 --out "$OUT/dq128_c" --budget-s 50 --against "$DQ128" --rows 4x4096x16x128 --causal 1

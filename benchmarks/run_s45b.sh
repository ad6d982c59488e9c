# Next session, call 2 (written in session 44; ~8 minutes, any card): the compiled mask tests
# with the new default (bwd_dq_delta_acc), then 128-key dQ steps at H = 128 without Q / dO in
# registers (bwd_dq_block_kv=128, bwd_dq_regs=False): its compiled tests, then paired against
# the default ("ours is Nx" = variant ms / default ms). Offline: 409 instructions per 128 keys
# against 238 per 64, no spills unmasked, 136-140 B causal.
# Prediction in benchmarks/NOTES.md (session 44).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
gpu_tests 150 tests/pallas_attn/test_mosaic_dq128_h128.py
# The mask / feature cases compiled with session 44's default (bwd_dq_delta_acc, timed only
# on unmasked and causal rows): the sampled grid, features, fully masked rows, tails, extreme
# logits, NaN padding (32 cases; 23 passed / 9 skipped in session 43).
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 150 python3 -m pytest -q -m "not gpu" -n 8 \
    -p no:cacheprovider -rfE -k mosaic tests/pallas_attn/test_attention.py 2>&1 | tail -3
DQ128=dq128:bwd_dq_block_kv=128,bwd_dq_regs=False
paired 150 --out "$OUT/dq128" --budget-s 130 --against "$DQ128" \
    --rows 4x4096x16x128,1x16384x16x128,2x8192x16x128,8x2048x16x128 --causal 0
paired 60 --out "$OUT/dq128_c" --budget-s 45 --against "$DQ128" --rows 4x4096x16x128 --causal 1

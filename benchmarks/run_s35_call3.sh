# Session 35, call 3 (~5 minutes; trimmed after device time went to failed starts): the new
# H = 64 defaults (masked 128-query dK/dV steps as two 64-query halves, both kernels at 240,
# for causal and windowed calls from 1024 keys) compiled,
# then timed against the defaults they replaced on rows call 1 did not cover, and the pair with
# halves on causal rows of 512 keys (64-wide steps by default there). Predictions in
# benchmarks/NOTES.md (session 35, call 3).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests 200 tests/pallas_attn/test_mosaic_dq_registers.py \
    tests/pallas_attn/test_mosaic_dkdv_block_q.py \
    tests/pallas_attn/test_mosaic_masked_halves.py
OLD_WINDOW="bwd_dkdv_block_q=0,bwd_dq_block_kv=64,bwd_early_stats=lse+delta"
OLD_WINDOW="$OLD_WINDOW,bwd_registers=232,bwd_masked_halves=False"
PAIR="bwd_dkdv_block_q=128,bwd_dq_block_kv=128,bwd_early_stats=,bwd_registers=240"
breakdown ckv 90 --rows 4x4096x32x64 --causal 1 --kv-len 0.75 \
    --variant "cqr:bwd_masked_halves=False"
breakdown w16k 100 --rows 1x16384x32x64 --causal 1 --window 1024 --variant "old:$OLD_WINDOW" \
    --variant "dq64:bwd_dq_block_kv=64"
breakdown c512 80 --rows 32x512x32x64 --causal 1 --variant "ph:$PAIR,bwd_masked_halves=True" \
    --variant "p:$PAIR"

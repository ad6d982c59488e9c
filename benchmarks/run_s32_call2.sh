# Next session, call 2 (written in session 31; ~5 minutes): `Config.bwd_dkdv_block_q=128` at
# H = 64 (the dK/dV kernel's 64-query steps are four 64x64x64 wgmmas a consumer; the kernel
# runs at ~560 TFLOP/s there against ~740 at H = 128, H100 session 31). ptxas offline, unmasked:
# 0 B spilled without early stats (232 or 240 registers), 16 B with "lse" at 240; causal
# 350-480 B, so unmasked rows only. Both timing orders, cuDNN in the same process; then the
# compiled tests of the new field (ratio rule against the reference).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
for order in first last; do
  extra=(); [ "$order" = last ] && extra=(--ours-last)
  timeout -k 5 150 python3 benchmarks/bwd_breakdown.py --out "$OUT/h64_$order" \
      --rows 4x4096x32x64 --causal 0 --peers cudnn --budget-s 135 "${extra[@]}" \
      --variant "q128:bwd_dkdv_block_q=128,bwd_early_stats=" \
      --variant "q128r:bwd_dkdv_block_q=128,bwd_early_stats=,bwd_registers=240" \
      --variant "q128l:bwd_dkdv_block_q=128,bwd_early_stats=lse,bwd_registers=240" 2>&1 \
      | grep -i " ms\|rror" | sed "s/^/$order /" | cut -c1-110
done
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 150 python3 -m pytest -q -m gpu -n 4 \
    -p no:cacheprovider -rfE tests/pallas_attn/test_mosaic_dkdv_block_q.py 2>&1 | tail -3

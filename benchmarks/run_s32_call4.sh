# Session 32, call 4: the unmasked H = 64 backward default (128-query dK/dV steps, 128-key dQ
# steps, no early stats; default_config) compiled against the reference, then timed in the
# issue table's form (ours, cuDNN, two rounds) at 4x4096x32x64, and against the old default at
# 1x16384x32x64 (bwd_breakdown, one order; no row that long was timed at H = 64 before).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -m gpu -n 8 \
    -p no:cacheprovider -rfE tests/pallas_attn/test_mosaic_dkdv_block_q.py \
    tests/pallas_attn/test_mosaic_early_stats.py tests/pallas_attn/test_mosaic_q_regs.py \
    > "$OUT/tests.log" 2>&1
echo "tests rc=$? $(( $(date +%s) - start )) s: $(tail -1 "$OUT/tests.log")"
timeout -k 5 250 python3 benchmarks/attention.py --out "$OUT/fwdbwd_h64" --modes fwdbwd \
    --rounds 2 --impls ours-mosaic,cudnn --budget-s 230 --rows 4x4096x32x64 2>&1 \
    | grep -i " ms \|rror" | cut -c1-120
timeout -k 5 150 python3 benchmarks/bwd_breakdown.py --peers cudnn --budget-s 135 \
    --out "$OUT/h64_16k" --rows 1x16384x32x64 --causal 0 \
    --variant "old:bwd_dkdv_block_q=0,bwd_dq_block_kv=64,bwd_early_stats=lse+delta" 2>&1 \
    | grep -i " ms\|rror" | cut -c1-230

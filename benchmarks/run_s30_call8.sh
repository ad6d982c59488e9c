# Session 30, last call (~2 minutes): the dK/dV kernel with its lse (and D) read from SMEM while
# the S^T (dP^T) wgmma runs (`Config.bwd_early_stats`), against the default, at 4x4096x16x128
# full; gradients compared with the default's (must be bitwise: the same loads, earlier).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -k 5 ${LIMIT:-150} python3 benchmarks/bwd_breakdown.py --out "$OUT/es" \
    --rows ${ROWS:-4x4096x16x128} --causal ${CAUSAL:-0} --peers cudnn --budget-s 120 \
    --variant lse:bwd_early_stats=lse --variant both:bwd_early_stats=lse+delta "$@" 2>&1 \
    | grep -i "ms\|rror" | cut -c1-150

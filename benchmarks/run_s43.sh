# Next session, call 1 (written in session 42; ~6 minutes, any card): bwd_early_stats="lse_pre"
# (lse read before S^T / dP^T are issued, not queued behind their shared-memory operand reads)
# compiled against the late and early reads (bitwise), then against each row's default in the
# same clock state (paired.py --against; "ours is Nx" = variant ms / default ms: > 1 the default
# is faster, < 1 the variant is). Prediction in NOTES (session 42, "lse_pre").
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 150 python3 -m pytest -q -x -m gpu \
    -p no:cacheprovider tests/pallas_attn/test_mosaic_early_stats.py 2>&1 | tail -3
timeout -k 5 300 python3 benchmarks/paired.py --preheat 2 --out "$OUT/pre" --budget-s 270 \
    --against pre:bwd_early_stats=lse_pre --causal 1,0 \
    --rows 4x4096x16x128,1x16384x16x128 2>&1 | grep -v "^WARNING" | cut -c1-400
# The other rows: bash benchmarks/run_s43b.sh (~7 minutes).

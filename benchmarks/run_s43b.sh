# Next session, call 2 (written in session 42; ~7 minutes, any card): run_s43.sh's paired
# lse_pre decision on the other H = 128 rows (prediction in NOTES, session 42, "lse_pre").
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout -k 5 420 python3 benchmarks/paired.py --preheat 2 --out "$OUT/pre_b" --budget-s 380 \
    --against pre:bwd_early_stats=lse_pre --causal 1,0 \
    --rows 8x2048x16x128,2x8192x16x128,16x1024x16x128 2>&1 | grep -v "^WARNING" | cut -c1-400

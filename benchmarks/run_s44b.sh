# Next session, call 2 (written in session 43; ~5 minutes, any card): bwd_dq_delta_acc (the
# dQ kernel's dP accumulator starts from -D; the causal mask-free loop 275 -> 244 instructions
# a step, offline SASS), then with the dK/dV kernel's "lse_pre+delta_acc" as well, against the
# default in the same clock state ("ours is Nx" = variant ms / default ms). Prediction in
# benchmarks/NOTES.md (session 43).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 150 python3 -m pytest -q -x -m gpu \
    -p no:cacheprovider tests/pallas_attn/test_mosaic_delta_acc.py 2>&1 | tail -3
run() { timeout -k 5 "$1" python3 benchmarks/paired.py --preheat 2 "${@:2}" 2>&1 \
          | grep -v "^WARNING" | cut -c1-400; }
run 130 --out "$OUT/dqacc" --budget-s 110 --against dqacc:bwd_dq_delta_acc=True \
    --rows 4x4096x16x128,2x8192x16x128,1x16384x16x128 --causal 1
run 70 --out "$OUT/dqacc_full" --budget-s 50 --against dqacc:bwd_dq_delta_acc=True \
    --rows 4x4096x16x128 --causal 0
run 90 --out "$OUT/both" --budget-s 70 \
    --against both:bwd_dq_delta_acc=True,bwd_early_stats=lse_pre+delta_acc \
    --rows 4x4096x16x128,1x16384x16x128 --causal 1

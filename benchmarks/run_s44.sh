# Next session, call 1 (written in session 43; ~6 minutes, any card): the two opt-in D forms
# of bwd_early_stats against the H = 128 default "lse_pre", in the same clock state
# (paired.py --against; "ours is Nx" = variant ms / default ms: > 1 the default is faster).
# - "lse_pre+delta_acc": -D is dP^T's starting accumulator (no FADD waits on D's loads; the
#   causal mask-free loop 350 -> 318 instructions, offline SASS);
# - "lse_pre+delta_early": D read before dV's issue (3 STL + 3 LDL a step at 4x4096).
# Prediction in benchmarks/NOTES.md (session 43).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 240 python3 -m pytest -q -x -m gpu \
    -p no:cacheprovider tests/pallas_attn/test_mosaic_early_stats.py \
    tests/pallas_attn/test_mosaic_delta_acc.py 2>&1 | tail -3
run() { timeout -k 5 "$1" python3 benchmarks/paired.py --preheat 2 "${@:2}" 2>&1 \
          | grep -v "^WARNING" | cut -c1-400; }
run 230 --out "$OUT/acc" --budget-s 200 --against acc:bwd_early_stats=lse_pre+delta_acc \
    --rows 4x4096x16x128,2x8192x16x128,1x16384x16x128 --causal 0,1
run 80 --out "$OUT/de" --budget-s 60 --against de:bwd_early_stats=lse_pre+delta_early \
    --rows 4x4096x16x128,2x8192x16x128 --causal 0

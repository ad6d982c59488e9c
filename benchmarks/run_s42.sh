# Next session, call 1 (written in session 41; ~6 minutes, any card): Config.bwd_free_first
# (the grid dK/dV kernel's mask-free Q blocks first; untimed) compiled against the reference,
# then against the default in the same clock state on the causal H = 128 rows (paired.py
# --against; "ratio" = variant ms / default ms, < 1: the variant is faster). Prediction
# (NOTES, session 41, "A lead for the causal dK/dV rate"): 0.97-0.98 if the late start of
# the step's first wgmma is exposed, 1.00 if the other consumer hides it.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 150 python3 -m pytest -q -x -m gpu \
    -p no:cacheprovider tests/pallas_attn/test_mosaic_free_first.py 2>&1 | tail -4
timeout -k 5 200 python3 benchmarks/paired.py --preheat 2 --out "$OUT/ff" --budget-s 170 \
    --against ff:bwd_free_first=True --causal 1 \
    --rows 4x4096x16x128,1x16384x16x128,2x8192x16x128,8x2048x16x128 2>&1 \
    | grep -v "^WARNING" | cut -c1-400

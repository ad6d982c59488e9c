# Next session, call 1 (written in session 39; ~8 minutes): the H = 128 rows of the issue table
# with ours and cuDNN interleaved (paired.py, 2 s pre-heat, both orders), fwd+bwd then forward,
# and two rows without pre-heat (the boost-clock state) to see whether this card is
# power-capped as the H100 was (session 39: 700 W, SM clock 1425-1785 of 1980 MHz).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
H128=4x4096x16x128,1x16384x16x128,2x8192x16x128,8x2048x16x128,16x1024x16x128
timeout -k 5 330 python3 benchmarks/paired.py --out "$OUT/fwdbwd" --preheat 2 --budget-s 290 \
    --rows "$H128" --causal 0,1 2>&1 | grep -v "^WARNING" | cut -c1-300
timeout -k 5 100 python3 benchmarks/paired.py --out "$OUT/fwd" --preheat 2 --budget-s 70 \
    --mode fwd --rows "$H128" --causal 0,1 2>&1 | grep -v "^WARNING" | cut -c1-300
timeout -k 5 60 python3 benchmarks/paired.py --out "$OUT/cold" --preheat 0 --budget-s 40 \
    --rows 4x4096x16x128 --causal 0 2>&1 | grep -v "^WARNING" | cut -c1-300

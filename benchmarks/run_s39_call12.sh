# Session 39, call 12: the H = 128 fwd+bwd rows with ours and cuDNN interleaved in one jitted
# function after 2 s of pre-heat (both timed in the power-capped clock state), both orders.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -k 5 380 python3 benchmarks/paired.py --out "$OUT" --preheat 2 --budget-s 330 \
    --rows 4x4096x16x128,1x16384x16x128,2x8192x16x128,8x2048x16x128,16x1024x16x128 \
    --causal 0,1 2>&1 | grep -v "^WARNING" | cut -c1-300

# Next session, call 2 (written in session 34; ~5 minutes): the rows session 34 left untimed.
# fwd+bwd per kernel at 512 keys, H = 128 (forward 0.95x cuDNN there, session 34), and the FP8
# forward with the defaults it inherited in session 34 (H = 64 persistent from 129 keys,
# masked H = 128 persistent at every length) on two of the rows that changed.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader
breakdown h128_512 120 --rows 32x512x16x128 --causal 0,1
timeout -k 5 200 python3 benchmarks/attention_fp8.py --out "$OUT/fp8" --causal 0,1 \
    --rows 16x1024x32x64,1x16384x16x128 --budget-s 180 --breakdown 2>&1 | tail -12 | cut -c1-200
cp "$OUT/fp8/"*.json "$OUT/keep/" 2>/dev/null; rm -rf "${OUT:?}/fp8"

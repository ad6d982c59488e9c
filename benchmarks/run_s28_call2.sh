# Next session, call 2 (~9 minutes; written in session 27): issue #3's H = 128 forward rows with
# today's defaults (1x16384 full now on three consumers), ours, cuDNN and tokamax's Mosaic
# backend, each timed twice in turn (`--rounds 2`: each implementation's faster round), as
# runs e and f of the README's table were.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -k 5 560 python3 benchmarks/attention.py --out "$OUT/table" --modes fwd --rounds 2 \
    --impls ours-mosaic,cudnn,tokamax-mosaic --budget-s 520 \
    --rows 1x16384x16x128,4x4096x16x128,2x8192x16x128,16x1024x16x128,8x2048x16x128 2>&1 \
    | grep -i "ms\|rror" | tail -24

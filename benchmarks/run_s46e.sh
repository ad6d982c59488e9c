# Session 46, call 5 as cut to the device time left (~2 minutes + start): the new default
# `bwd_turns` against the same config without it, paired fwd+bwd, both orders, at 2048 keys
# (not measured with turns before) and 4096. Prediction: benchmarks/NOTES.md, call 5.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
paired 90 --out "$OUT/noturns" --budget-s 70 --against noturns:bwd_turns=False \
    --rows 8x2048x16x128,4x4096x16x128 --causal 0

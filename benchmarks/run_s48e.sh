# Session 48, call 3 (~4 minutes, any card): `bwd_turns` where it is not the default yet, in
# session 46's placement, paired fwd+bwd against the default (both orders): 8x2048 full (the
# grid dK/dV kernel, untimed with turns) and 4x4096 causal (timed only in session 47's moved
# form: +0.4%). Prediction in benchmarks/NOTES.md (session 48, call 3).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
paired 120 --out "$OUT/turns2048" --budget-s 100 --against turns:bwd_turns=True \
    --rows 8x2048x16x128 --causal 0
paired 120 --out "$OUT/turnscausal" --budget-s 100 --against turns:bwd_turns=True \
    --rows 4x4096x16x128 --causal 1

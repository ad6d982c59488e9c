# Session 16, device call 5 (~5 minutes): (1) stream_probe.py's private-region order (each CTA
# streams its own contiguous region, as the W4A16 kernel's CTAs do) against the round-robin deal
# of call 2; (2) issue #3's H = 256 rows with today's defaults (the split backward), ours /
# cuDNN / tokamax in one process (attention.py).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
timeout -k 5 90 python3 benchmarks/stream_probe.py --out "$out" --budget-s 70 \
    --only tma_c132_r16x256_s4,tma_c264_r16x256_s4,tma_private 2>&1 \
    | grep -v "^W0\|^I0\|Deprecation\|return plgpu" | tail -8
BENCH_TIMEOUT_S=280 bash benchmarks/run_attention_gpu.sh --impls ours-mosaic,cudnn,tokamax-mosaic \
    --rows 4x4096x8x256 --budget-s 240 2>&1 | grep -v "^W0\|^I0\|setup_gpu" | tail -14

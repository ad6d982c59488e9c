# Next session, call 1 (<= 6 minutes; written in session 26, never run): which piece hangs the
# GPU in flash_attention_fp8_kv with the fused Q pass at 16x1024x16x128 (benchmarks/
# fp8_hang_probe.py: each variant in its own process under a timeout).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
timeout -k 5 340 python3 benchmarks/fp8_hang_probe.py --out "$OUT/hang" --timeout-s 45 2>&1 \
    | grep "variant" | cut -c1-200

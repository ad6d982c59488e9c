# Next session, call 1 (~7 minutes; written in session 26, never run): (1) the FP8 compiled
# tests (V's scales moved into the kernel's epilogue after session 26's device time);
# (2) which piece hangs the GPU in flash_attention_fp8_kv with the fused Q pass at
# 16x1024x16x128 (benchmarks/fp8_hang_probe.py: each variant in its own process under a
# timeout); (3) the end-to-end rows again (fp8 with XLA's quantisation, fp8-kv, bf16).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 140 python3 -m pytest -q -m gpu -n 4 \
    -p no:cacheprovider -rfE tests/pallas_attn/test_fp8.py > "$OUT/fp8_tests.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/fp8_tests.log"
timeout -k 5 260 python3 benchmarks/fp8_hang_probe.py --out "$OUT/hang" --timeout-s 30 2>&1 \
    | grep "variant" | cut -c1-200
mkdir -p "$OUT/e2e"
timeout -k 5 100 python3 benchmarks/attention_fp8.py --out "$OUT/e2e" --budget-s 80 \
    --rows 4x4096x16x128,1x16384x16x128 --causal 0 --impls "fp8,fp8-kv,bf16,cudnn" 2>&1 \
    | grep "ms\|rror" | tail -8

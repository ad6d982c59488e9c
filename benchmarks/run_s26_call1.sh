# Next session, call 1 (~8 minutes; written in session 25, never run): the fused FP8
# quantisation pass (pallas_attn/triton/fp8_quantize.py, opt-in fused_quantize=True) compiled
# and timed end to end against the XLA passes, our bf16 forward and cuDNN in one process.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider \
    -rfE tests/pallas_attn/test_triton_fp8_quantize.py tests/pallas_attn/test_fp8.py \
    > "$OUT/fq_tests.log" 2>&1       # (test_fp8: the q-scale prefetch, written after its last run)
echo "pytest rc $?"; tail -4 "$OUT/fq_tests.log"
mkdir -p "$OUT/fused"
timeout -k 5 200 python3 benchmarks/attention_fp8.py --out "$OUT/fused" --budget-s 170 \
    --rows 4x4096x16x128,1x16384x16x128,4x4096x8x256 --causal 0 \
    --impls "fp8-kernel-preg,fp8,fp8-fused,bf16,cudnn" 2>&1 | grep "ms\|rror" | tail -16
# The q scales now travel with Q (prefetched a tile ahead): the short rows, where a TMA round
# trip per tile weighed most.
mkdir -p "$OUT/short"
timeout -k 5 100 python3 benchmarks/attention_fp8.py --out "$OUT/short" --budget-s 80 \
    --rows 16x1024x16x128,8x2048x16x128 --impls "fp8-kernel-preg,bf16" 2>&1 \
    | grep "ms\|rror" | tail -8

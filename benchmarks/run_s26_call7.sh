# Session 26, call 7 (~6 minutes): the session's FP8 changes compiled and timed. Tests: three
# consumers, QuantizedKV, the fused pass at H = 256 (H_256 as two 128-column blocks). Timing,
# one process per row set: the new defaults end to end (fp8: fused up to H = 128, three
# consumers at H = 128 from 8192 keys), the XLA and fused passes forced, K/V quantised once
# (fp8-kv), our bf16 forward and cuDNN.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 150 python3 -m pytest -q -m gpu -n 4 \
    -p no:cacheprovider -rfE tests/pallas_attn/test_triton_fp8_quantize.py \
    tests/pallas_attn/test_fp8.py -k "three_consumers or quantized_kv or fused_pass" \
    > "$OUT/tests.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/tests.log"
mkdir -p "$OUT/e2e"
timeout -k 5 200 python3 benchmarks/attention_fp8.py --out "$OUT/e2e" --budget-s 180 \
    --rows 4x4096x8x256,1x16384x16x128,4x4096x16x128 --causal 0 \
    --impls "fp8,fp8-xla,fp8-fused,fp8-kv,bf16,cudnn" 2>&1 | grep "ms\|rror" | tail -18

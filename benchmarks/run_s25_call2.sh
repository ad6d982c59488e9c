# Session 25, call 2 (~9 minutes): the FP8 forward with one K scale per 256 keys (now the
# default). (1) Every compiled FP8 test (log under $OUT). (2) A sweep on the new default at
# 4x4096x16x128 full and causal: three consumers, exp2 on the FMA pipe for 32 columns.
# (3) The H = 64 and H = 256 rows of the FP8 grid (call 1's budget ended before them).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 230 python3 -m pytest -q -m gpu -n 4 \
    -p no:cacheprovider -rfE tests/pallas_attn/test_fp8.py > "$OUT/fp8_tests.log" 2>&1
echo "pytest rc $?"; tail -6 "$OUT/fp8_tests.log"
mkdir -p "$OUT/sweep" "$OUT/rows"
K=fp8-kernel-preg
timeout -k 5 150 python3 benchmarks/attention_fp8.py --out "$OUT/sweep" --budget-s 125 \
    --rows 4x4096x16x128 --impls "bf16,$K,$K+consumers=3,$K+exp2_poly_cols=32,$K+k_scale_block=1" \
    2>&1 | grep "ms\|rror" | tail -12
timeout -k 5 160 python3 benchmarks/attention_fp8.py --out "$OUT/rows" --budget-s 135 \
    --rows 4x4096x32x64,4x4096x8x256 --impls "$K,fp8,bf16,cudnn,cudnn-fp8" 2>&1 \
    | grep "ms\|rror" | tail -20

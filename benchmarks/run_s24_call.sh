# Session 24, one call for both (~9 minutes; one device start left in the budget):
# W4A16 (session 22's call 1, trimmed): the compiled tests of step_parts / scaled_acc, then
# the one-call forms at 256 and 128 rows against the public path in one process.
# FP8 attention: Nsight Compute on the FP8 forward kernel (why it is slower than bf16), then
# a Config sweep at 4x4096x16x128 full beside our bf16 and FP8 end to end.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/w4a16_ptxas.sh
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 100 python3 -m pytest -q -m gpu -p no:cacheprovider \
    -rfE tests/quant/test_int4_matmul_mosaic_step_parts.py \
    tests/quant/test_int4_matmul_mosaic_scaled.py 2>&1 | tail -3
w4a16_probe_run m256a 256x8192x28672 api,half512,one_call,one_call_carry 85
w4a16_probe_run m128 128x8192x28672 api,one_call,half512_scaled 45
OUT="$OUT/ncu" timeout -k 5 100 bash benchmarks/run_ncu.sh attn_fp8 2>&1 \
    | grep -v "^W0\|^I0" | tail -14
mkdir -p "$OUT/sweep"
K=fp8-kernel; P="+fp8_p_registers=True"
timeout -k 5 90 python3 benchmarks/attention_fp8.py --out "$OUT/sweep" --budget-s 65 \
    --rows 4x4096x16x128 --causal 0 --impls "bf16,fp8,$K,$K-preg,$K+exp2_poly_cols=32,\
$K$P+exp2_poly_cols=32,$K+consumers=3,$K$P+consumers=3,$K+persistent=True" 2>&1 \
    | grep "ms\|rror" | tail -10

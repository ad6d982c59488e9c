# Session 19, device call 2: the M = 57..64 default (128-feature stream-K CTAs with
# out_registers) through the compiled W4A16 Mosaic tests, then w4a16.py at M = 64 (XLA bf16 and
# XLA int4 in the same run) for the README's table.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
WORKERS=14 FILE_TIMEOUT_S=150 OUT="$out/tests" bash benchmarks/run_gpu_tests.sh -m gpu \
    tests/quant/test_int4_matmul_mosaic.py tests/quant/test_int4_matmul_mosaic_forms.py \
    tests/quant/test_int4_matmul_mma_sync.py 2>&1 | tail -6
timeout -k 5 230 python3 benchmarks/w4a16.py --out "$out" --ms 64 --impls mosaic \
    --budget-s 200 2>&1 | grep -v "^W0\|^I0" | tail -12

# Session 18, device call 4: mma.sync now the default for M <= 8 on 512-row stream-K steps
# (1 x 8192 x 28672). The compiled W4A16 Mosaic tests, then w4a16.py at M = 1 and 16 (XLA bf16
# and XLA int4 in the same run) for the README's table.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
WORKERS=14 FILE_TIMEOUT_S=150 OUT="$out/tests" bash benchmarks/run_gpu_tests.sh -m gpu \
    tests/quant/test_int4_matmul_mosaic.py tests/quant/test_int4_matmul_mosaic_forms.py \
    tests/quant/test_int4_matmul_mma_sync.py 2>&1 | tail -6
timeout -k 5 230 python3 benchmarks/w4a16.py --out "$out" --ms 1,16 --impls mosaic \
    --budget-s 200 2>&1 | grep -v "^W0\|^I0" | tail -12

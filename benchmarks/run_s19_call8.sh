# Session 19, device call 8: stream-K with one group's wgmmas in flight (MosaicConfig.pipeline):
# compiled tests, then base / pipe / base again at 64, 32 and 16 rows of 8192 x 28672.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 100 python3 -m pytest -q -n 4 -m gpu \
    -p no:cacheprovider -rfE tests/quant/test_int4_matmul_mosaic_forms.py -k group_pipeline \
    2>&1 | tail -3 | tee "$out/pipeline_tests.txt"
timeout -k 5 150 python3 benchmarks/w4a16_probe.py --out "$out" --budget-s 130 \
    --variants base,pipe,base_again --shapes 64x8192x28672,32x8192x28672,16x8192x28672 \
    2>&1 | grep -v "^W0\|^I0" | grep "x.*ms err" | tail -10

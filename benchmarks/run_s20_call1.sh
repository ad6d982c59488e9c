# Written in session 20 (no device lent then), for the next device session, call 1 of 2: one
# Mosaic W4A16 call at up to 128 rows (MOSAIC_MAX_M 128) and x's own ring of planes
# (MosaicConfig.x_slots): the compiled tests, then the probe at 128 rows (~6 minutes).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -n 8 -m gpu \
    -p no:cacheprovider -rfE tests/quant/test_int4_matmul_mosaic_wide.py \
    tests/quant/test_int4_matmul_mosaic.py 2>&1 | tail -4 | tee "$out/wide_tests.txt"
mkdir -p "$out/m128"
timeout -k 5 150 python3 benchmarks/w4a16_probe.py --out "$out/m128" --budget-s 130 \
    --variants base,xring6,xring4_grid,base_again \
    --shapes 128x8192x28672,128x28672x8192,128x8192x8192 2>&1 | grep -v "^W0\|^I0" \
    | grep "x.*ms err\|bf16" | tail -12

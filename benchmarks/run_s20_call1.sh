# Written in session 20 (no device lent then), for the next device call: one Mosaic W4A16 call
# at up to 128 rows (MOSAIC_MAX_M 128) and x's own ring of planes (MosaicConfig.x_slots),
# compiled tests first, then the probe at 128 rows and M = 128 / 256 through the public path.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -n 8 -m gpu \
    -p no:cacheprovider -rfE tests/quant/test_int4_matmul_mosaic_wide.py \
    tests/quant/test_int4_matmul_mosaic.py 2>&1 | tail -4 | tee "$out/wide_tests.txt"
probe() {  # name, variants, shapes
  mkdir -p "$out/$1"
  timeout -k 5 150 python3 benchmarks/w4a16_probe.py --out "$out/$1" --budget-s 130 \
      --variants "$2" --shapes "$3" 2>&1 | grep -v "^W0\|^I0" | grep "x.*ms err\|bf16" | tail -12
}
probe m128 base,xring6,xring4_grid,base_again 128x8192x28672,128x28672x8192,128x8192x8192
probe m64_xring base,xring4,base_again 64x8192x28672
timeout -k 5 200 python3 benchmarks/w4a16.py --out "$out" --ms 128,256 --impls mosaic \
    --budget-s 180 2>&1 | grep -v "^W0\|^I0" | tail -8

# Session 18, device call 2: MosaicConfig.mma_sync's compiled tests (call 1 ran them without
# XLA_PYTHON_CLIENT_PREALLOCATE=false: 4 workers could not each take 75% of the GPU); the form
# again with x's fragment order as a fusable transpose instead of a gather, on the four M <= 8
# decode shapes; then FA3's intra-warpgroup overlap at H = 256 (run_fwd_variants.sh s18).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -n 4 -m gpu \
    -p no:cacheprovider -rfE tests/quant/test_int4_matmul_mma_sync.py 2>&1 | tail -8 \
    | tee "$out/mma_sync_tests.txt"
timeout -k 5 200 python3 benchmarks/w4a16_probe.py --out "$out" --budget-s 180 \
    --variants base,mmasync,mmasync_grid \
    --shapes 1x8192x28672,1x8192x8192,1x28672x8192,8x8192x28672 2>&1 | grep -v "^W0\|^I0" | tail -14
bash benchmarks/run_fwd_variants.sh s18 2>&1 | tail -12

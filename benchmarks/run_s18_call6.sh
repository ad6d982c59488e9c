# Session 18, device call 6: mma.sync at 16 rows of x (two n8 chains per k16 block): compiled
# tests, then base against mmasync at M = 16 (and 12) on the three shapes.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -n 8 -m gpu \
    -p no:cacheprovider -rfE tests/quant/test_int4_matmul_mma_sync.py 2>&1 | tail -4 \
    | tee "$out/mma_sync_tests.txt"
timeout -k 5 200 python3 benchmarks/w4a16_probe.py --out "$out" --budget-s 180 \
    --variants base,mmasync --shapes 16x8192x28672,12x8192x28672,16x28672x8192,16x8192x8192 \
    2>&1 | grep -v "^W0\|^I0" | tail -10

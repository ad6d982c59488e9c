# Session 18, device call 1 (~5 minutes; written at the end of session 17, not yet run):
# (1) the skinny-wgmma / mma.sync throughput probe (no memory traffic); (2) the compiled tests of
# MosaicConfig.mma_sync (never run on a GPU); (3) the decode kernel's compute split (nodq,
# half_mma) and the mma.sync form against base, XLA bf16 in the same process. Outputs in $OUT.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
timeout -k 5 150 python3 benchmarks/wgmma_probe.py --out "$out" --budget-s 120 2>&1 \
    | grep -v "^W0\|^I0" | tail -30
timeout -k 5 200 python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
    tests/quant/test_int4_matmul_mma_sync.py 2>&1 | tail -8 | tee "$out/mma_sync_tests.txt"
timeout -k 5 220 python3 benchmarks/w4a16_probe.py --out "$out" --budget-s 190 \
    --variants base,nodq,half_mma,no_mma,mmasync,mmasync_grid 2>&1 | grep -v "^W0\|^I0" | tail -25

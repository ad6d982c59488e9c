# Session 17, device call 1 (~6 minutes): (1) the W4A16 decode kernel's memory pipeline,
# piece by piece (stream_probe.py's "extras": the bare TMA ring plus the decode kernel's
# per-step 512-byte scale / zero boxes and 8 KB x box; w4a16_probe.py's no-compute variants
# with those copies replaced by plain barrier arrivals); (2) Config.lazy_rescale's compiled
# -m gpu tests (never run on a GPU before). Outputs under $OUT.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
timeout -k 5 200 python3 benchmarks/stream_probe.py --out "$out" --only extras --budget-s 170 2>&1 \
    | grep -v "^W0\|^I0" | tail -25
timeout -k 5 200 python3 benchmarks/w4a16_probe.py --out "$out" --budget-s 170 \
    --variants base,no_mma,no_mma_nox,no_mma_nosz,no_mma_codes 2>&1 | grep -v "^W0\|^I0" | tail -25
timeout -k 5 150 python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider \
    tests/pallas_attn/test_mosaic_lazy_rescale.py 2>&1 | tail -12 | tee "$out/lazy_tests.txt"

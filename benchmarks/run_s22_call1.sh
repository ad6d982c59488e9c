# Session 22, call 1 (~8 minutes): MosaicConfig.half_steps compiled and timed, then session 21's
# call 4 (ptxas of the grid step pipeline; M = 256 through the public path with unrolled chunks).
# half_steps: the ring walks half layout steps, so 128 rows on the 512-row layout (8192 x 28672)
# fit two stages of 128-feature CTAs in one call instead of 64-row chunks.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 100 python3 -m pytest -q -m gpu -p no:cacheprovider \
    -rfE tests/quant/test_int4_matmul_mosaic_half_steps.py 2>&1 | tail -2
source benchmarks/w4a16_ptxas.sh
H="MosaicConfig(block_n=128, block_k=512, num_stages=2, out_registers=True, half_steps=True)"
w4a16_ptxas 128 8192 28672 "$H"
mkdir -p "$out/half"
timeout -k 5 200 python3 benchmarks/w4a16_probe.py --out "$out/half" --budget-s 170 \
    --variants api,half512,half512_split2,bk256_wide \
    --shapes 128x8192x28672,96x8192x28672,256x8192x28672 2>&1 \
    | grep -v "^W0\|^I0" | grep "x.*ms err\|bf16" | tail -18
w4a16_ptxas 8 8192 28672 "MosaicConfig(block_n=64, block_k=512, num_stages=4, pipeline=True)"
w4a16_ptxas 16 8192 8192 "MosaicConfig(block_n=128, block_k=256, num_stages=3, split_k=2, pipeline=True)"
timeout -k 5 120 python3 benchmarks/w4a16.py --out "$out" --ms 256 --impls mosaic \
    --budget-s 90 2>&1 | grep -v "^W0\|^I0" | tail -5

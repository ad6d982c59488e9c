# Session 21, call 2 (~9 minutes): after call 1 (the x ring 1.6x slower than the step ring at
# 128 rows; now opt-in), M = 128 / 256 through the public path (prepared weights: 128-row calls
# on 256-row steps, 64-row chunks on 512-row steps), 8192 x 28672 at 128 rows on 256-row steps,
# and ptxas's report (registers, spills, C75xx) of the 128-row kernel, the 64-row default and
# session 19's group pipeline (8-27% slower, undiagnosed); x read as [M, K] by the TMA at 128
# rows (MosaicConfig.direct_x).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 90 python3 -m pytest -q -m gpu -p no:cacheprovider \
    -rfE tests/quant/test_int4_matmul_mosaic_wide.py -k "direct_x or x_ring" 2>&1 | tail -2
timeout -k 5 190 python3 benchmarks/w4a16.py --out "$out" --ms 128,256 --impls mosaic \
    --budget-s 160 2>&1 | grep -v "^W0\|^I0" | tail -10
mkdir -p "$out/m128_bk256"
timeout -k 5 80 python3 benchmarks/w4a16_probe.py --out "$out/m128_bk256" --budget-s 60 \
    --variants bk256_wide,bk256_wide_grid --shapes 128x8192x28672 2>&1 \
    | grep -v "^W0\|^I0" | grep "x.*ms err\|bf16" | tail -5
mkdir -p "$out/direct_x"
timeout -k 5 130 python3 benchmarks/w4a16_probe.py --out "$out/direct_x" --budget-s 100 \
    --variants base,direct_x,base_again --shapes 128x28672x8192,128x8192x8192,64x28672x8192 \
    2>&1 | grep -v "^W0\|^I0" | grep "x.*ms err\|bf16" | tail -3
source benchmarks/w4a16_ptxas.sh
S="MosaicConfig(block_n=128, block_k=512, num_stages=2, stream_ctas=132, out_registers=True"
w4a16_ptxas 128 28672 8192 None
w4a16_ptxas 64 8192 28672 None
w4a16_ptxas 64 8192 28672 "$S, pipeline=True)"
w4a16_ptxas 128 8192 28672 "$S, x_slots=4)"

# Session 21, call 2 (~7 minutes): after call 1 (the x ring 1.6x slower than the step ring at
# 128 rows; now opt-in), M = 128 / 256 through the public path (prepared weights: 128-row calls
# on 256-row steps, 64-row chunks on 512-row steps), 8192 x 28672 at 128 rows on 256-row steps,
# and ptxas's report (registers, spills, C75xx) of the 128-row kernel, the 64-row default and
# session 19's group pipeline (8-27% slower, undiagnosed).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
timeout -k 5 220 python3 benchmarks/w4a16.py --out "$out" --ms 128,256 --impls mosaic \
    --budget-s 190 2>&1 | grep -v "^W0\|^I0" | tail -10
mkdir -p "$out/m128_bk256"
timeout -k 5 110 python3 benchmarks/w4a16_probe.py --out "$out/m128_bk256" --budget-s 90 \
    --variants bk256_wide,bk256_wide_grid,xring4 --shapes 128x8192x28672 2>&1 \
    | grep -v "^W0\|^I0" | grep "x.*ms err\|bf16" | tail -5
source benchmarks/w4a16_ptxas.sh
S="MosaicConfig(block_n=128, block_k=512, num_stages=2, stream_ctas=132, out_registers=True"
w4a16_ptxas 128 28672 8192 None
w4a16_ptxas 64 8192 28672 None
w4a16_ptxas 64 8192 28672 "$S, pipeline=True)"
w4a16_ptxas 128 8192 28672 "$S, x_slots=4)"

# Session 21, call 3 (~6 minutes): x's own ring with the step's codes read from SMEM per plane
# (call 2's ptxas report: the x ring kernel spilled 344 bytes at 128 x 8192 x 28672 with 255
# registers). ptxas first (spills?), the compiled x-ring tests, then the probe at 128 rows.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
source benchmarks/w4a16_ptxas.sh
S="MosaicConfig(block_n=128, block_k=512, num_stages=2, out_registers=True, x_slots=4"
w4a16_ptxas 128 8192 28672 "$S, stream_ctas=132)"
w4a16_ptxas 128 8192 28672 "$S)"
w4a16_ptxas 128 28672 8192 "MosaicConfig(block_n=128, block_k=256, num_stages=2, split_k=2, out_registers=True, x_slots=4)"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 90 python3 -m pytest -q -m gpu -p no:cacheprovider \
    -rfE tests/quant/test_int4_matmul_mosaic_wide.py -k "x_ring" 2>&1 | tail -2
mkdir -p "$out/xring"
timeout -k 5 200 python3 benchmarks/w4a16_probe.py --out "$out/xring" --budget-s 170 \
    --variants bk256_wide,xring4_bk512,xring4_bk512_grid --shapes 128x8192x28672 2>&1 \
    | grep -v "^W0\|^I0" | grep "x.*ms err\|bf16" | tail -4
timeout -k 5 100 python3 benchmarks/w4a16_probe.py --out "$out/xring_256" --budget-s 70 \
    --variants base,xring4,base_again --shapes 128x28672x8192 2>&1 \
    | grep -v "^W0\|^I0" | grep "x.*ms err\|bf16" | tail -4

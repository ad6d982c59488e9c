# Session 21, call 4 (~3 minutes: compile only, then one timing): which pipelined forms draw ptxas's C7513
# ("wgmma serialized: non-wgmma instructions defining input registers of a wgmma")? Call 2
# found it on the stream-K group pipeline (accumulators reset by a zero store, the next
# group's plane dequantized while the previous group's wgmmas run). The grid kernel's step
# pipeline reads its accumulators as differences (no zero store): if it draws C7513 as well,
# the dequant into wgmma's A registers is the cause, not the reset.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/w4a16_ptxas.sh
w4a16_ptxas 8 8192 28672 "MosaicConfig(block_n=64, block_k=512, num_stages=4, pipeline=True)"
w4a16_ptxas 16 8192 8192 "MosaicConfig(block_n=128, block_k=256, num_stages=3, split_k=2, pipeline=True)"
# Then M = 256 through the prepared weight with the chunks unrolled (no XLA while loop).
timeout -k 5 120 python3 benchmarks/w4a16.py --out "${OUT:-/tmp}" --ms 256 --impls mosaic \
    --budget-s 90 2>&1 | grep -v "^W0\|^I0" | tail -5

# Written in session 20, for the next device session, call 2 of 2 (~5 minutes): the x ring
# against the step ring where both fit (64 rows), then M = 128 / 256 through the public path
# (the prepared weight; 256 rows = two calls of 128) with XLA in the same run.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
mkdir -p "$out/m64_xring"
timeout -k 5 100 python3 benchmarks/w4a16_probe.py --out "$out/m64_xring" --budget-s 80 \
    --variants base,xring4,base_again --shapes 64x8192x28672 2>&1 | grep -v "^W0\|^I0" \
    | grep "x.*ms err\|bf16" | tail -6
timeout -k 5 200 python3 benchmarks/w4a16.py --out "$out" --ms 128,256 --impls mosaic \
    --budget-s 180 2>&1 | grep -v "^W0\|^I0" | tail -8

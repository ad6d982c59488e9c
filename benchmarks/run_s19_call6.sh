# Session 19, device call 6: M = 256 through the public Mosaic path (the prepared weight, 64-row
# chunks of the decode kernel: what QuantLinear runs on Hopper), with the new M = 64 default.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
timeout -k 5 230 python3 benchmarks/w4a16.py --out "$out" --ms 256 --impls mosaic \
    --budget-s 200 2>&1 | grep -v "^W0\|^I0" | tail -8

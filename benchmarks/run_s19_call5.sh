# Session 19, device call 5: Config.seq_major (sequence tiles fastest in the Mosaic grids, so the
# resident CTAs share one head's K / V in L2): compiled bitwise tests, then per-kernel fwd+bwd
# times against the default and cuDNN in the same process.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 150 python3 -m pytest -q -m gpu \
    -p no:cacheprovider -rfE tests/pallas_attn/test_mosaic_grid_order.py 2>&1 | tail -3 \
    | tee "$out/grid_order_tests.txt"
timeout -k 5 330 python3 benchmarks/bwd_breakdown.py --out "$out" --budget-s 300 \
    --rows 1x16384x16x128,4x4096x16x128 --causal 0,1 --peers cudnn \
    --variant seq:seq_major=True 2>&1 | grep -v "^W0\|^I0" | tail -30

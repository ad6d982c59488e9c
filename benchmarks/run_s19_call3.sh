# Session 19, device call 3: two CTAs per SM at 32-64 rows on 256-row steps (no SMEM output
# tile, K split doubled), against the default grid.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
timeout -k 5 250 python3 benchmarks/w4a16_probe.py --out "$out" --budget-s 230 \
    --variants base,oreg_split2x,s2_oreg_split2x,base_again \
    --shapes 64x28672x8192,64x8192x8192,32x28672x8192 \
    2>&1 | grep -v "^W0\|^I0" | grep "x.*ms err\|bf16" | tail -16

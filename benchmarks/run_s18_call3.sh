# Session 18, device call 3: where mma.sync was slower (the grid form's 256-row steps at
# 8192 x 8192 and 28672 x 8192), 512-row steps and the stream-K form with and without it.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
timeout -k 5 280 python3 benchmarks/w4a16_probe.py --out "$out" --budget-s 260 \
    --variants base,mmasync,mmasync_bk512,mmasync_bk512_s264,base_bk512_s264,mmasync_s264 \
    --shapes 1x8192x8192,1x28672x8192 2>&1 | grep -v "^W0\|^I0" | tail -16

# Session 40, call 1b (~5 minutes; carry [".whl"]): run_s40_call1.sh's paired H = 128 rows
# (fwd+bwd, then forward) without the cold row, then run_s40_call2.sh's tokamax columns on one
# row only: eleven refused starts left the device time for one short call.
source benchmarks/setup_gpu.sh > /tmp/setup_gpu.log 2>&1
grep -v "^WARNING" /tmp/setup_gpu.log | tail -8
# (sourced, not piped: a pipe would run it in a subshell and lose its PYTHONPATH, as in call 12)
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
H128=4x4096x16x128,16x1024x16x128,1x16384x16x128,8x2048x16x128,2x8192x16x128
timeout -k 5 170 python3 benchmarks/paired.py --out "$OUT/fwdbwd" --preheat 2 --budget-s 140 \
    --rows "$H128" --causal 0,1 2>&1 | grep -v "^WARNING" | cut -c1-300
timeout -k 5 55 python3 benchmarks/paired.py --out "$OUT/fwd" --preheat 2 --budget-s 28 \
    --mode fwd --rows "$H128" --causal 0,1 2>&1 | grep -v "^WARNING" | cut -c1-300
timeout -k 5 80 python3 benchmarks/attention.py --out "$OUT/table" \
    --impls ours-mosaic,cudnn,tokamax-mosaic --modes fwd,fwdbwd --rounds 1 --budget-s 45 \
    --rows 4x4096x16x128 2>&1 | grep -v "^WARNING" | cut -c1-300 | tail -30

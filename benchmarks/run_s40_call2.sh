# Session 40, call 2 (~8 minutes; carry [".whl"]): the issue table's grid with tokamax's Mosaic
# backend beside ours and cuDNN (attention.py, one round each in turn), forward and fwd+bwd.
# tokamax's columns in the README were last measured in session 30 (its wheels were absent
# since); this re-measures them on today's card and cuDNN.
source benchmarks/setup_gpu.sh > /tmp/setup_gpu.log 2>&1
grep -v "^WARNING" /tmp/setup_gpu.log | tail -8
# (sourced, not piped: a pipe would run it in a subshell and lose its PYTHONPATH, as in call 12)
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout -k 5 560 python3 benchmarks/attention.py --out "$OUT/table" \
    --impls ours-mosaic,cudnn,tokamax-mosaic --modes fwd,fwdbwd --rounds 1 --budget-s 520 \
    2>&1 | grep -v "^WARNING" | cut -c1-300 | tail -60

# Session 47, call 3 (~2.5 minutes, any card): run_s47c.sh cut to the budget left. The
# `bwd_joint` probe (finishes? bitwise?) at 2x2048x4x128, then paired against the default at
# 4x4096x16x128 if it passed.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
if timeout -k 5 45 python3 benchmarks/joint_probe.py 2 2048 4 128 2>&1 | tee /dev/stderr \
    | grep -q "bitwise True"; then
  paired 75 --out "$OUT/joint" --budget-s 60 --against joint:bwd_joint=True \
      --rows 4x4096x16x128 --causal 0
fi

# Session 47, call 3 (~4 minutes, any card): run_s47b.sh cut to what the budget allows. The
# `bwd_joint` probe (does it finish, bitwise?) at two shapes, then paired against the default.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout -k 5 60 python3 benchmarks/joint_probe.py 2 2048 4 128 2>&1 | grep -v "^WARNING" | tail -5
if timeout -k 5 50 python3 benchmarks/joint_probe.py 1 4096 8 128 2>&1 | grep -q "bitwise True"; then
  echo "probe 1x4096x8x128: bitwise True"
  paired 110 --out "$OUT/joint" --budget-s 95 --against joint:bwd_joint=True \
      --rows 4x4096x16x128,2x8192x16x128 --causal 0
fi

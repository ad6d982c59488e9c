# Session 47, call 1 (~7 minutes, picked by the card). On an H200 (the card, none
# lent since session 38): the forward grid and the H = 128 fwd+bwd bar rows against
# cuDNN (paired.py), as run_s46_grid.sh, now with `bwd_turns`. On an H100: 
# `run_s47_joint.sh` (the joint backward launch, turns; compiled tests).
# Predictions in benchmarks/NOTES.md (session 47).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
if [[ "$card" == *H200* ]]; then
  bash benchmarks/run_s46_grid.sh
else
  bash benchmarks/run_s47_joint.sh
fi

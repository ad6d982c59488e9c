# Session 47, call 3 (~1 minute, any card): the `bwd_joint` probe alone (does the compiled
# joint launch finish, bitwise the default?) at 2x2048x4x128; what the budget allows.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout -k 5 45 python3 benchmarks/joint_probe.py 2 2048 4 128 2>&1 | grep -v "^WARNING" | tail -6

# Session 47, call 3 (~6 minutes, any card): `bwd_joint` with the semaphores shared by all CTAs
# (call 1's were per-CTA kernel scratch: the launch hung). A probe under a timeout first (does
# it finish, bitwise?), then its compiled tests and the paired timing against the default.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout -k 5 70 python3 benchmarks/joint_probe.py 2 2048 4 128 2>&1 | grep -v "^WARNING" | tail -5
if timeout -k 5 60 python3 benchmarks/joint_probe.py 1 4096 8 128 2>&1 | grep -q "bitwise True"; then
  gpu_tests 120 tests/pallas_attn/test_mosaic_joint.py
  paired 160 --out "$OUT/joint" --budget-s 140 --against joint:bwd_joint=True \
      --rows 4x4096x16x128,2x8192x16x128,1x16384x16x128 --causal 0
fi

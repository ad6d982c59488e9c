# Session 48, call 2 (~5 minutes, any card): where `bwd_joint` loses (call 1: 1.3-2.5% behind
# the two launches). Its compiled tests with the signal now overlapping dQ's store, then
# `joint_variants.py` (default / end / overlap / nosync, rotating order, one process).
# Prediction in benchmarks/NOTES.md (session 48).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
gpu_tests 100 tests/pallas_attn/test_mosaic_joint.py
timeout -k 5 260 python3 benchmarks/joint_variants.py --out "$OUT/variants" --budget-s 220 \
    --shapes 4x4096x16x128,2x8192x16x128 2>&1 | grep -v "^WARNING" | cut -c1-400

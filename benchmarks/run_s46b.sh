# Session 46, call 3 (~4 minutes, any card): the grid dK/dV kernel's exit wait (Nsight
# Compute, call 1: `cp.async.bulk.wait_group 0` + CCTL.IVALL, ~1% of its samples) timed as
# `exit_read_only` on long unmasked rows (session 29 timed it only at 16x1024); dq128 on the
# causal 4x4096 row; the compiled tests of the batch fold (never run compiled).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
paired 110 --out "$OUT/ero" --budget-s 90 --against ero:exit_read_only=True \
    --rows 4x4096x16x128,2x8192x16x128 --causal 0
paired 60 --out "$OUT/dq128c" --budget-s 45 \
    --against dq128:bwd_dq_block_kv=128,bwd_dq_regs=False --rows 4x4096x16x128 --causal 1
gpu_tests 150 tests/pallas_attn/test_mosaic_fold_batch.py tests/pallas_attn/test_mosaic_exit_read_only.py

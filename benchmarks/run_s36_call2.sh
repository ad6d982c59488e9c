# Session 36, call 2 (~3 minutes): the windowed H = 64 forward's new default over 4096 keys
# (128-key persistent form) through the compiled reference test, with the rest of
# test_defaults_compiled; then 4x4096x32x64 window (512, 0) with 64- against 128-key dQ steps.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests 150 "tests/pallas_attn/test_mosaic_masked_halves.py::test_defaults_compiled"
breakdown win_first 80 --rows 4x4096x32x64 --causal 1 --window 512 \
    --variant "dq128:bwd_dq_block_kv=128"

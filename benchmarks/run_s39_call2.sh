# Next session, call 2 (written in session 38; ~6-7 minutes): the persistent backward with its
# tiles now numbered tiles-fastest (`_decode_tile`, session 38: one head's operands shared in
# L2 instead of all heads') against the grid, and `bwd_stream_tail` once more (its exits and
# tail now follow the same order), fwd+bwd per kernel with cuDNN in the same process, both
# orders. Compiled tests of the persistent backward first (bitwise the grid's).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests 120 tests/pallas_attn/test_mosaic_bwd_persistent.py
breakdown pers_a 150 --rows 4x4096x16x128,2x8192x16x128 --causal 0 \
    --variant "pers:bwd_persistent=True" --variant "bt:bwd_stream_tail=True"
breakdown pers_b 150 --rows 4x4096x16x128,2x8192x16x128 --causal 0 \
    --variant "pers:bwd_persistent=True" --variant "bt:bwd_stream_tail=True" --ours-last

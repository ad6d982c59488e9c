# Next session, call 1 (written in session 38; ~7-8 minutes):
# 1. compiled tests never run on a GPU: the one-kernel tail merge (`stream_tail_merge="pallas"`,
#    session 38) and the W4A16 256-row symmetric case whose lowering session 38 fixed;
# 2. the forward's kernels with the tail merge as XLA ops against the one Triton kernel
#    (per-kernel CUPTI), at 8x2048 (where the cut tied on the H100) and 4x4096 / 16x1024;
# 3. the forward in one process per config, cuDNN on the same inputs: 8x2048 with the cut and
#    the kernel merge (the table's one unmasked H = 128 tie), 4x4096 with the kernel merge.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests 170 tests/pallas_attn/test_mosaic_stream_merge.py \
    "tests/quant/test_int4_matmul_mosaic.py::test_compiled_on_gpu"
timeout -k 5 150 python3 benchmarks/stream_tail_breakdown.py "$OUT/merge_breakdown.json" \
    8x2048x16x128 4x4096x16x128 16x1024x16x128 2>&1 | grep -v "^WARNING" | cut -c1-400
ONE_TIMEOUT_S=50
one_fwd 8x2048x16x128 "" ""
one_fwd 8x2048x16x128 "" "stream_tail=True,stream_tail_merge=pallas"
one_fwd 8x2048x16x128 "" ""
one_fwd 4x4096x16x128 "" "stream_tail_merge=pallas"
one_fwd 4x4096x16x128 "" ""

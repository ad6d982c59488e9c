# Session 37, call 1 (~6-8 minutes): compiled reference tests of the windowed H = 64 forward's
# default over 4096 keys (session 36) and of Config.stream_tail (new); then the forward with
# and without stream_tail, one config per process, cuDNN's forward on the same inputs, on the
# unmasked H = 128 rows (2048 tiles on 132 SMs each), default first, in both orders at 4x4096.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests 200 "tests/pallas_attn/test_mosaic_masked_halves.py::test_defaults_compiled" \
    tests/pallas_attn/test_mosaic_stream_tail.py
ONE_TIMEOUT_S=70
one_fwd 4x4096x16x128 "" ""
one_fwd 4x4096x16x128 "" "stream_tail=True"
one_fwd 2x8192x16x128 "" ""
one_fwd 2x8192x16x128 "" "stream_tail=True"
one_fwd 1x16384x16x128 "" "consumers=2,persistent=True,stream_tail=True"
one_fwd 8x2048x16x128 "" ""
one_fwd 8x2048x16x128 "" "stream_tail=True"
one_fwd 4x4096x16x128 "" ""

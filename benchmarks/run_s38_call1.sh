# Next session, call 1 (written in session 37; ~7-9 minutes): Config.bwd_stream_tail (written
# in session 37, interpret-tested, never compiled on a GPU) through its compiled reference
# tests, then timed: fwd+bwd per kernel against cuDNN in the same process, default against
# the tail cut in both orders, on the unmasked H = 128 rows whose tails are largest.
# On an H200 also the forward at 1x16384x16x128: three consumers (default) against two
# persistent ones with the forward's tail cut (H100, session 37: 3.0887 against 3.0700 /
# 3.0806 ms).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
gpu_tests 140 "tests/pallas_attn/test_mosaic_stream_tail.py"
breakdown bt_a 150 --rows 4x4096x16x128,2x8192x16x128 --causal 0 --peers cudnn \
    --variant "bt:bwd_stream_tail=True"
breakdown bt_b 150 --rows 4x4096x16x128,2x8192x16x128 --causal 0 --peers cudnn \
    --variant "bt:bwd_stream_tail=True" --ours-last
case "$name" in
  *H200*)
    ONE_TIMEOUT_S=60
    one_fwd 1x16384x16x128 "" ""
    one_fwd 1x16384x16x128 "" "consumers=2,persistent=True"
    one_fwd 1x16384x16x128 "" "" ;;
  *) breakdown bt_c 110 --rows 1x16384x16x128 --causal 0 --peers cudnn \
         --variant "bt:bwd_stream_tail=True" ;;
esac

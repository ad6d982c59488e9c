# Session 37, call 1 (~8-9 minutes): the windowed H = 64 forward's default over 4096 keys
# (session 36) through the compiled reference test; then on an H200 the issue table's unmet
# H = 128 fwd+bwd rows (4x4096, 1x16384; ours, cuDNN, tokamax's Mosaic backend, two rounds:
# none timed on an H200 since session 30), on an H100 4x4096 window (512, 0) with 64- against
# 128-key dQ steps. Causal on both rows where the budget allows.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
gpu_tests 140 "tests/pallas_attn/test_mosaic_masked_halves.py::test_defaults_compiled"
case "$name" in
  *H200*)
    timeout -k 5 420 python3 benchmarks/attention.py --out "$OUT/fwdbwd_h200" --modes fwdbwd \
        --rounds 2 --impls ours-mosaic,cudnn,tokamax-mosaic --budget-s 390 \
        --rows 4x4096x16x128,1x16384x16x128 2>&1 | grep -i " ms \|rror" | cut -c1-120 ;;
  *) breakdown win_first 80 --rows 4x4096x32x64 --causal 1 --window 512 \
         --variant "dq128:bwd_dq_block_kv=128" ;;
esac

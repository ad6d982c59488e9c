# Next session's first call (written in session 36; ~5-8 minutes). The windowed H = 64 forward's
# new default over 4096 keys (session 36) through the compiled reference test if session 36
# could not run it (run_s36_call2.sh); then on an H200 the issue table's H = 128 fwd+bwd rows
# (part a of run_s32_call1.sh: none timed on an H200 since session 30), on an H100 the whole
# compiled mosaic suite is the next call (run_s32_call3.sh).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
gpu_tests 150 "tests/pallas_attn/test_mosaic_masked_halves.py::test_defaults_compiled"
case "$name" in
  *H200*) bash benchmarks/run_s32_call1.sh a ;;
  *) breakdown win_first 80 --rows 4x4096x32x64 --causal 1 --window 512 \
         --variant "dq128:bwd_dq_block_kv=128" ;;
esac

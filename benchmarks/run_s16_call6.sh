# Session 16, device call 6 (~4 minutes): issue #3's rows measured with --rounds 2 (each
# implementation twice in turn, fastest kept: "ours" no longer pays for going first):
# 4x4096x8x256 (fwd, fwdbwd) and 1x16384x16x128 (fwd), ours / cuDNN / tokamax in one process.
base="${OUT:-/tmp}"
OUT="$base/h256" BENCH_TIMEOUT_S=200 bash benchmarks/run_attention_gpu.sh \
    --impls ours-mosaic,cudnn,tokamax-mosaic --rows 4x4096x8x256 --rounds 2 --budget-s 170 2>&1 \
    | grep "r[01] \|^| 4" | tail -30
OUT="$base/t16k" BENCH_TIMEOUT_S=120 bash benchmarks/run_attention_gpu.sh \
    --impls ours-mosaic,cudnn,tokamax-mosaic --rows 1x16384x16x128 --modes fwd --rounds 2 \
    --budget-s 100 2>&1 | grep "r[01] \|^| 1" | tail -20

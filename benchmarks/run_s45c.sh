# Session 45, call 3 (~2 minutes; FOLD240=1 adds 45 s, any card): Config.bwd_fold_batch (the unmasked grid dK/dV
# kernel with the batch folded into its K/V tile axis). Offline SASS: with 232 registers the
# consumers' step loop at 4x4096 becomes the single-sequence loop (1x16384's), which Nsight
# Compute measured 13% faster per unit of work than the batch >= 2 loop (session 42).
# Paired against each row's default ("ours is Nx" = variant ms /
# default ms). Prediction in benchmarks/NOTES.md (session 45).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
# (Cut to ~2 minutes; FOLD240=1 adds 45 s after two refused starts left 642 s of device time: the compiled tests
# wait; paired.py's max |difference| per output, 0 if bitwise, stands in for them.)
F232=fold232:bwd_fold_batch=True,bwd_registers=232
paired 80 --out "$OUT/fold232" --budget-s 60 --against "$F232" \
    --rows 4x4096x16x128,2x8192x16x128,8x2048x16x128 --causal 0
if [[ -n "$FOLD240" ]]; then
  paired 45 --out "$OUT/fold240" --budget-s 30 --against fold240:bwd_fold_batch=True \
      --rows 4x4096x16x128 --causal 0
fi

# Next session (written in session 45; ~7 minutes, any card): why the persistent dK/dV kernel
# loses to the grid at 4096 keys (session 39, H100: +11%), when the grid pays ~10 us a CTA
# (a linear fit of session 45's per-kernel times over 1024-16384 keys) and cuDNN's backward is
# persistent (132 CTAs, one wave: Nsight Compute, session 30). Paired against each row's
# default, then Nsight Compute on both dK/dV kernels at 4x4096x16x128 (no clock control).
# Prediction in benchmarks/NOTES.md (session 45, "The backward's per-CTA cost").
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
paired 100 --out "$OUT/pers" --budget-s 80 --against pers:bwd_persistent=True \
    --rows 4x4096x16x128,2x8192x16x128 --causal 0
# Both kernels persistent: the dQ kernel is only persistent with D from a pre-pass.
paired 60 --out "$OUT/pers2" --budget-s 40 \
    --against pers2:bwd_persistent=True,bwd_delta_in_dq=False --rows 4x4096x16x128 --causal 0
OUT="$OUT/ncu" bash benchmarks/run_ncu.sh attn_dkdv attn_dkdv_pers 2>&1 \
    | grep -E "rc=|Duration|SM Frequency|Issue Slots|Local Memory|Grid Size"

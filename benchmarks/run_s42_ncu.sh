# Next session (written in session 41; ~5 minutes): Nsight Compute on our dK/dV kernel at
# 1x16384x16x128, unmasked and causal. The causal kernel's matmul rate is 12-17% below the
# unmasked one's (H100, session 41: 578 against 656 TFLOP/s) although its mask-free step loop
# has the same 24 HGMMA and no spills (offline SASS) and the grid is balanced within 2% (list
# schedule): the stall reasons and issue slots of the two say where the difference goes.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
OUT="$OUT/ncu" bash benchmarks/run_ncu.sh attn_dkdv_16k attn_dkdv_16k_causal 2>&1 | tail -70

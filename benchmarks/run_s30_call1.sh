# Next session, call 1 (~6 minutes; written in session 29): how cuDNN's backward gets 608
# TFLOP/s from five matmul units where ours needs seven (benchmarks/NOTES.md, session 29).
# Nsight Compute on cuDNN's flash_bprop kernel and on our dK/dV and dQ kernels at
# 4x4096x16x128 full: launch shape (block size, registers, SMEM per block, CTAs per SM),
# tensor and shared-memory pipe use, stall reasons. cuDNN's kernel name says
# "64x64x128_1x4x1"; the launch statistics say what that tiling is.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
OUT="$OUT/ncu" bash benchmarks/run_ncu.sh cudnn_bwd attn_dkdv attn_dq 2>&1 | tail -80

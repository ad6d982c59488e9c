# Next session, call 1 (~6 minutes; written in session 29): how cuDNN's backward gets 608
# TFLOP/s from five matmul units where ours needs seven (benchmarks/NOTES.md, session 29).
# Nsight Compute on cuDNN's flash_bprop kernel and on our dK/dV and dQ kernels at
# 4x4096x16x128 full: launch shape (block size, registers, SMEM per block, CTAs per SM),
# tensor and shared-memory pipe use, stall reasons. cuDNN's kernel name says
# "64x64x128_1x4x1"; the launch statistics say what that tiling is.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
# Part b (`bash benchmarks/run_s30_call1.sh b`): the H = 256 forward (0.94x cuDNN on the full
# row, the forward's one row short) beside cuDNN's, at 4x4096x8x256 full: our step reads ~256
# KB of SMEM per 8.4 MFLOP (Q and K for S, V for P V, the TMA writes of K and V), about the
# shared-memory pipe's rate against the tensor cores'; does cuDNN's tiling read less?
if [ "${1:-a}" = b ]; then
  OUT="$OUT/ncu" bash benchmarks/run_ncu.sh cudnn_fwd_h256 attn_fwd_h256 2>&1 | tail -60
else
  OUT="$OUT/ncu" bash benchmarks/run_ncu.sh cudnn_bwd attn_dkdv attn_dq 2>&1 | tail -80
fi

# Session 34, call 5 (~4 minutes): the persistent forward forms on rows longer than 4096 keys,
# where every default is still the grid (mosaic_one.py, one config per process, cuDNN's
# forward on the same inputs). The counter's L2-friendly order (session 7) was never timed there.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
export ONE_TIMEOUT_S=60
nvidia-smi --query-gpu=name --format=csv,noheader
C="block_kv=128,persistent=True,dynamic_schedule=True,q_regs_cols=64"
one_fwd 1x16384x32x64 --causal ""
one_fwd 1x16384x32x64 --causal "$C"
one_fwd 1x16384x32x64 "" ""
one_fwd 1x16384x32x64 "" "persistent=True,named_barriers=False,q_regs_cols=64"
one_fwd 1x16384x16x128 --causal ""
one_fwd 1x16384x16x128 --causal "persistent=True,dynamic_schedule=True"
one_fwd 2x8192x16x128 --causal ""
one_fwd 2x8192x16x128 --causal "persistent=True,dynamic_schedule=True"
mkdir -p "$OUT/keep"; mv "$OUT/one.jsonl" "$OUT/keep/" 2>/dev/null

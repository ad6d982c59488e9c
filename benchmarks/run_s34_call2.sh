# Session 34, call 2 (~7 minutes): the forward on short rows, one config per process
# (mosaic_one.py, cuDNN's forward on the same inputs). Call 1 found our H = 64 forward at
# 32x512 1.35x (full) / 1.76x (causal) cuDNN's time: there the default is one CTA per
# 128-query tile (4096 CTAs of two 256-key steps); the persistent forms of the 1025-4096-key
# rows are tried there and at 1024 keys, and the H = 128 default at 512 keys is timed.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader
P="persistent=True,named_barriers=False"
C="block_kv=128,persistent=True,dynamic_schedule=True"
one_fwd 32x512x32x64 "" ""
one_fwd 32x512x32x64 "" "$P,q_regs_cols=64"
one_fwd 32x512x32x64 "" "$P"
one_fwd 32x512x32x64 "" "block_kv=128"
one_fwd 32x512x32x64 "" "block_kv=128,persistent=True,q_regs_cols=64"
one_fwd 32x512x32x64 --causal ""
one_fwd 32x512x32x64 --causal "$C,q_regs_cols=64"
one_fwd 32x512x32x64 --causal "$C"
one_fwd 32x512x32x64 --causal "block_kv=128"
one_fwd 16x1024x32x64 "" ""
one_fwd 16x1024x32x64 "" "$P,q_regs_cols=64"
one_fwd 16x1024x32x64 --causal ""
one_fwd 16x1024x32x64 --causal "$C,q_regs_cols=64"
one_fwd 32x512x16x128 "" ""
one_fwd 32x512x16x128 --causal ""
mkdir -p "$OUT/keep"; mv "$OUT/one.jsonl" "$OUT/keep/" 2>/dev/null

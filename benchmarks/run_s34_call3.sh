# Session 34, call 3 (~5 minutes): the H = 64 forward's persistent forms at 256 and 1024 keys
# and the 128-key persistent form with mbarrier turns (mosaic_one.py, cuDNN's forward on the
# same inputs, one config per process). Call 2: 128-key persistent + Q in registers was the
# fastest at 512 keys (0.948x cuDNN against 0.724x for the default grid).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader
P="persistent=True,named_barriers=False"
Q="block_kv=128,persistent=True,q_regs_cols=64"
C="block_kv=128,persistent=True,dynamic_schedule=True,q_regs_cols=64"
one_fwd 16x1024x32x64 "" "$Q"
one_fwd 16x1024x32x64 "" "$Q,named_barriers=False"
one_fwd 32x512x32x64 "" "$Q,named_barriers=False"
one_fwd 64x256x32x64 "" ""
one_fwd 64x256x32x64 "" "$P,q_regs_cols=64"
one_fwd 64x256x32x64 "" "$Q"
one_fwd 64x256x32x64 --causal ""
one_fwd 64x256x32x64 --causal "$C"
one_fwd 8x2048x32x64 "" ""
one_fwd 8x2048x32x64 "" "$Q"
mkdir -p "$OUT/keep"; mv "$OUT/one.jsonl" "$OUT/keep/" 2>/dev/null

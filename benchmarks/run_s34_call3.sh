# Session 34, call 3 (~5 minutes): the H = 64 forward's persistent forms at 256 and 1024 keys
# and the 128-key persistent form with mbarrier turns (mosaic_one.py, cuDNN's forward on the
# same inputs, one config per process). Call 2: 128-key persistent + Q in registers was the
# fastest at 512 keys (0.948x cuDNN against 0.724x for the default grid).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
P="persistent=True,named_barriers=False"
Q="block_kv=128,persistent=True,q_regs_cols=64"
C="block_kv=128,persistent=True,dynamic_schedule=True,q_regs_cols=64"
one() {  # shape, causal flag ("" or --causal), fields
  timeout -k 5 75 python3 benchmarks/mosaic_one.py --shape "$1" $2 --fields "$3" --cudnn \
      --out "$OUT/one.jsonl" 2>&1 | grep "cudnn:\|rror" | cut -c1-160 | sed "s|^|$1 $2 [$3] |"
}
one 16x1024x32x64 "" "$Q"
one 16x1024x32x64 "" "$Q,named_barriers=False"
one 32x512x32x64 "" "$Q,named_barriers=False"
one 64x256x32x64 "" ""
one 64x256x32x64 "" "$P,q_regs_cols=64"
one 64x256x32x64 "" "$Q"
one 64x256x32x64 --causal ""
one 64x256x32x64 --causal "$C"
one 8x2048x32x64 "" ""
one 8x2048x32x64 "" "$Q"
mkdir -p "$OUT/keep"; mv "$OUT/one.jsonl" "$OUT/keep/" 2>/dev/null

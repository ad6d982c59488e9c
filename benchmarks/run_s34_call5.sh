# Session 34, call 5 (~4 minutes): the persistent forward forms on rows longer than 4096 keys,
# where every default is still the grid (mosaic_one.py, one config per process, cuDNN's
# forward on the same inputs). The counter's L2-friendly order (session 7) was never timed there.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
C="block_kv=128,persistent=True,dynamic_schedule=True,q_regs_cols=64"
one() {  # shape, causal flag ("" or --causal), fields
  timeout -k 5 60 python3 benchmarks/mosaic_one.py --shape "$1" $2 --fields "$3" --cudnn \
      --out "$OUT/one.jsonl" 2>&1 | grep "cudnn:\|rror" | cut -c1-160 | sed "s|^|$1 $2 [$3] |"
}
one 1x16384x32x64 --causal ""
one 1x16384x32x64 --causal "$C"
one 1x16384x32x64 "" ""
one 1x16384x32x64 "" "persistent=True,named_barriers=False,q_regs_cols=64"
one 1x16384x16x128 --causal ""
one 1x16384x16x128 --causal "persistent=True,dynamic_schedule=True"
one 2x8192x16x128 --causal ""
one 2x8192x16x128 --causal "persistent=True,dynamic_schedule=True"
mkdir -p "$OUT/keep"; mv "$OUT/one.jsonl" "$OUT/keep/" 2>/dev/null

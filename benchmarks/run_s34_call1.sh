# Session 34, call 1 (~7 minutes). On an H200: the issue table's H = 128 fwd+bwd rows
# (run_s32_call1.sh a; the README's H200 table is session 30's). On an H100: the H = 64
# backward's 128-wide pair where the default still takes 64-wide steps (rows under 1024 keys
# and windowed calls), both timing orders, cuDNN in the same process.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$gpu"
if [[ "$gpu" == *H200* ]]; then
  bash benchmarks/run_s32_call1.sh a
  cp "$OUT/fwdbwd_a/attention.json" "$OUT/keep/fwdbwd_a_h200.json" 2>/dev/null
  rm -rf "${OUT:?}/fwdbwd_a"
  exit 0
fi
W="bwd_dkdv_block_q=128,bwd_dq_block_kv=128,bwd_early_stats="
for order in first last; do
  extra=(); [ "$order" = last ] && extra=(--ours-last)
  breakdown "f512_$order" 100 --rows 32x512x32x64 --causal 0 "${extra[@]}" \
      --variant "w:$W,bwd_registers=240" --variant "wg:$W,bwd_registers=240,bwd_persistent=False"
  breakdown "c512_$order" 100 --rows 32x512x32x64 --causal 1 "${extra[@]}" \
      --variant "cw240:$W,bwd_registers=240" --variant "c240:bwd_registers=240"
done
breakdown win_first 110 --rows 4x4096x32x64 --causal 1 --window 512 \
    --variant "r240:bwd_registers=240" --variant "win240:$W,bwd_registers=240"

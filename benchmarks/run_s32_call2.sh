# Next session, call 2 (written in session 31; ~7 minutes): H = 64 backward step sizes.
# `bwd_dkdv_block_q=128` (the dK/dV kernel's 64-query steps are four 64x64x64 wgmmas a consumer;
# it runs at ~560 TFLOP/s there against ~740 at H = 128, H100 session 31) and
# `bwd_dq_block_kv=128` (the dQ kernel's 64-key steps likewise; -1.5..-2.6% at H = 128 in
# session 5, never timed at H = 64). ptxas offline (1x4096x2x64), spill stores: dK/dV q128 0 B
# without early stats, 16 B with "lse" at 240 registers, causal 350-480 B (unmasked rows only);
# dQ 128-key steps 0 B unmasked, causal 76 B at 232 and 0 B at 240. Plus, at H = 128, the
# self-fed dK/dV kernel with "lse" early (`sfl`; 236 registers, 0 B: session 31 timed self-fed
# alone and with "lse+delta", not this), and the non-deterministic fused dQ (`bwd_dq_lag`, the
# fastest backward of session 15 on this row, not timed since the defaults moved; ptxas: 124 B
# spilled, 140 with "lse"), and D read before dV's wgmma is issued (`de`: "lse+delta_early";
# with "lse+delta" ptxas put D's loads between dV's register-operand wgmmas). Both timing orders, cuDNN in the same process. (The new field's
# compiled tests run in call 3, the whole mosaic suite.)
#   part b (~5 minutes): "lse+delta_early" on the masked H = 128 rows too (their grid dK/dV
#   kernel at 240 registers reads D early with "lse+delta", the default there, and measured
#   only -1% against the late reads at 4x4096 causal), both orders.
part=${1:-a}
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
bd() { timeout -k 5 "$1" python3 benchmarks/bwd_breakdown.py --peers cudnn \
         --budget-s "$(( $1 - 15 ))" "${@:2}" 2>&1 | grep -i " ms\|rror" | cut -c1-110; }
if [ "$part" = b ]; then
  for order in first last; do
    extra=(); [ "$order" = last ] && extra=(--ours-last)
    bd 250 --out "$OUT/h128causal_$order" --rows 4x4096x16x128,1x16384x16x128 --causal 1 \
        "${extra[@]}" --variant "de:bwd_early_stats=lse+delta_early" | sed "s/^/$order /"
  done
  exit 0
fi
for order in first last; do
  extra=(); [ "$order" = last ] && extra=(--ours-last)
  bd 120 --out "$OUT/h64full_$order" --rows 4x4096x32x64 --causal 0 "${extra[@]}" \
      --variant "q128:bwd_dkdv_block_q=128,bwd_early_stats=" \
      --variant "q128l:bwd_dkdv_block_q=128,bwd_early_stats=lse,bwd_registers=240" \
      --variant "dq128:bwd_dq_block_kv=128" \
      --variant "both:bwd_dkdv_block_q=128,bwd_early_stats=lse,bwd_registers=240,bwd_dq_block_kv=128" \
      --variant "de:bwd_early_stats=lse+delta_early"
  bd 70 --out "$OUT/h64causal_$order" --rows 4x4096x32x64 --causal 1 "${extra[@]}" \
      --variant "dq128r:bwd_dq_block_kv=128,bwd_registers=240" --variant "r240:bwd_registers=240"
  bd 90 --out "$OUT/h128_$order" --rows 4x4096x16x128 --causal 0 "${extra[@]}" \
      --variant "sfl:bwd_self_fed=True" \
      --variant "lag:bwd_dq_lag=True,named_free=True,bwd_registers=240" \
      --variant "de:bwd_early_stats=lse+delta_early"
done

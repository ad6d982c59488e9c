# Session 33, call 4 (~3 minutes): H = 64 rows of 1024 keys, where the backward keeps 64-wide
# steps (the persistent dK/dV kernel unmasked); fwd+bwd 0.93x cuDNN full and causal (call 3).
# The 128-wide pair there: unmasked at 240 registers (0 B spilled offline; 48 B at 232), in the
# persistent dK/dV kernel ("w") and the grid ("wg"); causal as the 4096-key default ("cw": dQ
# at 240) and with both kernels at 240 ("cw240"). Both timing orders.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
W="bwd_dkdv_block_q=128,bwd_dq_block_kv=128,bwd_early_stats="
for order in first last; do
  extra=(); [ "$order" = last ] && extra=(--ours-last)
  timeout -k 5 110 python3 benchmarks/bwd_breakdown.py --peers cudnn --budget-s 100 \
      --out "$OUT/full_$order" --rows 16x1024x32x64 --causal 0 "${extra[@]}" \
      --variant "w:$W,bwd_registers=240" --variant "wg:$W,bwd_registers=240,bwd_persistent=False" \
      2>&1 | grep -i " ms\|rror" | cut -c1-400 | sed "s/^/$order /"
  timeout -k 5 110 python3 benchmarks/bwd_breakdown.py --peers cudnn --budget-s 100 \
      --out "$OUT/causal_$order" --rows 16x1024x32x64 --causal 1 "${extra[@]}" \
      --variant "cw:$W,bwd_dq_registers=240" --variant "cw240:$W,bwd_registers=240" \
      2>&1 | grep -i " ms\|rror" | cut -c1-400 | sed "s/^/$order /"
done
mkdir -p "$OUT/keep"
for d in full_first full_last causal_first causal_last; do
  cp "$OUT/$d/bwd_breakdown.json" "$OUT/keep/$d.json" 2>/dev/null; rm -rf "${OUT:?}/$d"
done

# Next session, call 1 (written in session 32; ~4 minutes): H = 64 unmasked calls with key
# lengths (kv_lengths; cuDNN with key_value_seq_lengths in the same process), where session
# 32's 128-wide backward steps are not the default because ptxas spills ~100 B at 232
# registers. At 240 registers ptxas spills 0 B (offline); on the plain row 240 cost the pair
# 5% of its dK/dV gain (1.756 -> 1.847 ms against the old 1.975). Prediction: q128r dK/dV
# -5..-8% and dQ -5% against the key-masked default; fwd+bwd -3..-5%. Both timing orders.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
# First the causal H = 64 default's own compiled test (its 128-query dK/dV steps came after
# session 32's last compiled run).
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 70 python3 -m pytest -q -m gpu -n 4 \
    -p no:cacheprovider -rfE tests/pallas_attn/test_mosaic_dq_registers.py 2>&1 | tail -2
for order in first last; do
  extra=(); [ "$order" = last ] && extra=(--ours-last)
  timeout -k 5 110 python3 benchmarks/bwd_breakdown.py --peers cudnn --budget-s 100 \
      --out "$OUT/h64len_$order" --rows 4x4096x32x64 --causal 0 --kv-len 0.75 "${extra[@]}" \
      --variant "q128r:bwd_dkdv_block_q=128,bwd_early_stats=,bwd_dq_block_kv=128,bwd_registers=240" \
      --variant "dq128:bwd_dq_block_kv=128,bwd_registers=240" 2>&1 | grep -i " ms\|rror" \
      | cut -c1-230 | sed "s/^/$order /"
  rm -f "$OUT/h64len_$order"/*.png
done

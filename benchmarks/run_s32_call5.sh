# Session 32, call 5 (last of the session's device time): the causal H = 64 dQ default
# (128-key steps at 240 registers, `bwd_dq_registers`; default_config) compiled against the
# reference, then timed against the old default (64-key steps, 232) in both orders.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 70 python3 -m pytest -q -m gpu -n 4 \
    -p no:cacheprovider -rfE tests/pallas_attn/test_mosaic_dq_registers.py > "$OUT/tests.log" 2>&1
echo "tests rc=$? $(( $(date +%s) - start )) s: $(tail -1 "$OUT/tests.log")"
for order in first last; do
  extra=(); [ "$order" = last ] && extra=(--ours-last)
  timeout -k 5 45 python3 benchmarks/bwd_breakdown.py --peers cudnn --budget-s 38 \
      --out "$OUT/h64causal_$order" --rows 4x4096x32x64 --causal 1 "${extra[@]}" \
      --variant "old:bwd_dq_block_kv=64,bwd_dq_registers=0" 2>&1 | grep -i " ms\|rror" \
      | cut -c1-215 | sed "s/^/$order /"
  rm -f "$OUT/h64causal_$order"/*.png
done

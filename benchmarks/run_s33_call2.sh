# Session 33, call 2 (~5 minutes): the compiled tests of this session's changes, then
#  a) 4x4000x32x64 full (keys end inside a 256-key block): the unmasked H = 64 forward with its
#     ranges read from the metadata (new default) against computed in the kernel ("cr": 516 B
#     spilled and C7512 offline), and the 128-wide backward pair at 240 registers (new
#     default for padded keys) against the old pair ("old": both old fields); both orders.
#  b) 4x4096x32x64 with kv_lengths (odd rows 75%), full: the select over dK / dV after the
#     backward is gone (kernel list), causal: the 128-wide pair ("cq", dQ at 240; "cqr" both at
#     240) against the causal key-masked default (64-wide); both orders.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -n 6 \
    -p no:cacheprovider -rfE tests/pallas_attn/test_mosaic_kv_padding.py \
    tests/pallas_attn/test_mosaic_dkdv_block_q.py -k "kv_padding or key_masked or h64_default" \
    2>&1 | tail -2
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 120 python3 -m pytest -q -n 4 \
    -p no:cacheprovider -rfE tests/pallas_attn/test_attention.py -k "nan_padding" 2>&1 | tail -2
OLD="bwd_dkdv_block_q=0,bwd_dq_block_kv=64,bwd_early_stats=lse+delta,bwd_registers=232"
CQ="bwd_dkdv_block_q=128,bwd_dq_block_kv=128,bwd_early_stats=,bwd_dq_registers=240"
for order in first last; do
  extra=(); [ "$order" = last ] && extra=(--ours-last)
  timeout -k 5 150 python3 benchmarks/bwd_breakdown.py --peers cudnn --budget-s 140 \
      --out "$OUT/pad_$order" --rows 4x4000x32x64 --causal 0 "${extra[@]}" \
      --variant "cr:computed_ranges=True" --variant "old:$OLD" 2>&1 | grep -i " ms\|rror" \
      | cut -c1-330 | sed "s/^/$order /"
  timeout -k 5 150 python3 benchmarks/bwd_breakdown.py --peers cudnn --budget-s 140 \
      --out "$OUT/len_$order" --rows 4x4096x32x64 --causal 1 --kv-len 0.75 "${extra[@]}" \
      --variant "cq:$CQ" --variant "cqr:$CQ,bwd_registers=240" 2>&1 | grep -i " ms\|rror" \
      | cut -c1-330 | sed "s/^/$order /"
done
timeout -k 5 100 python3 benchmarks/bwd_breakdown.py --peers cudnn --budget-s 90 \
    --out "$OUT/lenfull" --rows 4x4096x32x64 --causal 0 --kv-len 0.75 2>&1 \
    | grep -i " ms\|rror" | cut -c1-600
mkdir -p "$OUT/keep"
for d in pad_first pad_last len_first len_last lenfull; do
  cp "$OUT/$d/bwd_breakdown.json" "$OUT/keep/$d.json" 2>/dev/null; rm -rf "${OUT:?}/$d"
done

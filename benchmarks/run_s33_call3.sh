# Session 33, call 3 (~6 minutes): sequences that end inside a tile without padded copies
# (ops.tma_tails). First every compiled case with T, S >= 256, multiples of 8 and off the
# tiles (16 cases in 5 files), then fwd+bwd per kernel at 4x4000 (H = 64 and 128) against
# cuDNN. Prediction: the five ~0.047 ms pads and two ~0.044 ms slices of call 4's kernel list
# gone; 4x4000x32x64 full 4.72 -> ~4.40 ms (0.96 -> ~1.03x cuDNN); H = 128 rows ~-7%.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 300 python3 -m pytest -q -m gpu -n 8 \
    -p no:cacheprovider -rfE -k "T1000 or T600 or T776 or T1496" \
    tests/pallas_attn/test_mosaic_tails.py tests/pallas_attn/test_mosaic_consumers.py \
    tests/pallas_attn/test_mosaic_dkdv_block_q.py tests/pallas_attn/test_mosaic_dq_registers.py \
    tests/pallas_attn/test_mosaic_q_regs.py 2>&1 | tail -4
timeout -k 5 200 python3 benchmarks/bwd_breakdown.py --peers cudnn --budget-s 190 \
    --out "$OUT/tails" --rows 4x4000x32x64,4x4000x16x128 --causal 0,1 2>&1 \
    | grep -i " ms\|rror" | cut -c1-700
mkdir -p "$OUT/keep"; cp "$OUT/tails/bwd_breakdown.json" "$OUT/keep/tails.json"; rm -rf "$OUT/tails"

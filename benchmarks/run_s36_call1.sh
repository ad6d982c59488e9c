# Next session, call 1 (written in session 35; ~6 minutes): session 35's H = 64 defaults through
# the compiled reference tests (causal from 512 keys and windowed calls with masked halves; the
# windowed form with 64-key dQ steps), then the rows it left untimed: 8x2048 causal against the
# old default, and 4x4096 window (512, 0) with 64-key against 128-key dQ steps, both orders.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader
gpu_tests 240 tests/pallas_attn/test_mosaic_masked_halves.py \
    tests/pallas_attn/test_mosaic_dq_registers.py \
    tests/pallas_attn/test_mosaic_dkdv_block_q.py
OLD_CAUSAL="bwd_masked_halves=False,bwd_registers=232,bwd_dq_registers=240"
breakdown c2048 80 --rows 8x2048x32x64 --causal 1 --variant "old:$OLD_CAUSAL"
for order in first last; do
  extra=(); [ "$order" = last ] && extra=(--ours-last)
  breakdown "win_$order" 80 --rows 4x4096x32x64 --causal 1 --window 512 "${extra[@]}" \
      --variant "dq128:bwd_dq_block_kv=128"
done
# The windowed H = 64 forward over 4096 keys runs the grid with 256-key blocks (0.87x cuDNN at
# 1x16384x32x64 window (1024, 0), session 35), where at 4096 keys the causal form (128-key
# blocks, persistent with the tile counter, Q in registers) ran 1.12x: that form over 4096 keys
# ("c128"), and with a static deal ("p128"; windowed tiles are of near-equal length).
F128="block_kv=128,persistent=True,q_regs_cols=64"
breakdown wfwd 90 --rows 1x16384x32x64 --causal 1 --window 1024 \
    --variant "c128:$F128,dynamic_schedule=True" --variant "p128:$F128,dynamic_schedule=False"

# Next session, call 1 (written in session 34; ~8 minutes): `Config.bwd_masked_halves` compiled
# (its GPU tests), then timed against the default, fwd+bwd per kernel, both orders, cuDNN in
# the same process. Predictions in benchmarks/NOTES.md (session 34, masked halves).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 150 python3 -m pytest -q -m gpu -n 5 \
    -p no:cacheprovider -rfE tests/pallas_attn/test_mosaic_masked_halves.py 2>&1 | tail -3
W="bwd_dkdv_block_q=128,bwd_dq_block_kv=128,bwd_early_stats="
for order in first last; do
  extra=(); [ "$order" = last ] && extra=(--ours-last)
  breakdown "c4096_$order" 100 --rows 4x4096x32x64 --causal 1 "${extra[@]}" \
      --variant "h240:bwd_masked_halves=True,bwd_registers=240" \
      --variant "h232:bwd_masked_halves=True"
  breakdown "c16k_$order" 100 --rows 1x16384x32x64 --causal 1 "${extra[@]}" \
      --variant "h240:bwd_masked_halves=True,bwd_registers=240"
done
breakdown c1024 80 --rows 16x1024x32x64 --causal 1 --variant "h:bwd_masked_halves=True"
breakdown win 100 --rows 4x4096x32x64 --causal 1 --window 512 \
    --variant "wh:$W,bwd_registers=240,bwd_masked_halves=True"

# Session 44, call 1 (~9 minutes), picked by the card.
# H200 (the card, none lent in sessions 39-43): the paired H = 128 table against cuDNN
#   with the lse_pre default (run_s41.sh's H200 branch: fwd+bwd, then forward), then
#   "lse_pre+delta_acc" against the default at 4x4096 (causal and full).
# H100 (run_s44.sh ran as call 1): the compiled backward test files not re-run since lse_pre
#   became the H = 128 default, then bwd_dq_delta_acc against the default at 4x4096 causal.
# Predictions in benchmarks/NOTES.md (session 44).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$card"
source benchmarks/device_helpers.sh
if [[ "$card" == *H200* ]]; then
  H128=16x1024x16x128,4x4096x16x128,1x16384x16x128,8x2048x16x128,2x8192x16x128
  paired 260 --out "$OUT/fwdbwd" --budget-s 230 --rows "$H128" --causal 0,1
  paired 110 --out "$OUT/fwd" --budget-s 80 --mode fwd --rows "$H128" --causal 0,1
  paired 110 --out "$OUT/acc" --budget-s 90 --against acc:bwd_early_stats=lse_pre+delta_acc \
      --rows 4x4096x16x128 --causal 0,1
else
  files=$(ls tests/pallas_attn/test_mosaic_{bwd_persistent,dkdv_block_q,dq_registers,free_first,\
masked_halves,tails,delta_in_dq,self_fed,consumers,grid_order}.py)
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 380 python3 -m pytest -q -m gpu -n 8 \
      -p no:cacheprovider $files 2>&1 | grep -v "^WARNING" | tail -6
  paired 100 --out "$OUT/dqacc" --budget-s 80 --against dqacc:bwd_dq_delta_acc=True \
      --rows 4x4096x16x128 --causal 1
fi

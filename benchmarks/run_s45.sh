# Next session, call 1 (written in session 44; ~9 minutes, any card): the paired fwd+bwd table
# against cuDNN (paired.py, 2 s pre-heat, both orders) with session 44's default
# (bwd_dq_delta_acc at H = 64 and 128), the H = 128 rows and 4x4096x32x64; on an H200 (the
# issue's card, none lent in sessions 39-44) the forward H = 128 rows as well.
# Prediction in benchmarks/NOTES.md (session 44, "Left for the next device session").
source benchmarks/setup_gpu.sh >/dev/null 2>&1
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$card"
source benchmarks/device_helpers.sh
H128=4x4096x16x128,2x8192x16x128,1x16384x16x128,16x1024x16x128,8x2048x16x128
paired 300 --out "$OUT/fwdbwd" --budget-s 270 --rows "$H128" --causal 0,1
paired 90 --out "$OUT/fwdbwd_h64" --budget-s 70 --rows 4x4096x32x64 --causal 0,1
if [[ "$card" == *H200* ]]; then
  paired 110 --out "$OUT/fwd" --budget-s 80 --mode fwd --rows "$H128" --causal 0,1
fi

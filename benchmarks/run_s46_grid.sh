# Session 46 (~7 minutes, any card; meant for an H200, the card): the whole
# forward grid (H = 64 / 128 / 256 rows, full and causal) and the H = 128 fwd+bwd rows of the
# bar, each against cuDNN with paired.py (2 s pre-heat, both timing orders in one process).
# Prediction in benchmarks/NOTES.md (session 46, "Call 2").
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
FWD=16x1024x16x128,4x4096x16x128,1x16384x16x128,4x4096x32x64,4x4096x8x256
paired 200 --out "$OUT/fwd" --budget-s 170 --mode fwd --rows "$FWD" --causal 0,1
paired 260 --out "$OUT/fwdbwd" --budget-s 230 \
    --rows 4x4096x16x128,1x16384x16x128,16x1024x16x128 --causal 0,1

# Session 48, call 1 (~8 minutes, any card): session 47's items 1 and 2 in one call.
# 1. The fixed `bwd_joint` (semaphores shared by all CTAs): a probe under a timeout (does it
#    finish, bitwise?), then its compiled tests and paired fwd+bwd against the default.
# 2. The default `bwd_turns` (session 46's placement) against the same config without it,
#    paired fwd+bwd. Predictions in benchmarks/NOTES.md (sessions 46 and 47).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/device_helpers.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
if timeout -k 5 60 python3 benchmarks/joint_probe.py 2 2048 4 128 2>&1 | grep -v "^WARNING" \
    | tee /dev/stderr | grep -q "bitwise True"; then
  gpu_tests 100 tests/pallas_attn/test_mosaic_joint.py
  paired 150 --out "$OUT/joint" --budget-s 130 --against joint:bwd_joint=True \
      --rows 4x4096x16x128,2x8192x16x128,1x16384x16x128 --causal 0
else
  echo "joint probe: no bitwise pass within 60 s"
fi
paired 150 --out "$OUT/noturns" --budget-s 130 --against noturns:bwd_turns=False \
    --rows 4x4096x16x128,2x8192x16x128,8x2048x16x128 --causal 0

# Session 39, call 5: SM clock and power under sustained load (power_probe.py), ours against
# cuDNN: fwd+bwd and fwd at 4x4096x16x128 full, fwd+bwd at 1x16384x16x128 causal.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,power.limit,power.max_limit,clocks.max.sm,clocks.applications.graphics --format=csv
python3 -c "import pynvml" 2>&1 | tail -1
for args in "--rows 4x4096x16x128 --causal 0 --mode fwdbwd" \
            "--rows 1x16384x16x128 --causal 1 --mode fwdbwd"; do
  mode=$(echo $args | tr ' ' '_' | tr -d '-')
  timeout -k 5 150 python3 benchmarks/power_probe.py --out "$OUT/$mode" $args --seconds 4 2>&1 \
      | grep -v "^WARNING" | cut -c1-400
done
# Waves against work: 32 x 4 heads x 32 tiles = 4096 CTAs a backward kernel (31 waves + 4 CTAs on
# 132 SMs), 33 -> 4224 (exactly 32 waves). Wave model: equal times; energy model: 33/32 = 1.031.
source benchmarks/device_helpers.sh; mkdir -p "$OUT/keep"
breakdown waves 150 --rows 32x4096x4x128,33x4096x4x128,34x4096x4x128 --causal 0
# The fused-dQ forms again (last timed in session 15, before the dK/dV kernel's later gains).
breakdown lag 150 --rows 4x4096x16x128,2x8192x16x128 --causal 0 \
    --variant "lag:bwd_dq_lag=True,named_free=True,bwd_registers=240" \
    --variant "fused:bwd_fused_dq=True,named_free=True,bwd_registers=240"

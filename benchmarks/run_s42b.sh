# Session 42, call 5 (~3 minutes, any card): why bwd_registers=232 makes the unmasked dK/dV
# kernel 8% faster at 1x16384x16x128 but 10-14% slower at 2048-8192 keys (paired, H100,
# results/attention/s42/r232*). Nsight Compute without clock control (one kernel, no power
# cap) on the 232 form at 1x16384 and 4x4096 (the 240 forms: s42/ncu and s30/ncu), then the
# paired --against at 1x32768x8x128 (same work as 1x16384x16, twice the steps per tile).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
OUT="$OUT/ncu" bash benchmarks/run_ncu.sh attn_dkdv_16k_232 attn_dkdv_232 attn_dkdv 2>&1 \
    | grep -E "rc=|Duration|SM Frequency|Issue Slots|Local Memory"
timeout -k 5 120 python3 benchmarks/paired.py --preheat 2 --out "$OUT/r232c" --budget-s 90 \
    --against r232:bwd_registers=232 --rows 1x32768x8x128 --causal 0 2>&1 \
    | grep -v "^WARNING" | cut -c1-400

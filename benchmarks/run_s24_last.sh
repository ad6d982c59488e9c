# Session 24, the budget's last ~2 minutes: the FP8 forward's compiled tests for P in registers
# and the overlapped loop (with the row scales folded into the softmax), then one row timed.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 75 python3 -m pytest -q -m gpu -p no:cacheprovider \
    -rfE tests/pallas_attn/test_fp8.py -k "compiled and (overlap or p_registers) and not h256" \
    2>&1 | tail -4
mkdir -p "$OUT/ov"
K=fp8-kernel; P="+fp8_p_registers=True"
timeout -k 5 45 python3 benchmarks/attention_fp8.py --out "$OUT/ov" --budget-s 30 \
    --rows 4x4096x16x128 --causal 0 --impls "bf16,$K-preg,$K$P+overlap=True" 2>&1 \
    | grep "ms\|rror" | tail -6

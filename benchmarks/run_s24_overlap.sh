# Session 24, last call (~4 minutes): the FP8 forward with FA3's intra-warpgroup overlap
# (Config.overlap with fp8_p_registers): its compiled tests, then times beside P in registers
# without it and our bf16 forward, in one process.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 90 python3 -m pytest -q -m gpu -p no:cacheprovider \
    -rfE tests/pallas_attn/test_fp8.py -k "compiled and overlap" 2>&1 | tail -4
mkdir -p "$OUT/ov"
K=fp8-kernel; P="+fp8_p_registers=True"
timeout -k 5 80 python3 benchmarks/attention_fp8.py --out "$OUT/ov" --budget-s 60 \
    --rows 4x4096x16x128,4x4096x8x256 --causal 0,1 \
    --impls "bf16,$K-preg,$K$P+overlap=True,$K$P+overlap=True+exp2_poly_cols=32" 2>&1 \
    | grep "ms\|rror" | tail -32

# Session 25, call 1 (~9 minutes): session 24's untested defaults. (1) The compiled FP8 tests of
# P in registers (the default FP8 path, now with the row scales folded into the softmax) and of
# the overlapped loop, then the overlap row timed. (2) W4A16 at 128 / 256 rows on the three
# issue shapes through the one-call default (timed on one shape only so far), XLA bf16 / int4 in
# the same process. (3) The FP8 forward grid for the README (Hadamard in bf16, rotation cast
# back to 16 bits before quantisation). Also one key scale per 256 keys (k_scale_block).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 120 python3 -m pytest -q -m gpu -p no:cacheprovider \
    -rfE tests/pallas_attn/test_fp8.py \
    -k "(compiled and (overlap or p_registers) and not h256) or key_block_compiled" 2>&1 | tail -5
mkdir -p "$OUT/ov" "$OUT/w4" "$OUT/fp8"
K=fp8-kernel; P="+fp8_p_registers=True"
timeout -k 5 75 python3 benchmarks/attention_fp8.py --out "$OUT/ov" --budget-s 50 \
    --rows 4x4096x16x128 --causal 0 --impls "bf16,$K-preg,$K$P+overlap=True,\
$K$P+k_scale_block=256,$K$P+overlap=True+k_scale_block=256,$K-preg" 2>&1 | grep "ms\|rror" | tail -8
timeout -k 5 185 python3 benchmarks/w4a16.py --out "$OUT/w4" --ms 128,256 --impls mosaic \
    --budget-s 150 2>&1 | grep -v "^W0\|^I0" | tail -14
timeout -k 5 175 python3 benchmarks/attention_fp8.py --out "$OUT/fp8" --budget-s 145 2>&1 | tail -24

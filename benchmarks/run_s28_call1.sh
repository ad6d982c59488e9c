# Next session, call 1 (~6 minutes; written in session 27): (1) the FP8 compiled tests, now
# with V kept in the kernel's layout by a QuantizedKV (never compiled: session 27's device
# time was spent) and the three-consumer bf16 default's compiled cases; (2) fp8-kv with V in
# the kernel's layout against V as [B, S, K, H] (transposed per call), one process, per kernel.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -m gpu -n 4 \
    -p no:cacheprovider -rfE tests/pallas_attn/test_fp8.py tests/pallas_attn/test_mosaic_consumers.py \
    > "$OUT/tests.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/tests.log"
mkdir -p "$OUT/kv"
timeout -k 5 200 python3 benchmarks/attention_fp8.py --out "$OUT/kv" --budget-s 180 --breakdown \
    --rows 16x1024x16x128,4x4096x16x128,1x16384x16x128 --causal 0 \
    --impls "fp8-kv,fp8-kv-bskd,fp8,bf16,cudnn" 2>&1 | grep "ms\|rror" | cut -c1-160
# (3) XLA's Q quantisation with the scale from the row's norm (fusable into the rotation's dot)
# against today's amax path and the fused Pallas pass, each kernel timed.
timeout -k 5 90 python3 benchmarks/fp8_quant_probe.py --out "$OUT/quant" 2>&1 | cut -c1-160

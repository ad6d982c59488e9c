# Session 27, call 3 (~5 minutes): (1) where fp8-kv's time goes besides the kernel (each
# kernel's CUPTI median: Q's pass, V's transpose to the kernel's key order, the attention);
# (2) exponentials on the FMA pipe for part of the keys in the FP8 kernel now that three
# consumers are its default on long rows (session 24 measured it with two only).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p "$OUT/kv" "$OUT/poly"
timeout -k 5 120 python3 benchmarks/attention_fp8.py --out "$OUT/kv" --budget-s 100 --breakdown \
    --rows 16x1024x16x128,4x4096x16x128 --causal 0 --impls "fp8-kv,fp8-kv-fused" 2>&1 \
    | grep "ms\|rror" | cut -c1-160
timeout -k 5 300 python3 benchmarks/attention_fp8.py --out "$OUT/poly" --budget-s 260 \
    --rows 1x16384x16x128,4x4096x16x128 --causal 0 --impls \
"fp8-kernel,fp8-kernel+exp2_poly_cols=16,fp8-kernel+exp2_poly_cols=32,fp8-kernel+consumers=3,\
fp8-kernel+consumers=3+exp2_poly_cols=16,fp8-kernel+consumers=3+exp2_poly_cols=32,bf16" 2>&1 \
    | grep "ms\|rror" | cut -c1-160

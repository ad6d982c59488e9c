# Session 34, call 4 (~8 minutes): the new H = 64 short-row defaults (persistent forward from
# 129 keys, the 128-wide backward pair at 512-1023 unmasked keys) end to end, fwd+bwd per
# kernel against cuDNN; then the whole compiled mosaic suite (its H = 64 cases of <= 1024 keys
# now run the persistent forward).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p "$OUT/keep"
timeout -k 5 150 python3 benchmarks/bwd_breakdown.py --peers cudnn --budget-s 140 \
    --out "$OUT/short" --rows 16x1024x32x64,32x512x32x64 --causal 0,1 2>&1 \
    | grep -i " ms\|rror" | cut -c1-500
cp "$OUT/short/bwd_breakdown.json" "$OUT/keep/short.json"; rm -rf "$OUT/short"
start=$(date +%s)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 400 python3 -m pytest -q -m gpu -n 14 \
    -p no:cacheprovider -rfE tests/pallas_attn -k mosaic > "$OUT/keep/suite.log" 2>&1
echo "rc=$? $(( $(date +%s) - start )) s: $(tail -3 "$OUT/keep/suite.log")"

# Session 17, device call 5 (~5 minutes): the compiled grid's masked H = 256 Mosaic cases (28 in
# test_attention.py's full grid: causal, windows, softcap, segments, kv_lengths), now with
# lazy_rescale = 8 by default for masked calls at head dims over 128.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # 14 workers share the GPU
out="${OUT:-/tmp}"
timeout -k 5 500 python3 -m pytest -q -n 14 -m gpu -p no:cacheprovider -rfE \
    tests/pallas_attn/test_attention.py -k "H256 and mosaic and causal" \
    --junitxml="$out/h256_masked_grid.xml" 2>&1 | tail -25 | tee "$out/h256_masked_grid.txt"

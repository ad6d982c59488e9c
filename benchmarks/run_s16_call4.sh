# Session 16, device call 4 (~9 minutes): the compiled grid's H = 256 Mosaic cases (41 in
# test_attention.py's full grid, now through the split backward by default, + the split tests).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # 14 workers share the GPU (first try: all OOM)
out="${OUT:-/tmp}"
timeout -k 5 540 python3 -m pytest -q -n 14 -m gpu -p no:cacheprovider -rfE \
    tests/pallas_attn/test_attention.py tests/pallas_attn/test_mosaic_backward_split.py \
    -k "H256 and mosaic" --junitxml="$out/h256_grid.xml" 2>&1 | tail -25 | tee "$out/h256_grid.txt"

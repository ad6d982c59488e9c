# Next session, call 3 (written in session 31; ~6-8 minutes): the whole compiled mosaic suite
# in one call, now that tests/conftest.py turns XLA's GEMM autotuning off (session 31: the
# mosaic `test_full_grid`, 266 cases, ran in 214 s that way; with autotuning a case took ~90 s).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 560 python3 -m pytest -q -m gpu -n 14 \
    -p no:cacheprovider -rfE --junitxml="$OUT/suite.xml" tests/pallas_attn -k mosaic \
    > "$OUT/suite.log" 2>&1
echo "rc=$? $(( $(date +%s) - start )) s: $(tail -3 "$OUT/suite.log")"

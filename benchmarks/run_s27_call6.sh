# Session 27, call 6: call 5 again, each compiled case in its own process under a timeout
# (call 5's machine stopped answering with no output), output flushed as it goes.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
for id in T1000 T700 T600; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 80 python3 -m pytest -q -m gpu -p no:cacheprovider \
      -rfE tests/pallas_attn/test_mosaic_consumers.py -k "compiled and $id" 2>&1 | tail -2 | tee -a "$OUT/c3_tests.log"
  echo "$id rc ${PIPESTATUS[0]}" | tee -a "$OUT/c3_tests.log"
done
timeout -k 5 100 python3 benchmarks/mosaic_ab.py --rows 2 --causal 0 --cases 1 --mode fwd \
    --variant c2:consumers=2,persistent=True --peers cudnn --out "$OUT/ab_fwd" 2>&1 | tail -2

# Session 27, call 5 (~6 minutes): the bf16 default with three consumers from 16384 unmasked
# keys at H = 128: its compiled tests (forward + backward, GQA, kv_lengths, segments), then
# the 1x16384x16x128 full row, forward and forward + backward, against the two-consumer
# persistent form and cuDNN in one process.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -m gpu -n 3 \
    -p no:cacheprovider -rfE tests/pallas_attn/test_mosaic_consumers.py > "$OUT/c3_tests.log" 2>&1
echo "pytest rc $?"; tail -3 "$OUT/c3_tests.log"
for mode in fwd fwdbwd; do
  timeout -k 5 150 python3 benchmarks/mosaic_ab.py --rows 2 --causal 0 --cases 1 --mode $mode \
      --variant c2:consumers=2,persistent=True --peers cudnn --out "$OUT/ab_$mode" 2>&1 | tail -2
done

# Session 31, call 3 (~9 minutes): the new bwd_early_stats defaults ("lse" on the unmasked
# H = 128 grid dK/dV kernel, "lse+delta" elsewhere) on the issue-table rows not timed in calls
# 1-2 (8x2048, 1x16384), against the late reads ("late") and cuDNN in the same process; then a
# compiled sample of the shared suite's mosaic grid (every 48th case: runs the new defaults),
# with XLA's autotuning on and off (is autotuning the reference why a case takes ~90 s?).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout -k 5 ${ROWS_S:-230} python3 benchmarks/bwd_breakdown.py --out "$OUT/rows" \
    --rows 8x2048x16x128,1x16384x16x128 --causal 0,1 --peers cudnn --budget-s $(( ${ROWS_S:-230} - 20 )) \
    --variant late:bwd_early_stats= 2>&1 | grep -i "ms\|rror" | cut -c1-110
ids=$(python3 -m pytest -q --collect-only -m gpu tests/pallas_attn/test_attention.py \
        -k "mosaic and full_grid" 2>/dev/null | grep "::" | awk 'NR % 48 == 5')
echo "$(echo "$ids" | wc -l) cases"
# After two refused starts only ~10 device-minutes were left: MODES="noautotune" runs one.
for mode in ${MODES:-noautotune default}; do
  flags=""; [ "$mode" = noautotune ] && flags="--xla_gpu_autotune_level=0"
  start=$(date +%s)
  XLA_FLAGS="$flags" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 150 python3 -m pytest \
      -q -m gpu -n 8 -p no:cacheprovider -rfE $ids > "$OUT/$mode.log" 2>&1
  echo "$mode rc=$? $(( $(date +%s) - start )) s: $(tail -1 "$OUT/$mode.log")"
done

# The next chunk of compiled attention grid cases not yet run on the GPU (one id per line in the
# newest results/attention/*_grid_not_run.txt), with per-test durations so that a slow run says
# where its time went. Writes $OUT/grid.log.
#   bash benchmarks/run_grid_chunk.sh [number of cases, default 40] [workers, default 14]
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
count="${1:-40}"
workers="${2:-14}"
out="${OUT:-/tmp}"
list=$(ls benchmarks/results/attention/*_grid_not_run.txt | sort | tail -1)
set -f
ids=$(head -n "$count" "$list")
if [ -z "$ids" ]; then echo "nothing left to run in $list" | tee "$out/grid.log"; exit 0; fi
timeout -k 5 "${GRID_TIMEOUT_S:-560}" python3 -m pytest -v -p no:cacheprovider -n "$workers" -m gpu \
  --durations=0 $ids > "$out/grid.log" 2>&1
echo "rc=$? from $list" | tee -a "$out/grid.log"
echo "passed $(grep -c ' PASSED ' "$out/grid.log"), failed $(grep -c ' FAILED ' "$out/grid.log")"

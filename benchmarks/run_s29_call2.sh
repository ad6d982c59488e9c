# Session 29, call 2a / 2b (`bash benchmarks/run_s29_call2.sh a`, then `b`; ~5 minutes each).
# Session 29's backward defaults (benchmarks/ab/s29_dq_heavy_first_r240.patch): the dQ grid
# kernel takes its heaviest Q tiles first under causal-like masks (as the forward's
# heavy_first), and the H = 128 grid kernels run at 240 registers. Against session 28's tree
# (this one with the patch undone), per-kernel CUPTI times, cuDNN in each process; `r232`
# (this tree at 232 registers) separates the two changes; `nodind` (D in a pre-pass again)
# checks session 28's bwd_delta_in_dq default on the long rows, where it was never A/B-ed
# in both orders.
# c (run in session 29 instead of a and b: device time was short): 4x4096 and 1x16384 only,
#    new, old, old, new in one call, then the grid-order and causal feature tests.
# a: the compiled masked mosaic cases of the shared suite and the grid-order tests, then new
#    tree first; b: old tree first (the first-timed bias check).
part=${1:-a}
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf /tmp/old && mkdir /tmp/old && cp -r . /tmp/old/ 2>/dev/null
(cd /tmp/old && patch -s -p1 -R < benchmarks/ab/s29_dq_heavy_first_r240.patch) || exit 1
breakdown() {  # tree-dir tag extra-args...
  local dir=$1 tag=$2; shift 2
  (cd "$dir" && timeout -k 5 200 python3 benchmarks/bwd_breakdown.py --out "$OUT/$tag" \
      --rows 4x4096x16x128,1x16384x16x128,16x1024x16x128 --causal 1,0 --peers cudnn \
      --budget-s 150 "$@" 2>&1 | grep -i "ms\|rror" | sed "s/^/$tag /" | cut -c1-150)
}
if [ "$part" = c ]; then   # both orders in one call (device time was short), tests last
  rows="--rows 4x4096x16x128,1x16384x16x128"
  breakdown . new_c1 $rows --variant r232:bwd_registers=232 --variant nodind:bwd_delta_in_dq=False
  breakdown /tmp/old old_c1 $rows
  breakdown /tmp/old old_c2 $rows
  breakdown . new_c2 $rows --variant r232:bwd_registers=232 --variant nodind:bwd_delta_in_dq=False
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 100 python3 -m pytest -q -m gpu -n 8 \
      -p no:cacheprovider -rfE tests/pallas_attn/test_mosaic_grid_order.py \
      tests/pallas_attn/test_attention.py -k "seq_major or mosaic and causal and features" \
      > "$OUT/tests.log" 2>&1
  echo "pytest rc $?"; tail -2 "$OUT/tests.log"
elif [ "$part" = a ]; then
  cases="(causal or window) and (features or off_by_one)"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 130 python3 -m pytest -q -m gpu -n 8 \
      -p no:cacheprovider -rfE tests/pallas_attn/test_attention.py \
      tests/pallas_attn/test_mosaic_grid_order.py -k "seq_major or mosaic and $cases" \
      > "$OUT/tests.log" 2>&1
  echo "pytest rc $?"; tail -2 "$OUT/tests.log"
  breakdown . new_a --variant r232:bwd_registers=232 --variant nodind:bwd_delta_in_dq=False
  breakdown /tmp/old old_a
else
  breakdown /tmp/old old_b
  breakdown . new_b --variant r232:bwd_registers=232 --variant nodind:bwd_delta_in_dq=False
fi

# Next session, calls 0a / 0b (`bash benchmarks/run_s29_call0.sh a`, then `b`; ~6 minutes each;
# written in session 28, no device that session): the dK/dV
# kernel with D read late and no second mask on dS^T (commit c25f9b9; ptxas offline at
# 1x1024x2x128: spills full 52 -> 16 B, causal 456 -> 164 B) against the kernel before it.
# (1) compiled mosaic cases of the shared suite (gradients included); (2) per-kernel times of
# the old and new backward, alternating processes A B A B (first-timed bias, session 27), cuDNN
# in each process. The old tree is this one with benchmarks/ab/s28_dkdv_late_delta.patch undone.
# Part b also times the lag form of the fused dQ on the new kernel (its spills 192 -> 116 B).
part=${1:-a}
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
[ "$part" = a ] && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -m gpu -n 4 \
    -p no:cacheprovider -rfE tests/pallas_attn/test_attention.py \
    -k "mosaic and (features or fully_masked or extreme or nan_padding or off_by_one)" \
    > "$OUT/tests.log" 2>&1
[ "$part" = a ] && { echo "pytest rc $?"; tail -3 "$OUT/tests.log"; }
rm -rf /tmp/old && mkdir /tmp/old && cp -r . /tmp/old/ 2>/dev/null
(cd /tmp/old && patch -s -p1 -R < benchmarks/ab/s28_dkdv_late_delta.patch) || exit 1
order="new old"; extra=""
[ "$part" = b ] && { order="old new"; extra="--variant lag:bwd_dq_lag=True,named_free=True,bwd_registers=240"; }
for tree in $order; do
  dir=$PWD; [ $tree = old ] && dir=/tmp/old
  var=""; [ $tree = new ] && var="$extra"
  (cd $dir && timeout -k 5 130 python3 benchmarks/bwd_breakdown.py --out "$OUT/${tree}_$part" \
      --rows 4x4096x16x128,16x1024x16x128 --causal 0,1 --peers cudnn --budget-s 120 $var 2>&1 \
      | grep -i "ms\|rror" | sed "s/^/$tree$part /" | cut -c1-150)
done

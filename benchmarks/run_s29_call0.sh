# Next session, calls 0a / 0b (`bash benchmarks/run_s29_call0.sh a`, then `... b`; ~6 minutes
# each; written in session 28, which had no device): session 28's dK/dV kernel (D read where
# dS^T needs it, no second mask on dS^T, the softcap's factor folded into P^T at once; ptxas
# offline at 1x1024x2x128: spill stores full 52 -> 16 B, causal 456 -> 164 B, softcap causal
# 844 -> 240 B) against session 27's. Part a: the compiled mosaic cases of the shared suite
# (gradients included), then new and old per-kernel times; part b: old then new (the order
# swapped: session 27 saw a first-timed bias), with two variants of the new kernel: the lag
# form of the fused dQ (its spills 192 -> 116 B) and 240 registers (causal 164 -> 72 B); part a
# also times `bwd_delta_in_dq` (D in the dQ kernel, no pre-pass) on the new kernel.
# cuDNN in each process. The old tree is this one with benchmarks/ab/s28_dkdv_registers.patch
# undone.
part=${1:-a}
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$part" = a ]; then
  cases="features or fully_masked or extreme or nan_padding or off_by_one"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 180 python3 -m pytest -q -m gpu -n 4 \
      -p no:cacheprovider -rfE tests/pallas_attn/test_attention.py \
      tests/pallas_attn/test_mosaic_delta_in_dq.py \
      -k "delta_in_dq or mosaic and ($cases)" \
      > "$OUT/tests.log" 2>&1
  echo "pytest rc $?"; tail -3 "$OUT/tests.log"
fi
rm -rf /tmp/old && mkdir /tmp/old && cp -r . /tmp/old/ 2>/dev/null
(cd /tmp/old && patch -s -p1 -R < benchmarks/ab/s28_dkdv_registers.patch) || exit 1
order="new old"; extra="--variant dind:bwd_delta_in_dq=True"
if [ "$part" = b ]; then
  order="old new"
  extra="--variant lag:bwd_dq_lag=True,named_free=True,bwd_registers=240"
  extra="$extra --variant r240:bwd_registers=240"
fi
for tree in $order; do
  dir=$PWD; [ $tree = old ] && dir=/tmp/old
  var=""; [ $tree = new ] && var="$extra"
  (cd $dir && timeout -k 5 170 python3 benchmarks/bwd_breakdown.py --out "$OUT/${tree}_$part" \
      --rows 4x4096x16x128,16x1024x16x128 --causal 0,1 --peers cudnn --budget-s 160 $var 2>&1 \
      | grep -i "ms\|rror" | sed "s/^/$tree$part /" | cut -c1-150)
done

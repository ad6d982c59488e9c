# Next session, calls 0a / 0b / 0c (`bash benchmarks/run_s29_call0.sh a`, then `b`, then `c`;
# ~6 minutes each; written in session 28, which had no device).
# a: the compiled mosaic cases of the shared suite plus the new forms' tests, then on session
#    28's kernels the three new opt-in forms at 16x1024x16x128 (where they should show most),
#    alone and together: `bwd_delta_in_dq` (D in the dQ kernel, no pre-pass), `exit_read_only`
#    (each kernel's last TMA-store wait for SMEM reads only), `bwd_persistent` (dK/dV kernel).
# b, c: session 28's dK/dV kernel (D read where dS^T needs it, no second mask on dS^T, the
#    softcap's factor folded into P^T at once; ptxas offline at 1x1024x2x128: spill stores full
#    52 -> 16 B, causal 456 -> 164 B, softcap causal 844 -> 240 B) against session 27's (this
#    tree with benchmarks/ab/s28_dkdv_registers.patch undone), new then old (b) and old then
#    new (c: session 27 saw a first-timed bias), c with the lag form of the fused dQ (its spills
#    192 -> 116 B) and 240 registers (causal 164 -> 72 B) on the new kernel.
# cuDNN in each process; per-kernel CUPTI times (bwd_breakdown.py).
part=${1:-a}
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
breakdown() {  # tree-dir tag rows extra-args...
  local dir=$1 tag=$2 rows=$3; shift 3
  (cd "$dir" && timeout -k 5 170 python3 benchmarks/bwd_breakdown.py --out "$OUT/$tag" \
      --rows "$rows" --causal 0,1 --peers cudnn --budget-s 160 "$@" 2>&1 \
      | grep -i "ms\|rror" | sed "s/^/$tag /" | cut -c1-150)
}
if [ "$part" = a ]; then
  cases="features or fully_masked or extreme or nan_padding or off_by_one"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 180 python3 -m pytest -q -m gpu -n 4 \
      -p no:cacheprovider -rfE tests/pallas_attn/test_attention.py \
      tests/pallas_attn/test_mosaic_delta_in_dq.py tests/pallas_attn/test_mosaic_bwd_persistent.py \
      -k "delta_in_dq or persistent or mosaic and ($cases)" \
      > "$OUT/tests.log" 2>&1
  echo "pytest rc $?"; tail -3 "$OUT/tests.log"
  breakdown . new_forms 16x1024x16x128 --variant dind:bwd_delta_in_dq=True \
      --variant ero:exit_read_only=True --variant pers:bwd_persistent=True \
      --variant all3:bwd_delta_in_dq=True,exit_read_only=True,bwd_persistent=True
  exit 0
fi
rm -rf /tmp/old && mkdir /tmp/old && cp -r . /tmp/old/ 2>/dev/null
(cd /tmp/old && patch -s -p1 -R < benchmarks/ab/s28_dkdv_registers.patch) || exit 1
rows=4x4096x16x128,16x1024x16x128
if [ "$part" = b ]; then
  breakdown . new_b $rows
  breakdown /tmp/old old_b $rows
else
  breakdown /tmp/old old_c $rows
  breakdown . new_c $rows --variant lag:bwd_dq_lag=True,named_free=True,bwd_registers=240 \
      --variant r240:bwd_registers=240
fi

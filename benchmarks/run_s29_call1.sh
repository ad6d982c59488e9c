# Session 29, call 1a / 1b (`bash benchmarks/run_s29_call1.sh a`, then `b`; ~8 minutes each).
# a: the compiled suite with session 28's defaults set (D in the dQ kernel at H <= 128, the
#    persistent backward kernels on unmasked rows up to 1024 keys): the shared suite's mosaic
#    cases (sampled) and the flags' own tests; then per-kernel times with session 27's flags
#    (`old`) and 240 registers on the dK/dV kernel (`r240`) as variants, ours timed first.
# b: the same rows with ours timed last (`--ours-last`), the first-timed bias check.
part=${1:-a}
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
breakdown() {  # tag extra-args...
  local tag=$1; shift
  timeout -k 5 230 python3 benchmarks/bwd_breakdown.py --out "$OUT/$tag" \
      --rows 16x1024x16x128,8x2048x16x128 --causal 0,1 --peers cudnn --budget-s 200 \
      --variant old:bwd_delta_in_dq=False,bwd_persistent=False \
      --variant r240:bwd_registers=240 "$@" 2>&1 \
      | grep -i "ms\|rror" | sed "s/^/$tag /" | cut -c1-150
}
if [ "$part" = a ]; then
  cases="features or fully_masked or extreme or nan_padding or off_by_one or gqa or causal"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 240 python3 -m pytest -q -m gpu -n 4 \
      -p no:cacheprovider -rfE tests/pallas_attn/test_attention.py \
      tests/pallas_attn/test_mosaic_delta_in_dq.py tests/pallas_attn/test_mosaic_bwd_persistent.py \
      -k "delta_in_dq or persistent or mosaic and ($cases)" \
      > "$OUT/tests.log" 2>&1
  echo "pytest rc $?"; tail -3 "$OUT/tests.log"
  breakdown first
else
  breakdown last --ours-last
fi

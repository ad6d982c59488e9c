# Next session, call 1 (written in session 30; ~4 minutes a part): `Config.bwd_early_stats`
# (the dK/dV kernel's lse / D read while S^T / dP^T runs; benchmarks/NOTES.md, session 30),
# `Config.bwd_self_fed` (no producer warpgroup: up to 255 registers a consumer, which lets
# `bwd_defer_wait` compile without C7512) and a three-stage backward ring (`bwd_num_stages=3`,
# last timed at T = 1024 in session 5),
# against the default, per kernel, cuDNN in the same process; gradients compared with the
# default's (the early reads must be bitwise).
#   a: ours first;  b: ours last (`--ours-last`, the first-timed bias check);
#   c: the compiled bitwise tests, then H = 256 (the split dK/dV kernel) full and causal;
#   d: H = 64 (the same kernel as H = 128; ptxas spills nothing there with either form);
#   e: 16x1024x16x128 in both orders (unmasked, the default there is the persistent dK/dV
#      kernel: `sf` leaves it as it is, the defer_wait variants run the self-fed grid kernel).
part=${1:-a}
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
breakdown() {  # tag rows causal extra-args...
  local tag=$1 rows=$2 causal=$3; shift 3
  timeout -k 5 250 python3 benchmarks/bwd_breakdown.py --out "$OUT/$tag" --rows "$rows" \
      --causal "$causal" --peers cudnn --budget-s 220 \
      --variant lse:bwd_early_stats=lse --variant both:bwd_early_stats=lse+delta "$@" 2>&1 \
      | grep -i "ms\|rror" | sed "s/^/$tag /" | cut -c1-150
}
# the self-fed dK/dV kernel (no producer warpgroup): alone, with defer_wait, and with
# defer_wait and lse read early; and a three-stage ring
SF=(--variant sf:bwd_self_fed=True --variant sfd:bwd_self_fed=True,bwd_defer_wait=True
    --variant sfde:bwd_self_fed=True,bwd_defer_wait=True,bwd_early_stats=lse
    --variant st3:bwd_num_stages=3)
case "$part" in
  a) breakdown first 4x4096x16x128 0,1 "${SF[@]}" ;;
  b) breakdown last 4x4096x16x128 0,1 "${SF[@]}" --ours-last ;;
  e) breakdown first1k 16x1024x16x128 0,1 "${SF[@]}"
     breakdown last1k 16x1024x16x128 0,1 "${SF[@]}" --ours-last ;;
  c) XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -m gpu -n 7 \
         -p no:cacheprovider -rfE tests/pallas_attn/test_mosaic_early_stats.py \
         tests/pallas_attn/test_mosaic_self_fed.py 2>&1 | tail -3
     breakdown h256 4x4096x8x256 0,1 ;;
  d) breakdown h64 4x4096x32x64 0,1 ;;
esac

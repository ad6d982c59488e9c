# Next session, call 1 (written in session 31; ~4-5 minutes a part): the issue table's fwd+bwd
# rows with session 31's defaults (`bwd_early_stats` on: "lse" on the unmasked H = 128 grid
# dK/dV kernel, "lse+delta" elsewhere), ours, cuDNN and tokamax's Mosaic backend in the same
# process, two rounds each. Session 31 measured them on an H100 only; the README table is the
# H200's from session 30 (fwd+bwd 0.90-0.99x on H = 128).
#   a: 4x4096, 8x2048, 16x1024 (H = 128);  b: 2x8192, 1x16384 (H = 128);  c: H = 64 and 256.
part=${1:-a}
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
case "$part" in
  a) rows=4x4096x16x128,8x2048x16x128,16x1024x16x128 ;;
  b) rows=2x8192x16x128,1x16384x16x128 ;;
  c) rows=4x4096x32x64,4x4096x8x256 ;;
esac
timeout -k 5 500 python3 benchmarks/attention.py --out "$OUT/fwdbwd_$part" --modes fwdbwd \
    --rounds 2 --impls ours-mosaic,cudnn,tokamax-mosaic --budget-s 480 --rows "$rows" 2>&1 \
    | grep -i " ms \|rror" | cut -c1-120

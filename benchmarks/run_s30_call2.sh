# Next session, call 2 (~6 minutes; written in session 29): cuDNN's backward with XLA's
# deterministic switch. XLA documents its cuDNN multi-headed attention as non-deterministic
# unless `--xla_gpu_exclude_nondeterministic_ops` is set (its fused-MHA tests set the flag for
# the backward); the float32 dQ accumulator and the `convert_dq_to_16bits` kernel in cuDNN's
# profile fit atomically added dQ partials. Our default backward is deterministic (issue #3
# asks for that), so the table compares it with cuDNN's non-deterministic default. Two
# processes, the same rows: XLA's default, then with the flag (cuDNN deterministic). The issue's
# bar stays the default cuDNN; this says what determinism costs cuDNN on the same device.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
rows=4x4096x16x128,1x16384x16x128,16x1024x16x128
for mode in default deterministic; do
  flags=""; [ "$mode" = deterministic ] && flags="--xla_gpu_exclude_nondeterministic_ops=true"
  XLA_FLAGS="$flags" timeout -k 5 250 python3 benchmarks/attention.py --out "$OUT/$mode" \
      --modes fwdbwd --rounds 2 --impls ours-mosaic,cudnn --budget-s 230 --rows $rows 2>&1 \
      | grep -i " ms \|rror" | sed "s/^/$mode /" | cut -c1-120
done

# Session 35's first call: on an H200 the issue table's H = 128 fwd+bwd rows (part a of
# run_s32_call1.sh: none timed on an H200 since session 30); on an H100 the masked-halves call.
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$name"
case "$name" in
  *H200*) bash benchmarks/run_s32_call1.sh a ;;
  *) bash benchmarks/run_s35_call1.sh ;;
esac

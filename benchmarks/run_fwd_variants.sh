# The forward variants for the rows below cuDNN (H=64 full / causal, H=256 full), written in
# session 11 (NOTES, "two H = 64 forward variants"): one Mosaic forward config per process under a
# timeout (the named-barrier overlap has never run on a GPU), cuDNN in the same process. Run on
# the GPU machine from the repository root; writes $OUT/fwd.jsonl and $OUT/fwd.log and prints
# one line per config.
#   bash benchmarks/run_fwd_variants.sh [seconds per config, default 45]
source benchmarks/setup_gpu.sh >/dev/null 2>&1
limit="${1:-45}"
out="${OUT:-/tmp}"
one() {
  echo "=== $*" >> "$out/fwd.log"
  timeout -k 5 "$limit" python3 benchmarks/mosaic_one.py "$@" --cudnn --out "$out/fwd.jsonl" \
      >> "$out/fwd.log" 2>&1 || echo "rc=$? $*" | tee -a "$out/fwd.log"
}
for mask in "" --causal; do
  for f in "" sum_in_pv=True "overlap=True,block_kv=128" \
           "overlap=True,block_kv=128,named_barriers=False"; do
    one --shape 4x4096x32x64 $mask --fields "$f"
  done
done
# Causal: the persistent launch with the dynamic tile counter (+6% on causal H=128 rows, session
# 7) has never run at H=64, where 256-key blocks hang in the persistent loop: 128-key blocks.
for f in "persistent=True,dynamic_schedule=True,block_kv=128" \
         "persistent=True,dynamic_schedule=True,block_kv=128,sum_in_pv=True"; do
  one --shape 4x4096x32x64 --causal --fields "$f"
done
# H=256 full (0.933x): the row sum under P V, and the two masked-call defaults (pinned softmax,
# slot releases on named barriers), measured only at H=128 unmasked (-0.8%).
for f in "" sum_in_pv=True "pin_softmax=True,named_free=True"; do
  one --shape 4x4096x8x256 --fields "$f"
done
cat "$out/fwd.jsonl" 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
  r=json.loads(l); print(r['shape'], r['causal'], r['fields'] or 'default', round(r['ms'],4), round(r.get('cudnn_ms',0),4), round(r.get('speedup_vs_cudnn',0),3), r['rel_err'])"

# The H=64 / H=256 stall probe (NOTES, "The H=64 / H=256 rows"): one Mosaic forward config per
# process under a timeout, so a hanging kernel costs one timeout, not the whole run.
# Run on the GPU machine from the repository root; writes $OUT/one.jsonl and $OUT/one.log.
#   bash benchmarks/run_stall_probe.sh [seconds per config, default 45]
source benchmarks/setup_gpu.sh >/dev/null 2>&1
limit="${1:-45}"
out="${OUT:-/tmp}"
one() {
  echo "=== $*" >> "$out/one.log"
  timeout -k 5 "$limit" python3 benchmarks/mosaic_one.py "$@" --out "$out/one.jsonl" \
      >> "$out/one.log" 2>&1 || echo "rc=$? $*" | tee -a "$out/one.log"
}
for f in persistent=False persistent=True "persistent=True,block_kv=128" \
         "persistent=False,block_kv=128"; do
  one --shape 4x4096x32x64 --fields "$f" --cudnn
done
for f in persistent=False persistent=True; do one --shape 4x4096x32x64 --causal --fields "$f" --cudnn; done
for f in persistent=False persistent=True; do one --shape 4x4096x8x256 --fields "$f" --cudnn; done
for f in persistent=False persistent=True; do one --shape 4x4096x8x256 --causal --fields "$f" --cudnn; done
cat "$out/one.jsonl" 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
  r=json.loads(l); print(r['shape'], r['causal'], r['fields'], round(r['ms'],4), round(r.get('cudnn_ms',0),4), round(r.get('speedup_vs_cudnn',0),3), r['rel_err'])"

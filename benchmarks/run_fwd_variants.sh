# Forward variants for the rows below cuDNN: one Mosaic forward config per process under a
# timeout (a config may hang compiled), cuDNN in the same process. Run on the GPU machine from
# the repository root; writes $OUT/fwd.jsonl and $OUT/fwd.log and prints one line per config.
#   bash benchmarks/run_fwd_variants.sh [set, default tiles] [seconds per config, default 45]
# Sets (predictions in benchmarks/NOTES.md):
#   s11    session 11's variants (sum_in_pv, overlap on named barriers, the causal H=64
#          persistent launch); run in session 12.
#   tiles  session 12: FA3's key blocks that are not multiples of 64 (80 at H=256, 176 at
#          H=128, 192 at H=64), possible since the V ring's swizzle follows the block; the
#          persistent launch at H=256 (O in 64-column chunks); the persistent 256-key hang
#          probed with mbarrier turns (interpret mode's form). ~16 configs, ~5-6 minutes.
#   lazy   session 16: Config.lazy_rescale (FA4's conditional rescaling) at H = 256 and on the
#          two unmasked H = 128 rows nearest cuDNN.
#   vring  session 17: Config.v_stages (a deeper K ring than V's) at H = 256 and H = 128.
#   s18    written in session 17: FA3's intra-warpgroup overlap at H = 256 (full row).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
set_name="${1:-tiles}"
limit="${2:-45}"
out="${OUT:-/tmp}"
source benchmarks/one_fwd.sh
if [ "$set_name" = s11 ]; then
  for mask in "" --causal; do
    for f in "" sum_in_pv=True "overlap=True,block_kv=128" \
             "overlap=True,block_kv=128,named_barriers=False"; do
      one --shape 4x4096x32x64 $mask --fields "$f"
    done
  done
  for f in "persistent=True,dynamic_schedule=True,block_kv=128" \
           "persistent=True,dynamic_schedule=True,block_kv=128,sum_in_pv=True"; do
    one --shape 4x4096x32x64 --causal --fields "$f"
  done
  for f in "" sum_in_pv=True "pin_softmax=True,named_free=True"; do
    one --shape 4x4096x8x256 --fields "$f"
  done
elif [ "$set_name" = tiles ]; then
  # ptxas's report (registers, spills) of the persistent H=64 forward with 128-key blocks (runs)
  # and 256 (hangs): compile only, dumps under $OUT/ptxas_{128,256}, summary in fwd.log.
  for bkv in 128 256; do
    MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO="$out/ptxas_$bkv" timeout -k 5 60 python3 \
        benchmarks/mosaic_one.py --shape 4x4096x32x64 --fields "persistent=True,block_kv=$bkv" \
        --probe-stall --compile-only >> "$out/fwd.log" 2>&1
    echo "ptxas $bkv:" $(grep -h -E "Used [0-9]+ registers|spill" "$out"/ptxas_$bkv/* 2>/dev/null \
        | sort | uniq -c | head -8) | tee -a "$out/fwd.log"
  done
  # H=256 (0.934x full): FA3's 128 x 80 tile, 2 stages (224 KB of SMEM); the persistent
  # launch with O stored in 64-column chunks (tokamax's sm90 default there, 0.97x cuDNN).
  for mask in "" --causal; do
    for f in "" block_kv=80 persistent=True; do
      one --shape 4x4096x8x256 $mask --fields "$f"
    done
  done
  # H=128 full (1.00x): FA3's 176-key block, persistent (the default launch) and grid.
  for f in "" block_kv=176 "block_kv=176,persistent=False"; do
    one --shape 4x4096x16x128 --fields "$f"
  done
  one --shape 16x1024x16x128 --fields block_kv=176
  # H=64 full (0.948x): 192-key blocks on the grid; then the persistent 256-key hang with the
  # turns on mbarriers (interpret mode's form, which runs there) and with 192 keys.
  for f in block_kv=192 "persistent=True,block_kv=192"; do
    one --shape 4x4096x32x64 --fields "$f"
  done
  one --shape 4x4096x32x64 --fields "persistent=True,named_barriers=False" --probe-stall
  one --shape 4x4096x32x64 --causal --fields block_kv=192
elif [ "$set_name" = lazy ]; then
  # Session 16: FA4's conditional rescaling (lazy_rescale = tau, log2 units) on the rows just
  # below or at cuDNN: H = 256 (O's rescale is 128 FMULs a thread a step there), 1x16384 and
  # 4x4096 H = 128 full. Each row's default first, then tau = 8 (FA4's) and 16; ~3 minutes.
  for mask in "" --causal; do
    for f in "" lazy_rescale=8.0 lazy_rescale=16.0; do
      one --shape 4x4096x8x256 $mask --fields "$f"
    done
  done
  for shape in 1x16384x16x128 4x4096x16x128; do
    for f in "" lazy_rescale=8.0; do
      one --shape $shape --fields "$f"
    done
  done
elif [ "$set_name" = vring ]; then
  # Session 17: K and V rings of different depths (Config.v_stages) at H = 256 (3 K + 2 V
  # slots fit next to Q, 2 + 2 before), the causal row's lazy_rescale (1.03 -> 1.06x in
  # session 17's first run) and 1x16384 / 4x4096 H = 128 full (3 + 2 of 128 keys); ~4 minutes.
  for f in "" "num_stages=3,v_stages=2" "num_stages=2,v_stages=1"; do
    one --shape 4x4096x8x256 --fields "$f"
  done
  for f in "" lazy_rescale=8.0 "num_stages=3,v_stages=2"; do
    one --shape 4x4096x8x256 --causal --fields "$f"
  done
  for shape in 1x16384x16x128 4x4096x16x128; do
    for f in "" "num_stages=3,v_stages=2"; do
      one --shape $shape --fields "$f"
    done
  done
elif [ "$set_name" = s18 ]; then
  # Written in session 17 for session 18: the H = 256 full row (0.94x) with FA3's
  # intra-warpgroup overlap (Config.overlap: lowers at H = 256 on CPU, never compiled there;
  # S_next + P + O = 32 + 16 + 128 registers a thread), its ptxas report first (spills?).
  source benchmarks/ptxas_report.sh
  ptxas_report "Config(block_kv=64,overlap=True)" 256 fwd | tee -a "$out/fwd.log"
  for f in "" overlap=True "overlap=True,named_barriers=False"; do
    one --shape 4x4096x8x256 --fields "$f"
  done
else
  echo "unknown set $set_name (s11, tiles, lazy, vring or s18)"; exit 2
fi
cat "$out/fwd.jsonl" 2>/dev/null | python3 -c "
import json,sys
for l in sys.stdin:
  r=json.loads(l); print(r['shape'], r['causal'], r['fields'] or 'default', round(r['ms'],4), round(r.get('cudnn_ms',0),4), round(r.get('speedup_vs_cudnn',0),3), r['rel_err'])"

# Session 27, call 2 (~4 minutes): (1) MUFU throughput of scalar and packed 16-bit ex2 and the
# e4m3x2 pack (benchmarks/mufu_probe.py), with their SASS if nvdisasm is on the machine;
# (2) the session-26 hang's own context once more: attention_fp8.py timing fp8 then
# fp8-kv with the fused Q pass at 16x1024x16x128 (CUPTI); (3) on an H200 only, the bf16
# three-consumer probe at 1x16384x16x128 full.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout -k 5 120 python3 benchmarks/mufu_probe.py --out "$OUT/mufu" --ptx "$OUT/mufu/t.ptx" 2>&1 \
    | grep -v Warning | cut -c1-400
# (As run in session 27 the cubin was compiled on the CPU host with its ptxas 13.0 and carried.)
dis=$(find / -name nvdisasm -type f 2>/dev/null | head -1)
pxs=$(dirname "$dis")/ptxas
if [ -n "$dis" ] && "$pxs" -arch=sm_90a "$OUT/mufu/t.ptx" -o /tmp/t.cubin; then
  "$dis" -c /tmp/t.cubin > "$OUT/mufu/t.sass" 2>&1
  grep -E "MUFU|F2FP|F2F|HADD2|FADD|\.entry|Function" "$OUT/mufu/t.sass" | sort | uniq -c | sort -rn | head -30
else echo "no nvdisasm"; fi
mkdir -p "$OUT/hang"
timeout -k 5 150 python3 benchmarks/attention_fp8.py --out "$OUT/hang" --budget-s 120 \
    --rows 16x1024x16x128 --causal 0 --impls "fp8,fp8-kv-fused,fp8-kv,bf16" 2>&1 \
    | grep "ms\|rror" | tail -6; echo "attention_fp8 rc ${PIPESTATUS[0]}"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout -k 5 200 python3 benchmarks/mosaic_ab.py --rows 2 --causal 0 --cases 1 \
      --variant c3:consumers=3 --peers cudnn --out "$OUT/c3" 2>&1 | tail -8
fi

# Session 31, call 3 as run (~6 minutes; the budget left after a third refused start): the new
# bwd_early_stats defaults against the late reads ("late") on the issue-table H = 128 rows not
# timed in call 1, plus self-fed with lse and D read early ("sfb", 243 registers, no spills
# offline) on the unmasked rows; cuDNN in the same process. Then, time permitting, a compiled
# sample of the shared suite's mosaic grid without XLA autotuning (runs the new defaults).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
bd() { timeout -k 5 "$1" python3 benchmarks/bwd_breakdown.py --peers cudnn --budget-s "$(( $1 - 15 ))" \
         --variant late:bwd_early_stats= "${@:2}" 2>&1 | grep -i " ms\|rror" | cut -c1-100; }
bd 170 --out "$OUT/full" --rows 8x2048x16x128,1x16384x16x128,4x4096x16x128 --causal 0 \
    --variant "sfb:bwd_self_fed=True,bwd_early_stats=lse+delta"
bd 100 --out "$OUT/causal" --rows 8x2048x16x128,1x16384x16x128 --causal 1
ids=$(python3 -m pytest -q --collect-only -m gpu tests/pallas_attn/test_attention.py \
        -k "mosaic and full_grid" 2>/dev/null | grep "::" | awk 'NR % 48 == 5')
start=$(date +%s)
XLA_FLAGS=--xla_gpu_autotune_level=0 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 120 \
    python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rfE $ids > "$OUT/noautotune.log" 2>&1
echo "noautotune rc=$? $(( $(date +%s) - start )) s: $(tail -1 "$OUT/noautotune.log")"

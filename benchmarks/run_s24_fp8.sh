# Session 24, FP8 call (~6 minutes): why the FP8 forward is slower than our bf16 one (first
# compiled run, session 24: 0.93 ms against 0.81 at 4x4096x16x128 full, cuDNN FP8 0.56).
# Nsight Compute on the FP8 kernel and on the bf16 forward of the same row (stall reasons,
# issue slots), then a Config sweep of the FP8 kernel in one process with bf16 and cuDNN FP8.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
OUT="$OUT/ncu" timeout -k 5 250 bash benchmarks/run_ncu.sh attn_fp8 attn_fwd_h128 2>&1 \
    | grep -v "^W0\|^I0" | tail -30
mkdir -p "$OUT/sweep"
K=fp8-kernel
P="+fp8_p_registers=True"
timeout -k 5 200 python3 benchmarks/attention_fp8.py --out "$OUT/sweep" --budget-s 170 \
    --rows 4x4096x16x128 --causal 0,1 --impls "bf16,cudnn-fp8,fp8,$K,$K-preg,$K+exp2_poly_cols=32,\
$K$P+exp2_poly_cols=32,$K+num_stages=3,$K+consumers=3,$K$P+consumers=3,$K$P+sum_in_pv=True,\
$K$P+lazy_rescale=8.0,$K+persistent=True" 2>&1 | grep "ms\|rror" | tail -26
mkdir -p "$OUT/sweep256"
timeout -k 5 60 python3 benchmarks/attention_fp8.py --out "$OUT/sweep256" --budget-s 40 \
    --rows 4x4096x8x256 --causal 0 --impls "bf16,$K-preg,$K+num_stages=3,$K$P+exp2_poly_cols=32" \
    2>&1 | grep "ms\|rror" | tail -6

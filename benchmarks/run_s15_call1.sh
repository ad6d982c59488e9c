# Session 15, device call 1 (~5 minutes). (1) repro_register_q.py with the online softmax (does
# Q from registers still agree with Q from SMEM?). (2) ptxas's report of the backward: the
# default at 232 and 240 consumer registers, the fused dQ (bwd_fused_dq, FA3 Section 3.3) at
# 232 and 240 (compile only). (3) bwd_breakdown.py at 4x4096x16x128 full: 240 registers, the
# fused dQ at 232 and 240, against the default and cuDNN. Outputs under $OUT.
# (The ptxas step is now benchmarks/ptxas_report.sh; it ran as the same commands inline.)
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
timeout 90 python3 benchmarks/repro_register_q.py 2>&1 | grep -v "^W0\|^I0" | tail -12 \
    | tee "$out/repro_register_q.txt"
source benchmarks/ptxas_report.sh
for v in "Config()" "Config(bwd_registers=240)" "Config(bwd_fused_dq=True)" \
         "Config(bwd_fused_dq=True,bwd_registers=240)"; do
  ptxas_report "$v" 128 grad
done 2>&1 | tee "$out/ptxas_bwd.txt"
timeout -k 5 330 python3 benchmarks/bwd_breakdown.py --out "$out" --peers cudnn \
    --variant r240:bwd_registers=240 --variant fused:bwd_fused_dq=True \
    --variant fused240:bwd_fused_dq=True,bwd_registers=240 \
    --rows 4x4096x16x128 --causal 0 --budget-s 280 2>&1 \
    | grep -v "^W0\|^I0" | tail -30

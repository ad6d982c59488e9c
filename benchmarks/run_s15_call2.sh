# Session 15, device call 2 (~4 minutes): the lagged fused dQ (Config.bwd_dq_lag). ptxas's
# report (spills, wgmma serialisation) at 232 and 240 registers, compile only; then
# bwd_breakdown.py against the default (two kernels), the session-6 fused form at 240 and cuDNN
# on the H = 128 rows. Outputs under $OUT.
# (The ptxas step is now benchmarks/ptxas_report.sh; it ran as the same commands inline.)
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
source benchmarks/ptxas_report.sh
for v in "Config(bwd_dq_lag=True)" "Config(bwd_dq_lag=True,bwd_registers=240)"; do
  ptxas_report "$v" 128 grad
done 2>&1 | tee "$out/ptxas_lag.txt"
timeout -k 5 400 python3 benchmarks/bwd_breakdown.py --out "$out" --peers cudnn \
    --variant fused240:bwd_fused_dq=True,bwd_registers=240 \
    --variant lag:bwd_dq_lag=True --variant lag240:bwd_dq_lag=True,bwd_registers=240 \
    --variant lagn240:bwd_dq_lag=True,bwd_registers=240,named_free=True \
    --rows 4x4096x16x128,16x1024x16x128 --causal 0,1 --budget-s 360 2>&1 \
    | grep -v "^W0\|^I0" | grep -v "^ *[0-9]*x[0-9]" | tail -30

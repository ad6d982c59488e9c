# Session 16, device call 2 (~5 minutes). (1) The H = 256 split backward's dQ kernel spilled
# 460-492 bytes in call 1 with the default bwd_dq_regs (Q and dO as register operands: 128
# registers next to dQ's 128): ptxas's report without it, then bwd_breakdown.py at 4x4096x8x256
# full and causal, split with and without bwd_dq_regs, 232 / 240 registers, cuDNN in the same
# process. (2) benchmarks/stream_probe.py (the W4A16 decode bandwidth question). Outputs under $OUT.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
source benchmarks/ptxas_report.sh
for v in "Config(block_kv=64,bwd_split_dkdv=True,bwd_dq_regs=False)" \
         "Config(block_kv=64,bwd_split_dkdv=True,bwd_dq_regs=False,bwd_registers=240)"; do
  ptxas_report "$v" 256 grad
done 2>&1 | tee "$out/ptxas_split_noregs.txt"
timeout -k 5 150 python3 benchmarks/stream_probe.py --out "$out" --budget-s 120 2>&1 \
    | grep -v "^W0\|^I0\|Deprecation\|return plgpu" | tail -30
timeout -k 5 280 python3 benchmarks/bwd_breakdown.py --out "$out" --peers cudnn \
    --variant split240:bwd_split_dkdv=True,bwd_registers=240 \
    --variant nr:bwd_split_dkdv=True,bwd_dq_regs=False \
    --variant nr240:bwd_split_dkdv=True,bwd_dq_regs=False,bwd_registers=240 \
    --rows 4x4096x8x256 --causal 0,1 --budget-s 250 2>&1 \
    | grep -v "^W0\|^I0" | grep -v "^ *[0-9]*x[0-9]" | tail -30

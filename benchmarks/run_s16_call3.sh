# Session 16, device call 3 (~5 minutes): the H = 256 dQ kernel with two K slots and one V slot
# (Statics.v_stages; one slot each in calls 1-2) and bwd_dq_serial (S waited for before dP is
# issued: one float32 accumulator fewer in flight). (1) ptxas's report; (2) the compiled -m gpu
# split tests; (3) bwd_breakdown.py at 4x4096x8x256 full and causal against cuDNN.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
source benchmarks/ptxas_report.sh
for v in "Config(block_kv=64,bwd_split_dkdv=True,bwd_registers=240)" \
         "Config(block_kv=64,bwd_split_dkdv=True,bwd_dq_serial=True)" \
         "Config(block_kv=64,bwd_split_dkdv=True,bwd_dq_serial=True,bwd_registers=240)"; do
  ptxas_report "$v" 256 grad
done 2>&1 | tee "$out/ptxas_rings.txt"
timeout -k 5 200 python3 -m pytest -q -n 3 -m gpu -p no:cacheprovider \
    tests/pallas_attn/test_mosaic_backward_split.py 2>&1 | tail -4 | tee "$out/split_tests.txt"
timeout -k 5 300 python3 benchmarks/bwd_breakdown.py --out "$out" --peers cudnn \
    --variant nr240:bwd_split_dkdv=True,bwd_dq_regs=False,bwd_registers=240 \
    --variant nrs:bwd_split_dkdv=True,bwd_dq_regs=False,bwd_dq_serial=True \
    --variant nrs240:bwd_split_dkdv=True,bwd_dq_regs=False,bwd_dq_serial=True,bwd_registers=240 \
    --rows 4x4096x8x256 --causal 0,1 --budget-s 270 2>&1 \
    | grep -v "^W0\|^I0" | grep -v "^ *[0-9]*x[0-9]" | tail -30

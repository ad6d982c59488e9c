# Session 16, device call 1 (~7 minutes): the H = 256 split backward (Config.bwd_split_dkdv),
# never run on a GPU before. (1) ptxas's report (spills, C75xx) at H = 256; (2) its compiled
# -m gpu tests (ratio rule against the float32 reference); (3) bwd_breakdown.py at 4x4096x8x256
# full and causal: the default (Triton FA2 backward at H = 256), split at 232 and 240 consumer
# registers, cuDNN in the same process. Outputs under $OUT.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
source benchmarks/ptxas_report.sh
for v in "Config(block_kv=64,bwd_split_dkdv=True)" \
         "Config(block_kv=64,bwd_split_dkdv=True,bwd_registers=240)"; do
  ptxas_report "$v" 256 grad
done 2>&1 | tee "$out/ptxas_split.txt"
timeout -k 5 260 python3 -m pytest -q -n 3 -m gpu -p no:cacheprovider \
    tests/pallas_attn/test_mosaic_backward_split.py 2>&1 | tail -15 | tee "$out/split_tests.txt"
timeout -k 5 300 python3 benchmarks/bwd_breakdown.py --out "$out" --peers cudnn \
    --variant split:bwd_split_dkdv=True --variant split240:bwd_split_dkdv=True,bwd_registers=240 \
    --rows 4x4096x8x256 --causal 0,1 --budget-s 270 2>&1 \
    | grep -v "^W0\|^I0" | grep -v "^ *[0-9]*x[0-9]" | tail -30

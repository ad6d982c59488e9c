# Session 14, device call 2 (~5 minutes): the forward with Q in registers (Config.q_regs_cols).
# Call 1 found the unmasked persistent H=128 form wrong (out differs from the default's by as
# much as |out|) while the causal persistent form was bitwise the default's: first which part
# of the unmasked launch breaks it (grid, mbarrier turns, the pinned softmax), then the other
# head dims, each config in its own process with its error against the reference and cuDNN.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
source benchmarks/one_fwd.sh
for f in q_regs_cols=128 "q_regs_cols=128,persistent=False" "q_regs_cols=128,named_barriers=False" \
         "q_regs_cols=128,pin_softmax=True"; do
  one --shape 4x1024x16x128 --fields "$f"
done
for f in "" q_regs_cols=128; do one --shape 4x4096x8x256 --fields "$f"; done
one --shape 4x4096x8x256 --causal --fields q_regs_cols=128
for f in "" q_regs_cols=64; do one --shape 4x4096x32x64 --fields "$f"; done
one --shape 1x16384x16x128 --fields q_regs_cols=128
python3 benchmarks/mosaic_one_summary.py "$out/fwd.jsonl"

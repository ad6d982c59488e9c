# Session 14, device call 4 (~4 minutes): the unmasked forward with Q in registers and a
# dynamic trip count (the workaround for call 2/3's wrong H=128 outputs), at H=128 (three rows)
# and H=64 (256-key persistent default, 128-key grid), errors against the reference, cuDNN in
# the same process.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
source benchmarks/one_fwd.sh
one --shape 4x1024x16x128 --fields q_regs_cols=128
one --shape 4x1024x16x128 --fields "q_regs_cols=128,persistent=False"
one --shape 4x4096x16x128 --fields q_regs_cols=128
one --shape 4x4096x16x128 --fields ""
one --shape 1x16384x16x128 --fields q_regs_cols=128
one --shape 1x16384x16x128 --fields ""
one --shape 4x4096x32x64 --fields q_regs_cols=64
one --shape 4x4096x32x64 --fields "q_regs_cols=64,block_kv=128,persistent=False"
python3 benchmarks/mosaic_one_summary.py "$out/fwd.jsonl"

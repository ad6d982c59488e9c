# Session 13, device call 1 (~7 minutes): ptxas's report for the dQ writer (compile only), then
# the forward tile set of session 12 (`run_fwd_variants.sh tiles`). Outputs under $OUT.
bash benchmarks/run_bwd_writer_probe.sh
bash benchmarks/run_fwd_variants.sh tiles 45

# Session 26, call 2 (~8 minutes): W4A16 at 64 rows with four warpgroups (256 features) sharing
# x over two stages of half steps (session 22's call 2, never run: predictions in NOTES.md,
# "Call 2 predictions (run_s22_call2.sh ...)"), ptxas first (spills at the 128-register cap?);
# then the weakest one-call row, 256 x 8192 x 8192 (0.83x bf16, session 25): is it the step
# parts, the carried codes or the K split that costs it?
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/w4a16_ptxas.sh
W="MosaicConfig(block_n=256, block_k=512, num_stages=2, out_registers=True, step_parts=2, scaled_acc=True"
w4a16_ptxas 64 8192 28672 "$W, split_k=2)"
w4a16_ptxas 64 28672 8192 "$W, split_k=4)"
w4a16_probe_run m64a 64x8192x28672 base,wg4_p2s_k2,wg4_p2s_stream,base_again 110
w4a16_probe_run m64b 64x28672x8192,64x8192x8192 base,wg4_p2s_k2,wg4_p2s_k4,base_again 140
w4a16_probe_run m256 256x8192x8192 api,one_call_carry,q512_scaled,p2_scaled,one_call 100

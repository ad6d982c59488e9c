# Session 22, call 2 (~9 minutes): the 256-row-step shapes at 256 rows in one call (the rest of
# call 1), then 64 rows with four warpgroups (256 features) sharing x over two
# stages of half steps, which fits 128 registers a thread only with the one accumulator
# (MosaicConfig.scaled_acc): twice the warps of the default's two to hide the per-group wgmma
# waits that bound it (Nsight Compute, session 19). ptxas first (spills at the 128 cap?).
source benchmarks/setup_gpu.sh >/dev/null 2>&1
source benchmarks/w4a16_ptxas.sh
W="MosaicConfig(block_n=256, block_k=512, num_stages=2, out_registers=True, step_parts=2, scaled_acc=True"
w4a16_ptxas 64 8192 28672 "$W, split_k=2)"
w4a16_ptxas 64 28672 8192 "$W, split_k=4)"
w4a16_probe_run m256b 256x28672x8192,256x8192x8192,128x28672x8192 api,one_call,scaled,base 120
w4a16_probe_run m64a 64x8192x28672 base,wg4_p2s_k2,wg4_p2s_stream,base_again 110
w4a16_probe_run m64b 64x28672x8192,64x8192x8192 base,wg4_p2s_k2,wg4_p2s_k4,base_again 140

# Session 22, call 1 (~8 minutes): MosaicConfig.step_parts and scaled_acc compiled, ptxas's
# report of the new forms, and their times at 128 and 256 rows against the public path (api:
# 64-row chunks on the 512-row layout, 128-row chunks on the 256-row one) in the same process.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 130 python3 -m pytest -q -m gpu -p no:cacheprovider \
    -rfE tests/quant/test_int4_matmul_mosaic_step_parts.py \
    tests/quant/test_int4_matmul_mosaic_scaled.py 2>&1 | tail -3
source benchmarks/w4a16_ptxas.sh
C="block_n=128, num_stages=2, out_registers=True"
w4a16_ptxas 128 8192 28672 "MosaicConfig($C, block_k=512, step_parts=2)"
w4a16_ptxas 256 8192 28672 "MosaicConfig($C, block_k=512, step_parts=4, scaled_acc=True)"
w4a16_probe_run m128 128x8192x28672 api,one_call,one_call_stream,half512_scaled,bk256_wide 110
w4a16_probe_run m256a 256x8192x28672 api,half512,one_call,one_call_carry,one_call_stream 120

# Session 23 (written CPU-only; first device call for FP8 attention, ~8 minutes): the compiled
# -m gpu tests of pallas_attn.fp8 (kernel against the float32 attention of the same codes and
# against bf16), ptxas's report of the FP8 forward at H = 128, then the forward rows timed:
# ours FP8 (kernel alone and end to end), ours bf16, cuDNN bf16 and cuDNN FP8 in one process.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -k 5 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
    -rfE tests/pallas_attn/test_fp8.py 2>&1 | tail -4
MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptx_fp8 timeout 100 python3 -c "
import jax, jax.numpy as jnp
from pallas_attn import fp8
q = jnp.ones((1, 1024, 2, 128), jnp.bfloat16)
jax.jit(lambda q: fp8.flash_attention_fp8(q, q, q, implementation='mosaic')).lower(q).compile()
" > /tmp/ptx_fp8.log 2>&1
echo "== ptxas FP8 forward H=128 (rc $?)"
grep -h -E "C75[0-9][0-9]|spill stores|registers" /tmp/ptx_fp8/* /tmp/ptx_fp8.log 2>/dev/null \
    | grep -v "^ *#loc" | sort | uniq -c | head -8
mkdir -p "$OUT/fp8"
timeout -k 5 260 python3 benchmarks/attention_fp8.py --out "$OUT/fp8" --budget-s 230 2>&1 | tail -32

# Session 15, device call 2 (~4 minutes): the lagged fused dQ (Config.bwd_dq_lag). ptxas's
# report (spills, wgmma serialisation) at 232 and 240 registers, compile only; then
# bwd_breakdown.py against the default (two kernels), the session-6 fused form at 240 and cuDNN
# on the H = 128 rows. Outputs under $OUT.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
for v in "Config(bwd_dq_lag=True)" "Config(bwd_dq_lag=True,bwd_registers=240)"; do
  tag="$(echo "$v" | tr -dc 'a-z0-9_=')"
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptx_$tag timeout 120 python3 -c "
import jax, jax.numpy as jnp
from pallas_attn import flash_attention
from pallas_attn.mosaic.config import Config
q = jnp.ones((1, 1024, 2, 128), jnp.bfloat16)
cfg = $v
f = lambda q: flash_attention(q, q, q, implementation='mosaic', config=cfg).astype(jnp.float32).sum()
jax.jit(jax.grad(f)).lower(q).compile()
" > /tmp/ptx_$tag.log 2>&1
  echo "== $v (rc $?)"
  grep -h -E "C75[0-9][0-9]|spill stores" /tmp/ptx_$tag/* /tmp/ptx_$tag.log 2>/dev/null \
      | grep -v "^ *#loc" | sort | uniq -c | head -8
done 2>&1 | tee "$out/ptxas_lag.txt"
timeout -k 5 400 python3 benchmarks/bwd_breakdown.py --out "$out" --peers cudnn \
    --variant fused240:bwd_fused_dq=True,bwd_registers=240 \
    --variant lag:bwd_dq_lag=True --variant lag240:bwd_dq_lag=True,bwd_registers=240 \
    --variant lagn240:bwd_dq_lag=True,bwd_registers=240,named_free=True \
    --rows 4x4096x16x128,16x1024x16x128 --causal 0,1 --budget-s 360 2>&1 \
    | grep -v "^W0\|^I0" | grep -v "^ *[0-9]*x[0-9]" | tail -30

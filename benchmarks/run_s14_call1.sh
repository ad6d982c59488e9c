# Session 14, device call 1 (~7 minutes): Q (and dO) as register wgmma operands
# (Config.q_regs_cols, Config.bwd_dq_regs). First ptxas's report (registers, spills, wgmma
# serialisation) of each form, compile only; then bwd_breakdown.py on the four H=128
# fwd+bwd rows with both variants against the default and cuDNN (per-kernel times, and each
# variant's max |difference| from the default's out / dq / dk / dv). Outputs under $OUT.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
for v in "128 grad Config()" "128 grad Config(q_regs_cols=128,bwd_dq_regs=True)" \
         "256 fwd Config(block_kv=64)" "256 fwd Config(block_kv=64,q_regs_cols=128)" \
         "256 fwd Config(block_kv=64,q_regs_cols=256)" \
         "64 fwd Config(block_kv=256)" "64 fwd Config(block_kv=256,q_regs_cols=64)"; do
  set -- $v
  tag="h$1_$2_$(echo "$3" | tr -dc 'a-z0-9_=')"
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptx_$tag timeout 120 python3 -c "
import jax, jax.numpy as jnp
from pallas_attn import flash_attention
from pallas_attn.mosaic.config import Config
q = jnp.ones((1, 1024, 2, $1), jnp.bfloat16)
cfg = $3
f = lambda q: flash_attention(q, q, q, implementation='mosaic', config=cfg).astype(jnp.float32).sum()
f = jax.grad(f) if '$2' == 'grad' else f
jax.jit(f).lower(q).compile()
" > /tmp/ptx_$tag.log 2>&1
  echo "== H=$1 $2 $3 (rc $?)"
  grep -H -i -E "C75|serializ|Used [0-9]+ registers|spill" /tmp/ptx_$tag/* /tmp/ptx_$tag.log \
      2>/dev/null | sed -e 's/ptxas info *: //' -e 's|^/tmp/ptx_[^/]*/||' | sort | uniq -c | head -12
done 2>&1 | tee "$out/ptxas_qregs.txt"
timeout -k 5 380 python3 benchmarks/bwd_breakdown.py --out "$out" --peers cudnn \
    --variant dqr:bwd_dq_regs=True --variant qr:q_regs_cols=128 \
    --rows 16x1024x16x128,4x4096x16x128 --causal 0,1 --budget-s 300 2>&1 \
    | grep -v "^W0\|^I0" | tail -30

# Session 14, device call 3 (~7 minutes). (1) ptxas's report for the dK/dV kernel with K, V or
# both in registers (Config.bwd_dkdv_regs, compile only). (2) bwd_breakdown.py at 4x4096x16x128
# with those variants and Q/dO in registers in the dQ kernel, cuDNN in the same process. (3) The
# unmasked H=128 forward with Q in registers was wrong in call 2 (every launch form) while the
# causal one and H=64 / H=256 were right: bisect it (Q split at 64 columns, 64-key blocks, no
# folded scale, S off the block so the masked loops run), and H=64 causal with Q in registers.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
for r in k v kv; do
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptx_kv$r timeout 120 python3 -c "
import jax, jax.numpy as jnp
from pallas_attn import flash_attention
from pallas_attn.mosaic.config import Config
q = jnp.ones((1, 1024, 2, 128), jnp.bfloat16)
cfg = Config(bwd_dkdv_regs='$r')
f = jax.grad(lambda q: flash_attention(q, q, q, implementation='mosaic', config=cfg).astype(jnp.float32).sum())
jax.jit(f).lower(q).compile()
" > /tmp/ptx_kv$r.log 2>&1
  echo "== bwd_dkdv_regs=$r (rc $?)"
  grep -h -i -E "C75|Used [0-9]+ registers|spill" /tmp/ptx_kv$r/* /tmp/ptx_kv$r.log 2>/dev/null \
      | grep -v "^#loc\|loc(" | sed 's/ptxas info *: //' | sort | uniq -c | head -8
done 2>&1 | tee "$out/ptxas_kvregs.txt"
source benchmarks/one_fwd.sh
for f in q_regs_cols=64 "q_regs_cols=128,block_kv=64" "q_regs_cols=128,fold_scale=False"; do
  one --shape 4x1024x16x128 --fields "$f"
done
one --shape 4x1000x16x128 --fields q_regs_cols=128
for f in "" q_regs_cols=64; do one --shape 4x4096x32x64 --causal --fields "$f"; done
python3 benchmarks/mosaic_one_summary.py "$out/fwd.jsonl"
timeout -k 5 300 python3 benchmarks/bwd_breakdown.py --out "$out" --peers cudnn \
    --variant kr:bwd_dkdv_regs=k --variant vr:bwd_dkdv_regs=v --variant dqr:bwd_dq_regs=True \
    --rows 4x4096x16x128 --causal 0,1 --budget-s 240 2>&1 | grep -v "^W0\|^I0" | tail -12

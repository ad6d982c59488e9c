# Session 13: the dQ writer (Config.bwd_dq_writer) ran its dK/dV kernel 3.4x slower than the
# default. Suspect: ptxas serialising every wgmma of the kernel (its C7511 "insufficient register
# resources for the wgmma pipeline", function-wide) once the writer's accumulator does not fit its
# setmaxnreg share. This dumps ptxas's report of the backward with the writer at 224 and 232
# consumer registers and with the default at 224 (compile only, ~1 minute), then, with "time",
# times the writer at 232 / 40 and the default at 224 against the default. Writes under $OUT.
#   bash benchmarks/run_bwd_writer_probe.sh [time]
mode="${1:-}"
source benchmarks/setup_gpu.sh >/dev/null 2>&1
for v in "True 224" "True 232" "False 224"; do
  set -- $v
  tag="w$1_$2"
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptx_$tag timeout 120 python3 -c "
import jax, jax.numpy as jnp
from pallas_attn import flash_attention
from pallas_attn.mosaic.config import Config
q = jnp.ones((1, 1024, 2, 128), jnp.bfloat16)
cfg = Config(bwd_dq_writer=$1, bwd_registers=$2)
f = jax.jit(jax.grad(lambda q: flash_attention(q, q, q, implementation='mosaic', config=cfg).astype(jnp.float32).sum()))
f.lower(q).compile()
" > /tmp/ptx_$tag.log 2>&1
  echo "== writer=$1 registers=$2 (rc $?)"
  grep -h -i -E "C75|serializ|Used [0-9]+ registers|spill|setmaxnreg" /tmp/ptx_$tag.log /tmp/ptx_$tag/* 2>/dev/null \
      | sed 's/ptxas info *: //' | sort | uniq -c | head -14
done 2>&1 | tee "${OUT:-/tmp}/ptxas_writer.txt"
if [ "$mode" = time ]; then
  timeout -k 5 400 python3 benchmarks/bwd_breakdown.py --out "${OUT:-/tmp}" --peers cudnn \
      --variant w232:bwd_dq_writer=True --variant r224:bwd_registers=224 --rows 4x4096x16x128 \
      --causal 0 --budget-s 300 2>&1 | grep -v "^W0\|^I0" | tail -8
fi

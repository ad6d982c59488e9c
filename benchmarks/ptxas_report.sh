# ptxas's report (registers, spills, wgmma serialisation C75xx) of the Mosaic attention kernels
# for one Config, compile only (~20 s), on the GPU machine. Source it, then:
#   ptxas_report "Config(bwd_dq_lag=True)" [head_dim=128] [grad|fwd]
ptxas_report() {
  local cfg="$1" h="${2:-128}" mode="${3:-grad}"
  local tag="h${h}_${mode}_$(echo "$cfg" | tr -dc 'a-z0-9_=')"
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptx_$tag timeout 120 python3 -c "
import jax, jax.numpy as jnp
from pallas_attn import flash_attention
from pallas_attn.mosaic.config import Config
q = jnp.ones((1, 1024, 2, $h), jnp.bfloat16)
cfg = $cfg
f = lambda q: flash_attention(q, q, q, implementation='mosaic', config=cfg).astype(jnp.float32).sum()
f = jax.grad(f) if '$mode' == 'grad' else f
jax.jit(f).lower(q).compile()
" > /tmp/ptx_$tag.log 2>&1
  echo "== H=$h $mode $cfg (rc $?)"
  grep -h -E "C75[0-9][0-9]|spill stores" /tmp/ptx_$tag/* /tmp/ptx_$tag.log 2>/dev/null \
      | grep -v "^ *#loc" | sort | uniq -c | head -8
}

# ptxas's report (registers, spills, wgmma serialisation C75xx) of the Mosaic W4A16 kernel for
# one shape and MosaicConfig, compile only (~20 s), on the GPU machine. Source it, then:
#   w4a16_ptxas 128 28672 8192 None            # the heuristic config
#   w4a16_ptxas 64 8192 28672 "MosaicConfig(block_n=128, block_k=512, num_stages=3, stream_ctas=132, pipeline=True, out_registers=True)"
w4a16_ptxas() {
  local m="$1" k="$2" n="$3" cfg="${4:-None}"
  local tag="w4_${m}x${k}x${n}_$(echo "$cfg" | tr -dc 'a-z0-9_=' | head -c 80)"
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=/tmp/ptx_$tag timeout 60 python3 -c "
import jax, jax.numpy as jnp
import quant
from quant.matmul import layout, mosaic
from quant.matmul.config import MosaicConfig
i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
qw = quant.QuantizedWeight(qweight=i32($k // 8, $n),
    scales=jax.ShapeDtypeStruct(($k // 128, $n), jnp.bfloat16), zeros=i32($k // 128, $n),
    perm=None, bits=4, group_size=128, sym=False, shape=($k, $n))
mw = jax.eval_shape(layout.prepare_mosaic, qw)
x = jax.ShapeDtypeStruct(($m, $k), jnp.bfloat16)
f = lambda x, mw: mosaic.int4_matmul(x, mw, config=$cfg)
jax.jit(f).lower(x, mw).compile()
" > /tmp/ptx_$tag.log 2>&1
  echo "== ${m}x${k}x${n} $cfg (rc $?)"
  grep -h -E "C75[0-9][0-9]|spill stores|Used [0-9]+ registers" /tmp/ptx_$tag/* /tmp/ptx_$tag.log \
      2>/dev/null | grep -v "^ *#loc" | sort | uniq -c | head -8
  [ -s /tmp/ptx_$tag.log ] && grep -m3 -E "Error|error" /tmp/ptx_$tag.log
}

# And a probe run printing only its timing lines (same shell):
#   w4a16_probe_run DIR SHAPES VARIANTS BUDGET_S      # results under $OUT/DIR
w4a16_probe_run() {
  mkdir -p "${OUT:-/tmp}/$1"
  timeout -k 5 $(( $4 + 30 )) python3 benchmarks/w4a16_probe.py --out "${OUT:-/tmp}/$1" \
      --budget-s "$4" --variants "$3" --shapes "$2" 2>&1 | grep -v "^W0\|^I0" \
      | grep "x.*ms err\|bf16" | tail -12
}

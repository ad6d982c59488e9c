# Session 14, device call 5 (~5 minutes). (1) The wrong unmasked H=128 register-Q forward: is
# it the unmasked loop whose P tile has Q's shape (block_kv == head dim)? Force Q into registers
# past ops.register_q_cols at H=64 with 64-key blocks (same shapes) and at H=128 / 128 keys
# (the known-wrong control); max |out - default out|. (2) bwd_breakdown.py on the H=64 rows with
# the new defaults (Q in registers forward, Q/dO in registers in the dQ kernel) against each
# turned off, cuDNN in the same process: per-kernel times and max |diff| of out / dq / dk / dv.
source benchmarks/setup_gpu.sh >/dev/null 2>&1
out="${OUT:-/tmp}"
timeout -k 5 150 python3 - <<'PY' 2>&1 | grep -v "^W0\|^I0" | tee "$out/forced_qregs.txt"
import jax, jax.numpy as jnp
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, ops
ops.register_q_cols = lambda cfg, *, hp, interpret, masked: min(cfg.q_regs_cols, hp)
for (b, t, n, h), bkv in (((4, 1024, 32, 64), 64), ((4, 1024, 16, 128), 128),
                          ((4, 1024, 16, 128), 64)):
  q, k, v = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16)
             for kk in jax.random.split(jax.random.key(0), 3))
  run = lambda c: jax.jit(lambda q, k, v: flash_attention(
      q, k, v, implementation="mosaic", config=c))(q, k, v).astype(jnp.float32)
  base = run(Config(block_kv=bkv, persistent=False))
  regs = run(Config(block_kv=bkv, persistent=False, q_regs_cols=h))
  bad = jnp.abs(regs - base) > 1e-2
  print(f"H={h} block_kv={bkv}: max |diff| {float(jnp.max(jnp.abs(regs - base))):.3e} "
        f"(max |out| {float(jnp.max(jnp.abs(base))):.3e}); wrong rows by 64-row tile: "
        f"{jnp.any(bad, axis=(0, 2, 3)).reshape(-1, 64).any(axis=1).astype(int).tolist()}")
PY
timeout -k 5 330 python3 benchmarks/bwd_breakdown.py --out "$out" --peers cudnn \
    --variant qoff:q_regs_cols=0 --variant dqoff:bwd_dq_regs=False \
    --rows 4x4096x32x64 --causal 0,1 --budget-s 260 2>&1 | grep -v "^W0\|^I0" | tail -14

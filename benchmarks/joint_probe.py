"""Session 47: does the compiled `bwd_joint` launch finish, and is it bitwise the default?
One small shape under a timeout (run it as `timeout 60 python3 benchmarks/joint_probe.py`)."""
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn import flash_attention
from pallas_attn.mosaic import default_config

b, t, n, h = (int(x) for x in (sys.argv[1:] or ["2", "2048", "4", "128"]))
keys = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in keys)
base = dataclasses.replace(default_config(head_dim=h, seq_k=t, batch=b), bwd_persistent=False)
for name, cfg in (("default", base), ("joint", dataclasses.replace(base, bwd_joint=True))):
  f = jax.jit(jax.grad(lambda q, k, v: flash_attention(
      q, k, v, implementation="mosaic", config=cfg).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
  t0 = time.time()
  lowered = f.lower(q, k, v).compile()
  print(name, "compiled", round(time.time() - t0, 1), "s", flush=True)
  t0 = time.time()
  out = jax.block_until_ready(lowered(q, k, v))
  print(name, "ran", round(time.time() - t0, 2), "s", flush=True)
  if name == "default":
    ref = out
  else:
    print("bitwise", all(np.array_equal(np.asarray(a), np.asarray(c)) for a, c in zip(out, ref)))

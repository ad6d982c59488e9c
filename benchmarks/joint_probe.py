"""Session 47: does the compiled `bwd_joint` launch finish, and is it bitwise the default?
One small shape under a timeout (run it as `timeout 60 python3 benchmarks/joint_probe.py`).
The gradient functions are `joint_variants.build`'s ("default" and the built "overlap" form)."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from joint_variants import build  # noqa: E402

shape = tuple(int(x) for x in (sys.argv[1:] or ["2", "2048", "4", "128"]))
keys = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)
for name in ("default", "overlap"):
  t0 = time.time()
  lowered = build(shape, name).lower(q, k, v).compile()
  print(name, "compiled", round(time.time() - t0, 1), "s", flush=True)
  t0 = time.time()
  out = jax.block_until_ready(lowered(q, k, v))
  print(name, "ran", round(time.time() - t0, 2), "s", flush=True)
  if name == "default":
    ref = out
  else:
    print("bitwise", all(np.array_equal(np.asarray(a), np.asarray(c)) for a, c in zip(out, ref)))

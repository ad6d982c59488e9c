"""Per-kernel CUPTI times of the forward with and without Config.stream_tail, and with its
merge as XLA ops or as one Pallas kernel (``stream_tail_merge``; GPU only).

  python3 benchmarks/stream_tail_breakdown.py OUT.json 8x2048x16x128 4x4096x16x128
"""
import dataclasses
import json
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                os.path.dirname(os.path.abspath(__file__))]
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import timing  # noqa: E402
from pallas_attn import flash_attention  # noqa: E402
from pallas_attn.mosaic.config import default_config  # noqa: E402

rows = []
for shape in sys.argv[2:]:
  b, t, n, h = (int(x) for x in shape.split("x"))
  q, k, v = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16)
             for kk in jax.random.split(jax.random.key(0), 3))
  for tail, merge in ((False, "xla"), (True, "xla"), (True, "pallas")):
    cfg = dataclasses.replace(default_config(head_dim=h, seq_k=t), consumers=2,
                              persistent=True, stream_tail=tail, stream_tail_merge=merge)
    fn = jax.jit(lambda q, k, v, cfg=cfg: flash_attention(q, k, v, config=cfg,
                                                          implementation="mosaic"))
    ks = timing.kernel_breakdown(fn, (q, k, v))
    total = sum(x["ms"] for x in ks)
    rows.append(dict(shape=shape, stream_tail=tail, merge=merge, kernels=ks, ms=total))
    print(shape, tail, merge, round(total, 4),
          [(x["kernel"][:40], round(x["ms"], 4)) for x in ks], flush=True)
with open(sys.argv[1], "w") as f:
  json.dump(rows, f, indent=1)

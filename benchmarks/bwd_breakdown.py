"""Where forward + backward time goes: per-kernel CUPTI times of ours (Mosaic) and the peers.

For each row, the jitted ``jax.vjp`` forward + backward (random cotangent, as ``attention.py``
times it) of our Mosaic backend, cuDNN and tokamax's Mosaic backend is run under the Mosaic GPU
profiler with ``aggregate=False``: the median time of every kernel of one call (our forward, the
D = rowsum(dO * O) pre-pass, the dQ and dK/dV kernels, XLA's glue), and the total. ``--fields``
applies Config fields over ``default_config`` (e.g. ``bwd_dq_block_kv=128``) as a variant;
each variant's (out, dq, dk, dv) is compared with the default's (max |difference|; a variant
that does not change the arithmetic must give 0).

  PYTHONPATH=$PWD python3 benchmarks/bwd_breakdown.py --out $OUT --rows 16x1024x16x128 \\
      --variant dq128:bwd_dq_block_kv=128
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_HERE), _HERE):
  if _p not in sys.path:
    sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import timing  # noqa: E402
from mosaic_ab import parse_variant, peers, with_grads  # noqa: E402
from pallas_attn import flash_attention  # noqa: E402
from pallas_attn.mosaic.config import default_config  # noqa: E402


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--rows", default="16x1024x16x128,4x4096x16x128", help="BxTxNxH,...")
  ap.add_argument("--causal", default="0,1")
  ap.add_argument("--variant", action="append", default=[])
  ap.add_argument("--peers", default="cudnn,tokamax")
  ap.add_argument("--budget-s", type=float, default=400.0)
  args = ap.parse_args()
  t0 = time.time()
  variants = dict(parse_variant(v) for v in args.variant)
  payload = {"meta": timing.metadata(), "variants": variants, "rows": []}
  path = os.path.join(args.out, "bwd_breakdown.json")
  for text in args.rows.split(","):
    b, t, n, h = (int(x) for x in text.split("x"))
    for causal in (bool(int(c)) for c in args.causal.split(",")):
      if time.time() - t0 > args.budget_s:
        payload["stopped"] = f"budget {args.budget_s} s reached"
        break
      keys = jax.random.split(jax.random.key(0), 4)
      q, k, v, do = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in keys)
      base = default_config(head_dim=h, seq_k=t, masked=causal)
      cfgs = {"ours": base, **{name: dataclasses.replace(base, **f) for name, f in variants.items()}}
      fns = {name: (lambda q, k, v, cfg=cfg: flash_attention(
          q, k, v, causal=causal, implementation="mosaic", config=cfg)) for name, cfg in cfgs.items()}
      fns.update(peers(causal, args.peers.split(",")))
      row = {"shape": [b, t, n, h], "causal": causal,
             "flops": timing.attention_flops(b, n, t, t, h, causal=causal, mode="fwdbwd")}
      base_out = None
      for name, fn in fns.items():
        try:
          run = jax.jit(with_grads(fn))
          kernels = timing.kernel_breakdown(run, (q, k, v, do))
          row[name] = {"kernels": kernels, "ms": sum(x["ms"] for x in kernels)}
          if name in cfgs:      # our variants: out, dq, dk, dv against the default's
            got = run(q, k, v, do)
            if base_out is None:
              base_out = got
            else:
              row[name]["max_abs_diff_vs_ours"] = [
                  float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                  for a, b in zip(got, base_out)]
        except Exception as e:  # pylint: disable=broad-except
          row[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(text, causal, name, row[name].get("ms"), flush=True)
      if "ms" in row.get("cudnn", {}):
        for name in fns:
          if "ms" in row[name]:
            row[name]["vs_cudnn"] = row["cudnn"]["ms"] / row[name]["ms"]
      payload["rows"].append(row)
      timing.write_json(path, payload)
  for row in payload["rows"]:
    print(row["shape"], row["causal"])
    for name in (k for k in row if isinstance(row[k], dict)):
      r = row[name]
      if "kernels" in r:
        parts = ", ".join(f"{x['kernel'][:40]} {x['ms']:.4f}" for x in r["kernels"])
        diff = r.get("max_abs_diff_vs_ours")
        print(f"  {name}: {r['ms']:.4f} ms ({r.get('vs_cudnn', 0):.3f}x cuDNN): {parts}"
              + (f"; max |diff| vs ours (out, dq, dk, dv) {diff}" if diff else ""))
      else:
        print(f"  {name}: {r['error'][:200]}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

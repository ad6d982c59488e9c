"""A/B of one Mosaic attention forward variant against the default Config, then an autotune cache.

1. Correctness of the variant: the smoke cases of ``mosaic_smoke.py`` (every mask, GQA/MQA, head
   dims 64/128/256, T and S off the tile) against the float32 reference and against the default
   Config's output.
2. Forward kernel time (CUPTI) of the default and the variant on the benchmark grid's forward
   rows, cuDNN in the same process.
3. If the variant is correct, the faster Config of each row goes into the autotune cache at
   ``$PALLAS_ATTN_TUNE_CACHE`` (``mosaic.autotune.lookup`` reads it), so a grid run after this
   one in the same call uses the winners.

  PYTHONPATH=$PWD PALLAS_ATTN_TUNE_CACHE=$OUT/tune_cache.json \
      python3 benchmarks/mosaic_ab.py --out $OUT --variant overlap=True
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_HERE), _HERE):
  if _p not in sys.path:
    sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import timing  # noqa: E402
from mosaic_smoke import CASES, _inputs  # noqa: E402
from pallas_attn import flash_attention, reference  # noqa: E402
from pallas_attn.mosaic import autotune  # noqa: E402
from pallas_attn.mosaic.config import default_config  # noqa: E402

ROWS = [(4, 4096, 16, 128), (16, 1024, 16, 128), (1, 16384, 16, 128), (4, 4096, 32, 64),
        (4, 4096, 8, 256)]
TOL = 2e-2      # max |out - ref| / max |ref| (as benchmarks/attention.py)


def _parse_variant(text: str) -> dict:
  out = {}
  for item in filter(None, text.split(",")):
    key, val = item.split("=")
    out[key] = {"True": True, "False": False}.get(val, int(val) if val.isdigit() else val)
  return out


def check(case, variant: dict) -> dict:
  b, t, s, n, kh, h, kw = case
  q, k, v, extra = _inputs(b, t, s, n, kh, h, kw)
  ref = reference.attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST, **extra)
  base = default_config(head_dim=h, seq_k=s)
  outs = {}
  for name, cfg in (("default", base), ("variant", dataclasses.replace(base, **variant))):
    fn = jax.jit(lambda q, k, v, cfg=cfg: flash_attention(q, k, v, implementation="mosaic",
                                                          config=cfg, **extra))
    outs[name] = fn(q, k, v).astype(jnp.float32)
  scale = float(jnp.max(jnp.abs(ref)))
  return {"case": str(case),
          "default_err": float(jnp.max(jnp.abs(outs["default"] - ref))) / scale,
          "variant_err": float(jnp.max(jnp.abs(outs["variant"] - ref))) / scale,
          "variant_vs_default": float(jnp.max(jnp.abs(outs["variant"] - outs["default"])))}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--variant", default="overlap=True")
  args = ap.parse_args()
  variant = _parse_variant(args.variant)
  path = os.path.join(args.out, "mosaic_ab.json")
  payload = {"meta": timing.metadata(), "variant": variant, "correctness": [], "rows": []}
  ok = True
  for case in CASES:
    try:
      row = check(case, variant)
      ok &= row["variant_err"] <= TOL
    except Exception as e:  # pylint: disable=broad-except
      row, ok = {"case": str(case), "error": f"{type(e).__name__}: {str(e)[:1500]}"}, False
    print(row, flush=True)
    payload["correctness"].append(row)
    timing.write_json(path, payload)
  payload["variant_correct"] = ok
  cache = {}
  for b, t, n, h in ROWS:
    for causal in (False, True):
      keys = jax.random.split(jax.random.key(0), 3)
      q, k, v = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in keys)
      base = default_config(head_dim=h, seq_k=t)
      cfgs = {"default": base}
      if ok:
        cfgs["variant"] = dataclasses.replace(base, **variant)
      row = {"shape": [b, t, n, h], "causal": causal}
      fns = {name: (lambda q, k, v, cfg=cfg: flash_attention(
          q, k, v, causal=causal, implementation="mosaic", config=cfg)) for name, cfg in cfgs.items()}
      fns["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                                  implementation="cudnn")
      for name, fn in fns.items():
        try:
          row[f"{name}_ms"] = timing.measure(jax.jit(fn), (q, k, v), iterations=10).ms
        except Exception as e:  # pylint: disable=broad-except
          row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:600]}"
      timed = {name: row[f"{name}_ms"] for name in cfgs if f"{name}_ms" in row}
      if timed:
        best = min(timed, key=timed.get)
        row["best"] = best
        if "cudnn_ms" in row:
          row["best_vs_cudnn"] = row["cudnn_ms"] / timed[best]
        cache[autotune.problem_key(head_dim=h, seq_k=t, causal=causal, dtype=jnp.bfloat16)] = {
            "config": dataclasses.asdict(cfgs[best]), "ms": timed[best], "shape": [b, t, t, n, n, h]}
      print(row, flush=True)
      payload["rows"].append(row)
      timing.write_json(path, payload)
  cache_path = autotune.cache_path()
  os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
  with open(cache_path, "w") as f:
    json.dump(cache, f, indent=1, sort_keys=True)
  payload["cache"] = cache
  timing.write_json(path, payload)


if __name__ == "__main__":
  main()

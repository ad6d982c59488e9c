"""A/B of Mosaic attention forward variants against a baseline Config, then an autotune cache.

1. Correctness of each variant: the smoke cases of ``mosaic_smoke.py`` (every mask, GQA/MQA,
   head dims 64/128/256, T and S off the tile) against the float32 reference and against the
   baseline's output.
2. Forward kernel time (CUPTI) of the baseline and every correct variant on the benchmark
   grid's forward rows, cuDNN and tokamax's Mosaic forward in the same process.
3. The fastest correct Config of each row goes into the autotune cache at
   ``$PALLAS_ATTN_TUNE_CACHE`` (``mosaic.autotune.lookup`` reads it).

A variant is ``name:field=value,field=value`` (Config fields; ``--variant`` repeats); the
baseline is ``default_config`` with ``--base`` applied. Results stream into ``OUT/mosaic_ab.json``.
``--mode fwdbwd`` checks dq/dk/dv too and times forward + backward (``jax.vjp``, random
cotangent), the way ``attention.py`` does; that mode writes no autotune cache (the cache is read
for the forward).

  PYTHONPATH=$PWD PALLAS_ATTN_TUNE_CACHE=$OUT/tune_cache.json python3 benchmarks/mosaic_ab.py \
      --out $OUT --variant fma:fold_scale=True --variant named:named_barriers=True
"""
from __future__ import annotations

import argparse
import dataclasses
import json
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
from mosaic_smoke import CASES, _inputs  # noqa: E402
from pallas_attn import flash_attention, reference  # noqa: E402
from pallas_attn.mosaic import autotune  # noqa: E402
from pallas_attn.mosaic.config import default_config  # noqa: E402

ROWS = [(16, 1024, 16, 128), (4, 4096, 16, 128), (1, 16384, 16, 128), (4, 4096, 32, 64),
        (4, 4096, 8, 256)]
TOL = 2e-2      # max |out - ref| / max |ref| (as benchmarks/attention.py)


def _value(val: str):
  """'True'/'False' -> bool, '8' -> int, '8.0' -> float, anything else stays a string."""
  if val in ("True", "False"):
    return val == "True"
  for kind in (int, float):
    try:
      return kind(val)
    except ValueError:
      pass
  return val


def parse_fields(text: str) -> dict:
  out = {}
  for item in filter(None, text.split(",")):
    key, val = item.split("=")
    out[key] = _value(val)
  return out


def parse_variant(text: str) -> tuple[str, dict]:
  name, _, fields = text.partition(":")
  return name, parse_fields(fields)


def configs_for(h: int, s: int, masked: bool, base: dict, variants: dict[str, dict]) -> dict:
  cfg0 = dataclasses.replace(default_config(head_dim=h, seq_k=s, masked=masked), **base)
  return {"base": cfg0, **{n: dataclasses.replace(cfg0, **v) for n, v in variants.items()}}


def with_grads(fn):
  """(q, k, v, do) -> (out, dq, dk, dv) through jax.vjp."""
  def run(q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))
  return run


def check(case, base: dict, variants: dict[str, dict], grads: bool = False) -> dict:
  """Max |x - ref| / max |ref| of out (and dq, dk, dv with ``grads``) for each config."""
  b, t, s, n, kh, h, kw = case
  q, k, v, extra = _inputs(b, t, s, n, kh, h, kw)
  do = jax.random.normal(jax.random.key(9), q.shape, jnp.bfloat16)
  names = ("out", "dq", "dk", "dv") if grads else ("out",)

  def ref_fn(q, k, v):
    return reference.attention(q, k, v, precision=jax.lax.Precision.HIGHEST, **extra)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  refs = with_grads(ref_fn)(*f32) if grads else (ref_fn(*f32[:3]),)
  row, outs = {"case": str(case)}, {}
  masked = bool(kw.get("causal") or kw.get("window"))
  for name, cfg in configs_for(h, s, masked, base, variants).items():
    try:
      fn = lambda q, k, v, cfg=cfg: flash_attention(q, k, v, implementation="mosaic", config=cfg,
                                                    **extra)
      got = jax.jit(with_grads(fn))(q, k, v, do) if grads else (jax.jit(fn)(q, k, v),)
      outs[name] = [x.astype(jnp.float32) for x in got]
      errs = [float(jnp.max(jnp.abs(x - r)) / jnp.max(jnp.abs(r))) for x, r in zip(outs[name], refs)]
      row[f"{name}_err"] = max(errs)
      if grads:
        row[f"{name}_errs"] = dict(zip(names, errs))
      if name != "base" and "base" in outs:
        row[f"{name}_vs_base"] = max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(r)))
                                     for x, y, r in zip(outs[name], outs["base"], refs))
    except Exception as e:  # pylint: disable=broad-except
      row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:800]}"
  return row


def peers(causal: bool, names=("cudnn", "tokamax")) -> dict:
  fns = {}
  if "cudnn" in names:
    fns["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                               implementation="cudnn")
  if "tokamax" not in names:
    return fns
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
    fns["tokamax"] = lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=causal, implementation="mosaic")
  except ImportError:
    pass
  return fns


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--base", default="", help="Config fields applied to default_config")
  ap.add_argument("--variant", action="append", default=[])
  ap.add_argument("--rows", default="", help="indices into ROWS, e.g. 0,1 (default: all)")
  ap.add_argument("--causal", default="0,1", help="0 = full, 1 = causal")
  ap.add_argument("--budget-s", type=float, default=400.0)
  ap.add_argument("--mode", default="fwd", choices=("fwd", "fwdbwd"))
  ap.add_argument("--peers", default="cudnn,tokamax", help="peers timed in the same process")
  ap.add_argument("--cases", default="", help="indices into the smoke CASES to check (default: "
                  "all; with --mode fwdbwd each case compiles a backward per config)")
  args = ap.parse_args()
  grads = args.mode == "fwdbwd"
  t0 = time.time()
  base = parse_fields(args.base)
  variants = dict(parse_variant(v) for v in args.variant)
  path = os.path.join(args.out, "mosaic_ab.json")
  payload = {"meta": timing.metadata(), "mode": args.mode, "base": base, "variants": variants,
             "correctness": [],
             "rows": []}
  bad = set()
  cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
  for case in cases:
    row = check(case, base, variants, grads)
    for name in ("base", *variants):
      if f"{name}_error" in row or row.get(f"{name}_err", 1.0) > TOL:
        bad.add(name)
    print(row, flush=True)
    payload["correctness"].append(row)
    timing.write_json(path, payload)
  payload["incorrect"] = sorted(bad)
  rows = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
  cache = {}
  for b, t, n, h in rows:
    for causal in (bool(int(c)) for c in args.causal.split(",")):
      if time.time() - t0 > args.budget_s:
        payload["stopped"] = f"budget {args.budget_s} s reached"
        break
      keys = jax.random.split(jax.random.key(0), 3)
      q, k, v = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in keys)
      args_ = (q, k, v, jax.random.normal(jax.random.key(9), q.shape, jnp.bfloat16))[:4 if grads
                                                                                     else 3]
      cfgs = {name: cfg for name, cfg in configs_for(h, t, causal, base, variants).items()
              if name not in bad}
      row = {"shape": [b, t, n, h], "causal": causal}
      fns = {name: (lambda q, k, v, cfg=cfg: flash_attention(
          q, k, v, causal=causal, implementation="mosaic", config=cfg)) for name, cfg in cfgs.items()}
      fns.update(peers(causal, args.peers.split(",")))
      for name, fn in fns.items():
        try:
          row[f"{name}_ms"] = timing.measure(jax.jit(with_grads(fn) if grads else fn), args_,
                                             iterations=10).ms
        except Exception as e:  # pylint: disable=broad-except
          row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:600]}"
      timed = {name: row[f"{name}_ms"] for name in cfgs if f"{name}_ms" in row}
      if timed:
        best = min(timed, key=timed.get)
        row["best"] = best
        for peer in ("cudnn", "tokamax"):
          if f"{peer}_ms" in row:
            row[f"best_vs_{peer}"] = row[f"{peer}_ms"] / timed[best]
        if not grads:
          cache[autotune.problem_key(head_dim=h, seq_k=t, causal=causal, dtype=jnp.bfloat16)] = {
              "config": dataclasses.asdict(cfgs[best]), "ms": timed[best],
              "shape": [b, t, t, n, n, h]}
      print(row, flush=True)
      payload["rows"].append(row)
      timing.write_json(path, payload)
  cache_path = autotune.cache_path()
  if grads:
    payload["cache"] = {}
    timing.write_json(path, payload)
    return
  os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
  with open(cache_path, "w") as f:
    json.dump(cache, f, indent=1, sort_keys=True)
  payload["cache"] = cache
  timing.write_json(path, payload)


if __name__ == "__main__":
  main()

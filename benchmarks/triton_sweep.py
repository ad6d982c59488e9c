"""Tune the Triton FlashAttention-2 Config on a GPU: correctness first, then CUPTI times per config.

One call: `PYTHONPATH=$PWD python3 benchmarks/triton_sweep.py --out $OUT` on the H200. Every
variant is compared with cuDNN (jax.nn.dot_product_attention(implementation="cudnn")) measured in
the same process. Writes triton_sweep.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

import pallas_attn
from pallas_attn.triton import Config, default_config


def cupti_ms(f, *args, iterations=20):
  f(*args)                                    # compile + warm-up
  profiler.measure(f, iterations=2)(*args)    # the first CUPTI session can come back empty
  _, times = profiler.measure(f, iterations=iterations)(*args)
  return statistics.median(times)


def flops(b, t, n, h, causal, mode):
  f = 4 * b * n * t * t * h / (2 if causal else 1)
  return f * (3.5 if mode == "fwdbwd" else 1.0)


def make_fns(impl, causal, cfg):
  if impl == "cudnn":
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation="cudnn")
  else:
    attn = lambda q, k, v: pallas_attn.flash_attention(q, k, v, causal=causal,
                                                       implementation="triton", config=cfg)
  fwd = jax.jit(attn)

  @jax.jit
  def fwdbwd(q, k, v, do):
    out, vjp = jax.vjp(attn, q, k, v)
    return out, vjp(do)
  return fwd, fwdbwd


def check(cfg, b=2, t=1024, n=4, k=2, h=128):
  keys = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  kk = jax.random.normal(keys[1], (b, t, k, h), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, t, k, h), jnp.bfloat16)
  do = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)
  errs = {}
  for causal in (False, True):
    def run(impl, q, kk, v, do):
      f = lambda q, kk, v: pallas_attn.flash_attention(q, kk, v, causal=causal,
                                                       implementation=impl, config=cfg if impl == "triton" else None)
      o, vjp = jax.vjp(f, q, kk, v)
      return (o,) + vjp(do)
    ours = jax.jit(lambda *a: run("triton", *a))(q, kk, v, do)
    ref = jax.jit(lambda *a: run("xla", *a))(*(x.astype(jnp.float32) for x in (q, kk, v, do)))
    errs[f"causal={causal}"] = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - r)) /
                                      float(jnp.max(jnp.abs(r)))) for a, r in zip(ours, ref)]
  return errs


def _fwd(bq, bk, w, st):
  return Config(block_q=bq, block_k=bk, num_warps=w, num_stages=st)


def _bwd(bq1, bk1, bq2, bk2, w, st):
  return dict(block_q_dkv=bq1, block_k_dkv=bk1, block_q_dq=bq2, block_k_dq=bk2,
              bwd_num_warps=w, bwd_num_stages=st)


# Variants per head dim: (block_q, block_k, warps, stages) forward; backward tiles + launch.
FWD = {
    64: [_fwd(128, 64, 4, 3), _fwd(128, 128, 4, 3), _fwd(128, 128, 8, 3), _fwd(64, 64, 4, 3)],
    128: [_fwd(128, 64, 4, 3), _fwd(128, 64, 8, 3), _fwd(128, 128, 8, 3), _fwd(128, 64, 4, 4),
          _fwd(128, 32, 4, 4), _fwd(64, 64, 4, 3), _fwd(128, 128, 8, 2)],
    256: [_fwd(64, 64, 8, 2), _fwd(128, 64, 8, 2), _fwd(64, 32, 4, 2), _fwd(128, 32, 8, 3)],
}
BWD = {
    64: [_bwd(64, 64, 64, 64, 4, 2), _bwd(64, 128, 128, 64, 4, 2), _bwd(128, 128, 128, 128, 8, 2),
         _bwd(64, 64, 64, 64, 4, 3)],
    128: [_bwd(64, 128, 128, 64, 8, 2), _bwd(32, 128, 128, 32, 4, 3), _bwd(64, 64, 64, 64, 4, 2),
          _bwd(64, 128, 128, 64, 8, 1), _bwd(32, 64, 64, 32, 4, 3), _bwd(128, 128, 128, 128, 8, 1),
          _bwd(64, 64, 64, 64, 4, 3), _bwd(64, 64, 64, 64, 8, 2), _bwd(32, 64, 64, 32, 4, 2)],
    256: [_bwd(32, 64, 64, 32, 8, 1), _bwd(32, 32, 32, 32, 4, 2), _bwd(64, 64, 64, 64, 8, 2),
          _bwd(32, 64, 64, 32, 4, 2), _bwd(64, 64, 64, 64, 8, 1), _bwd(32, 32, 32, 32, 4, 1)],
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=".")
  ap.add_argument("--shape", default="4,4096,16,128")
  ap.add_argument("--only", default="", help="comma list of variant names to run (default all)")
  ap.add_argument("--no-check", action="store_true")
  ap.add_argument("--skip-bwd", action="store_true")
  args = ap.parse_args()
  b, t, n, h = map(int, args.shape.split(","))
  res = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, shape=[b, t, n, h],
             date=time.strftime("%Y-%m-%d"), rows=[])
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, t, n, h), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, t, n, h), jnp.bfloat16)
  do = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)

  def record(name, cfg, causal, mode, fn, *a):
    try:
      ms = cupti_ms(fn, *a)
      row = dict(name=name, cfg=None if cfg is None else cfg.__dict__, causal=causal, mode=mode,
                 ms=ms, tflops=flops(b, t, n, h, causal, mode) / ms / 1e9)
    except Exception as e:  # keep sweeping: one bad config must not end the run
      row = dict(name=name, cfg=None if cfg is None else cfg.__dict__, causal=causal, mode=mode,
                 error=f"{type(e).__name__}: {str(e)[:400]}")
    res["rows"].append(row)
    print(json.dumps(row), flush=True)

  if not args.no_check:
    print("check default:", check(None, h=h), flush=True)
  only = set(filter(None, args.only.split(",")))
  fwd_variants = [(f"fwd{i}", c) for i, c in enumerate(FWD[h])]
  # Backward variants keep the head dim's default forward tiles (the class defaults can exceed
  # shared memory at H=256: 128x64 tiles with 3 stages ask for 256 KB).
  base = default_config(head_dim=h, seq_q=t, seq_k=t)
  bwd_variants = [(f"bwd{i}", dataclasses.replace(base, **kw)) for i, kw in enumerate(BWD[h])]
  if only:
    fwd_variants = [x for x in fwd_variants if x[0] in only]
    bwd_variants = [x for x in bwd_variants if x[0] in only]
  for causal in (False, True):
    fwd, fwdbwd = make_fns("cudnn", causal, None)
    record("cudnn", None, causal, "fwd", fwd, q, k, v)
    if not args.skip_bwd:
      record("cudnn", None, causal, "fwdbwd", fwdbwd, q, k, v, do)
    for name, cfg in fwd_variants:
      fwd, _ = make_fns("triton", causal, cfg)
      record(name, cfg, causal, "fwd", fwd, q, k, v)
    if not args.skip_bwd:
      for name, cfg in bwd_variants:
        _, fwdbwd = make_fns("triton", causal, cfg)
        record(name, cfg, causal, "fwdbwd", fwdbwd, q, k, v, do)
  with open(f"{args.out}/triton_sweep_h{h}.json", "w") as f:
    json.dump(res, f, indent=1)
  for r in res["rows"]:
    print(f"{r['name']:6s} causal={r['causal']!s:5s} {r['mode']:6s} "
          + (f"{r['tflops']:7.1f} TFLOP/s" if "tflops" in r else r["error"][:100]))


if __name__ == "__main__":
  sys.exit(main())

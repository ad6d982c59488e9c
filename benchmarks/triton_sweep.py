"""Tune the Triton FlashAttention-2 Config on a GPU: correctness first, then CUPTI times per config.

One call: `PYTHONPATH=$PWD python3 benchmarks/triton_sweep.py --out $OUT` on the H200. Every
variant is compared with cuDNN (jax.nn.dot_product_attention(implementation="cudnn")) measured in
the same process. Writes triton_sweep.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

import pallas_attn
from pallas_attn.triton import Config


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


FWD = [
    Config(block_q=128, block_k=64, num_warps=4, num_stages=3),
    Config(block_q=128, block_k=64, num_warps=8, num_stages=3),
    Config(block_q=128, block_k=128, num_warps=8, num_stages=3),
    Config(block_q=128, block_k=64, num_warps=4, num_stages=4),
    Config(block_q=128, block_k=32, num_warps=4, num_stages=4),
    Config(block_q=64, block_k=64, num_warps=4, num_stages=3),
    Config(block_q=128, block_k=128, num_warps=8, num_stages=2),
]
BWD = [
    dict(block_q_dkv=64, block_k_dkv=128, block_q_dq=128, block_k_dq=64, bwd_num_warps=8, bwd_num_stages=2),
    dict(block_q_dkv=32, block_k_dkv=128, block_q_dq=128, block_k_dq=32, bwd_num_warps=4, bwd_num_stages=3),
    dict(block_q_dkv=64, block_k_dkv=64, block_q_dq=64, block_k_dq=64, bwd_num_warps=4, bwd_num_stages=2),
    dict(block_q_dkv=64, block_k_dkv=128, block_q_dq=128, block_k_dq=64, bwd_num_warps=8, bwd_num_stages=1),
    dict(block_q_dkv=32, block_k_dkv=64, block_q_dq=64, block_k_dq=32, bwd_num_warps=4, bwd_num_stages=3),
    dict(block_q_dkv=128, block_k_dkv=128, block_q_dq=128, block_k_dq=128, bwd_num_warps=8, bwd_num_stages=1),
]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=".")
  ap.add_argument("--shape", default="4,4096,16,128")
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

  print("check default:", check(None), flush=True)
  for causal in (False, True):
    fwd, fwdbwd = make_fns("cudnn", causal, None)
    record("cudnn", None, causal, "fwd", fwd, q, k, v)
    if not args.skip_bwd:
      record("cudnn", None, causal, "fwdbwd", fwdbwd, q, k, v, do)
    for i, cfg in enumerate(FWD):
      fwd, _ = make_fns("triton", causal, cfg)
      record(f"fwd{i}", cfg, causal, "fwd", fwd, q, k, v)
    if not args.skip_bwd:
      for i, kw in enumerate(BWD):
        cfg = Config(**kw)
        _, fwdbwd = make_fns("triton", causal, cfg)
        record(f"bwd{i}", cfg, causal, "fwdbwd", fwdbwd, q, k, v, do)
  with open(f"{args.out}/triton_sweep.json", "w") as f:
    json.dump(res, f, indent=1)
  for r in res["rows"]:
    print(f"{r['name']:6s} causal={r['causal']!s:5s} {r['mode']:6s} "
          + (f"{r['tflops']:7.1f} TFLOP/s" if "tflops" in r else r["error"][:100]))


if __name__ == "__main__":
  sys.exit(main())

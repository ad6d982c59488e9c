"""Sweep the Mosaic GPU attention Configs on the benchmark grid's shapes (one device call).

For each problem: forward kernel time (CUPTI) of every Config in ``FWD_SPACE[head_dim]``, then,
with the fastest forward Config, forward+backward for each backward variant (the Mosaic dQ /
dK/dV kernels at a few tile sizes, and the Triton FA2 backward), with cuDNN measured in the same
process for both. Every measurement is appended to ``OUT/mosaic_tune.json`` as it finishes, so a
run cut by the time budget keeps what it measured. The winners feed ``config.default_config``.

  PYTHONPATH=$PWD python3 benchmarks/mosaic_tune.py --out $OUT [--budget-s 300]
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
from pallas_attn import flash_attention  # noqa: E402
from pallas_attn.mosaic.config import Config  # noqa: E402

# (block_q, block_kv, num_stages) per head dim: register budget of a consumer (232 a thread) is
# about S (block_q * block_kv / 128) + O (block_q * H / 128) fp32 values, so block_q = 128 only
# with small blocks; H = 256 leaves room for one K/V stage pair of 64 keys per 128 KB.
FWD_SPACE = {
    64: [(64, 128, 2), (64, 128, 3), (64, 256, 2), (128, 64, 2), (128, 128, 2), (64, 64, 3)],
    128: [(64, 128, 2), (64, 128, 3), (64, 128, 4), (64, 64, 3), (64, 256, 2), (128, 64, 2)],
    256: [(64, 64, 2), (64, 64, 3)],
}
BWD_VARIANTS = [dict(backward="triton"), dict(bwd_block_q=64, bwd_block_kv=64),
                dict(bwd_block_q=128, bwd_block_kv=64), dict(bwd_block_q=64, bwd_block_kv=128)]
PROBLEMS = [  # (B, T, N, H, causal, with fwd+bwd)
    (4, 4096, 16, 128, False, True), (4, 4096, 16, 128, True, True),
    (16, 1024, 16, 128, False, True), (16, 1024, 16, 128, True, True),
    (1, 16384, 16, 128, False, True), (1, 16384, 16, 128, True, True),
    (4, 4096, 32, 64, False, False), (4, 4096, 32, 64, True, False),
    (4, 4096, 8, 256, False, False), (4, 4096, 8, 256, True, False),
]


def _time(fn, args, iterations=10):
  try:
    tm = timing.measure(jax.jit(fn), args, iterations=iterations)
    return {"ms": tm.ms, "method": tm.method}
  except Exception as e:  # pylint: disable=broad-except  (a Config that does not compile)
    return {"error": f"{type(e).__name__}: {str(e)[:600]}"}


def _grad(fn):
  return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--budget-s", type=float, default=300.0)
  args = ap.parse_args()
  start = time.time()
  path = os.path.join(args.out, "mosaic_tune.json")
  payload = {"meta": timing.metadata(), "rows": []}
  over = lambda: time.time() - start > args.budget_s
  for b, t, n, h, causal, with_bwd in PROBLEMS:
    if over():
      break
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in keys)
    fl = timing.attention_flops(b, n, t, t, h, causal=causal, mode="fwd")
    fl_fb = timing.attention_flops(b, n, t, t, h, causal=causal, mode="fwdbwd")
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation="cudnn")
    row = {"shape": [b, t, n, h], "causal": causal, "fwd": [], "fwdbwd": []}
    payload["rows"].append(row)
    row["cudnn_fwd"] = _time(cudnn, (q, k, v))
    best = None
    for bq, bkv, stages in FWD_SPACE[h]:
      if over():
        break
      cfg = Config(block_q=bq, block_kv=bkv, num_stages=stages)
      res = _time(lambda q, k, v, cfg=cfg: flash_attention(
          q, k, v, causal=causal, implementation="mosaic", config=cfg), (q, k, v))
      res["config"] = dataclasses.asdict(cfg)
      if "ms" in res:
        res["tflops"] = timing.tflops(fl, res["ms"])
        if best is None or res["ms"] < best[0]:
          best = (res["ms"], cfg)
      row["fwd"].append(res)
      print(row["shape"], causal, res, flush=True)
      timing.write_json(path, payload)
    if row["cudnn_fwd"].get("ms") and best:
      row["best_fwd_vs_cudnn"] = row["cudnn_fwd"]["ms"] / best[0]
    print("cudnn fwd", row["cudnn_fwd"], "best ratio", row.get("best_fwd_vs_cudnn"), flush=True)
    if not with_bwd or best is None:
      timing.write_json(path, payload)
      continue
    row["cudnn_fwdbwd"] = _time(_grad(cudnn), (q, k, v))
    for variant in BWD_VARIANTS:
      if over():
        break
      cfg = dataclasses.replace(best[1], **variant)
      res = _time(_grad(lambda q, k, v, cfg=cfg: flash_attention(
          q, k, v, causal=causal, implementation="mosaic", config=cfg)), (q, k, v))
      res["config"] = dataclasses.asdict(cfg)
      if "ms" in res:
        res["tflops"] = timing.tflops(fl_fb, res["ms"])
        if row["cudnn_fwdbwd"].get("ms"):
          res["vs_cudnn"] = row["cudnn_fwdbwd"]["ms"] / res["ms"]
      row["fwdbwd"].append(res)
      print(row["shape"], causal, "fwdbwd", res, flush=True)
      timing.write_json(path, payload)
  timing.write_json(path, payload)


if __name__ == "__main__":
  main()

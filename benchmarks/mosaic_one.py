"""One Mosaic forward config at one shape, compiled, checked and timed: for runs under `timeout`.

A kernel that hangs blocks the whole process, so a sweep in one process (mosaic_ab.py,
attention.py) learns nothing past it. Run each config in its own process under a timeout and
read which ones finish. The result line is printed last and appended to ``--out`` (JSON lines):

  for f in persistent=False persistent=True "persistent=False,block_kv=128"; do
    timeout -k 5 60 python3 benchmarks/mosaic_one.py --shape 4x4096x32x64 --fields "$f" \\
        --out $OUT/one.jsonl || echo "rc=$? $f" | tee -a $OUT/one.log
  done

Phases are printed as they finish (compiled / ran / checked / timed), so a timeout says where it
stopped.
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
from mosaic_ab import parse_fields  # noqa: E402
from pallas_attn import flash_attention, reference  # noqa: E402
from pallas_attn.mosaic import ops as mosaic_ops  # noqa: E402
from pallas_attn.mosaic.config import default_config  # noqa: E402


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shape", required=True, help="BxTxNxH")
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--fields", default="", help="Config fields over default_config, a=1,b=x")
  ap.add_argument("--out", default=None, help="JSON-lines file to append the result to")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--cudnn", action="store_true", help="also time cuDNN's forward, same inputs")
  ap.add_argument("--probe-stall", action="store_true",
                  help="let a persistent config run with 256-key blocks (hangs compiled in "
                       "session 8: use under a timeout)")
  ap.add_argument("--compile-only", action="store_true",
                  help="stop after compiling (with MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=dir "
                       "in the environment: ptxas's register report of a kernel that may hang)")
  args = ap.parse_args()
  if args.probe_stall:
    mosaic_ops.STALLING_BLOCK_KV = ()
  b, t, n, h = (int(x) for x in args.shape.split("x"))
  cfg = dataclasses.replace(default_config(head_dim=h, seq_k=t, masked=args.causal, batch=b),
                            **parse_fields(args.fields))
  result = dict(shape=[b, t, n, h], causal=args.causal, fields=args.fields,
                config=dataclasses.asdict(cfg), probe_stall=args.probe_stall)
  start = time.perf_counter()
  say = lambda what: print(f"[{time.perf_counter() - start:6.1f}s] {what}", flush=True)
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in keys)
  fn = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=args.causal, config=cfg,
                                               implementation="mosaic"))
  compiled = fn.lower(q, k, v).compile()
  say("compiled")
  if args.compile_only:
    return 0
  out = jax.block_until_ready(compiled(q, k, v))
  say("ran")
  sl = (slice(0, 1), slice(None), slice(0, min(n, 2)), slice(None))
  ref = reference.attention(*(x[sl].astype(jnp.float32) for x in (q, k, v)),
                            causal=args.causal, precision=jax.lax.Precision.HIGHEST)
  result["rel_err"] = float(jnp.max(jnp.abs(out[sl].astype(jnp.float32) - ref))
                            / jnp.max(jnp.abs(ref)))
  say(f"checked: rel err {result['rel_err']:.2e}")
  result["ms"] = timing.measure(compiled, (q, k, v), iterations=args.iters).ms
  result["tflops"] = timing.tflops(
      timing.attention_flops(b, n, t, t, h, causal=args.causal, mode="fwd"), result["ms"])
  say(f"timed: {result['ms']:.4f} ms, {result['tflops']:.1f} TFLOP/s")
  if args.cudnn:
    peer = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=args.causal, implementation="cudnn"))
    result["cudnn_ms"] = timing.measure(peer, (q, k, v), iterations=args.iters).ms
    result["speedup_vs_cudnn"] = result["cudnn_ms"] / result["ms"]
    say(f"cudnn: {result['cudnn_ms']:.4f} ms, ours is {result['speedup_vs_cudnn']:.2f}x")
  if args.out:
    with open(args.out, "a") as f:
      f.write(json.dumps(result) + "\n")
  print(json.dumps(result))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

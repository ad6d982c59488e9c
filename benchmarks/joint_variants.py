"""Session 48: where the one-launch backward (`Config.bwd_joint`) loses its time.

Session 48's paired run put the joint launch 1.3-2.5% behind the default's two launches
(fwd+bwd). Variants, each the gradient of the same call (fwd + bwd kernels, CUPTI), timed in
rotating order over several rounds in one process:
  default   the two launches (dQ, then dK/dV)
  end       joint; each dQ consumer waits for all its stores (dQ's too) before it signals
  overlap   joint; it waits for its D record only, signalling while dQ's store flies (default)
  nosync    joint without semaphores: a race kept only to price the synchronisation
Writes ``OUT/joint_variants.json``: per shape and variant the kernels' ms (median of rounds),
bitwise agreement with the default, and each round's numbers.
Usage: python3 benchmarks/joint_variants.py --out DIR [--shapes 4x4096x16x128,...]
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import timing  # noqa: E402
from pallas_attn import flash_attention  # noqa: E402
from pallas_attn.mosaic import backward_joint, default_config  # noqa: E402

VARIANTS = {"default": None, "end": (False, True), "overlap": (True, True),
            "nosync": (True, False)}


def build(shape, name):
  """The jitted gradient of one call in variant ``name``: trace it (``.lower``) before
  building another, as the joint's switches are read at trace time."""
  b, t, _, h = shape
  cfg = dataclasses.replace(default_config(head_dim=h, seq_k=t, batch=b), bwd_persistent=False)
  if VARIANTS[name] is not None:
    cfg = dataclasses.replace(cfg, bwd_joint=True)
    backward_joint._SIGNAL_OVERLAPS_DQ, backward_joint._SYNC = VARIANTS[name]
  return jax.jit(jax.grad(lambda q, k, v: flash_attention(
      q, k, v, implementation="mosaic", config=cfg).astype(jnp.float32).sum(), argnums=(0, 1, 2)))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--shapes", default="4x4096x16x128,2x8192x16x128")
  ap.add_argument("--rounds", type=int, default=4)
  ap.add_argument("--budget-s", type=float, default=200)
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  start, rows = time.time(), []
  for text in args.shapes.split(","):
    shape = tuple(int(x) for x in text.split("x"))
    keys = jax.random.split(jax.random.key(0), 3)
    qkv = [jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys]
    fns = {}
    for name in VARIANTS:
      fns[name] = build(shape, name).lower(*qkv).compile()
    backward_joint._SIGNAL_OVERLAPS_DQ, backward_joint._SYNC = True, True
    ref = jax.block_until_ready(fns["default"](*qkv))
    bitwise = {name: all(np.array_equal(np.asarray(a), np.asarray(c))
                         for a, c in zip(jax.block_until_ready(f(*qkv)), ref))
               for name, f in fns.items()}
    rounds = []
    for r in range(args.rounds):
      names = list(VARIANTS)[r % len(VARIANTS):] + list(VARIANTS)[:r % len(VARIANTS)]
      got = {}
      for name in names:
        t0 = time.time()
        while time.time() - t0 < 1.0:
          jax.block_until_ready(fns[name](*qkv))
        ks = timing.kernel_breakdown(fns[name], qkv, iterations=10)
        got[name] = {"total_ms": sum(k["ms"] for k in ks), "kernels": ks}
      rounds.append(got)
      if time.time() - start > args.budget_s:
        break
    med = {name: statistics.median(g[name]["total_ms"] for g in rounds) for name in VARIANTS}
    print(text, " ".join(f"{n} {med[n]:.4f} ms ({med[n] / med['default']:.3f}, bitwise "
                         f"{bitwise[n]})" for n in VARIANTS), flush=True)
    rows.append({"shape": shape, "median_total_ms": med, "bitwise": bitwise, "rounds": rounds})
    if time.time() - start > args.budget_s:
      break
  timing.write_json(os.path.join(args.out, "joint_variants.json"),
                    {"rows": rows, "meta": timing.metadata()})


if __name__ == "__main__":
  main()

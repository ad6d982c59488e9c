"""First compiled run of the Mosaic GPU (FA3) forward: does it compile, is it right, how fast?

Small correctness cases against the float32 reference (forward and gradients), then forward
and forward+backward kernel time at (4, 4096, 16, 128) bf16 against cuDNN and our Triton backend
in the same process.
Every step is guarded, printed as it finishes and kept in ``OUT/mosaic_smoke.json``:

  PYTHONPATH=$PWD python3 benchmarks/mosaic_smoke.py --out $OUT [--budget-s 110]
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_HERE), _HERE):
  if _p not in sys.path:
    sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import timing  # noqa: E402
from pallas_attn import flash_attention, reference  # noqa: E402

CASES = [  # (B, T, S, N, K, H, kwargs)
    (2, 256, 256, 4, 4, 64, {}),
    (1, 300, 333, 4, 2, 128, dict(causal=True)),
    (2, 200, 260, 4, 1, 128, dict(window=(50, 10), softcap=30.0, segments=True, kv_lengths=True)),
    (1, 256, 512, 2, 2, 256, dict(causal=True)),
]
SPEED = [(4, 4096, 16, 128, False), (4, 4096, 16, 128, True)]


def _inputs(b, t, s, n, kh, h, kw, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, kh, h), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, kh, h), jnp.bfloat16)
  extra = {x: kw[x] for x in ("causal", "window", "softcap") if x in kw}
  if kw.get("segments"):
    extra["q_segment_ids"] = (jnp.arange(t)[None] * 3 // t).repeat(b, 0)
    extra["kv_segment_ids"] = (jnp.arange(s)[None] * 3 // s).repeat(b, 0)
  if kw.get("kv_lengths"):
    extra["kv_lengths"] = jnp.array([s, s // 2][:b], jnp.int32)
  return q, k, v, extra


def check(case) -> dict:
  b, t, s, n, kh, h, kw = case
  q, k, v, extra = _inputs(b, t, s, n, kh, h, kw)
  do = jax.random.normal(jax.random.key(9), q.shape, jnp.bfloat16)

  def loss(impl, q, k, v):
    if impl == "ref":
      out = reference.attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST,
                                **extra)
    else:
      out = flash_attention(q, k, v, implementation=impl, **extra)
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

  res = {}
  for impl in ("ref", "mosaic", "triton"):
    (_, out), grads = jax.jit(jax.value_and_grad(functools.partial(loss, impl), argnums=(0, 1, 2),
                                                 has_aux=True))(q, k, v)
    res[impl] = (out.astype(jnp.float32), [g.astype(jnp.float32) for g in grads])
  err = lambda a, r: float(jnp.max(jnp.abs(a - r)))
  row = {"case": str(case)}
  for impl in ("mosaic", "triton"):
    row[f"{impl}_out_err"] = err(res[impl][0], res["ref"][0])
    for name, g, r in zip(("dq", "dk", "dv"), res[impl][1], res["ref"][1]):
      row[f"{impl}_{name}_err"] = err(g, r)
  return row


def speed(b, t, n, h, causal) -> dict:
  q, k, v, _ = _inputs(b, t, t, n, n, h, {})
  flops = timing.attention_flops(b, n, t, t, h, causal=causal, mode="fwd")
  row = {"shape": f"{b}x{t}x{n}x{h}", "causal": causal}
  impls = {
      "mosaic": lambda q, k, v: flash_attention(q, k, v, causal=causal, implementation="mosaic"),
      "triton": lambda q, k, v: flash_attention(q, k, v, causal=causal, implementation="triton"),
      "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                             implementation="cudnn"),
  }
  flops_fb = timing.attention_flops(b, n, t, t, h, causal=causal, mode="fwdbwd")
  for name, fn in impls.items():
    def fwd_bwd(q, k, v, fn=fn):
      return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                      argnums=(0, 1, 2))(q, k, v)
    for mode, f, fl in (("fwd", fn, flops), ("fwdbwd", fwd_bwd, flops_fb)):
      try:
        tm = timing.measure(jax.jit(f), (q, k, v), iterations=10)
        row[f"{name}_{mode}_ms"] = tm.ms
        row[f"{name}_{mode}_tflops"] = timing.tflops(fl, tm.ms)
        row[f"{name}_{mode}_method"] = tm.method
      except Exception as e:  # pylint: disable=broad-except
        row[f"{name}_{mode}_error"] = f"{type(e).__name__}: {str(e)[:800]}"
      print(row, flush=True)
  return row


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--budget-s", type=float, default=110.0)
  args = ap.parse_args()
  start = time.time()
  payload = {"meta": timing.metadata(), "correctness": [], "speed": []}
  path = os.path.join(args.out, "mosaic_smoke.json")
  for case in CASES:
    if time.time() - start > args.budget_s:
      break
    try:
      row = check(case)
    except Exception as e:  # pylint: disable=broad-except
      row = {"case": str(case), "error": f"{type(e).__name__}: {e}"[:3000],
             "trace": traceback.format_exc()[-3000:]}
    print(row, flush=True)
    payload["correctness"].append(row)
    timing.write_json(path, payload)
  for spec in SPEED:
    if time.time() - start > args.budget_s:
      break
    payload["speed"].append(speed(*spec))
    timing.write_json(path, payload)


if __name__ == "__main__":
  main()

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
from mosaic_ab import parse_variant, peers, with_grads  # noqa: E402
from pallas_attn import flash_attention  # noqa: E402
from pallas_attn.mosaic.config import default_config  # noqa: E402


# Kernel name fragments -> the role shown in the plot (ours, cuDNN, tokamax).
_ROLES = (("flash_attention_fwd", "forward"), ("flash_attention_dkdv", "dK/dV"),
          ("flash_attention_dq", "dQ"), ("flash_attention_delta", "D pre-pass"),
          ("compute_dot_do_o", "D pre-pass"), ("input_reduce_fusion", "D pre-pass"),
          ("convert_dq", "dQ cast"), ("flash_attention_sm90", "forward"),
          ("batched_body", "backward"), ("sdpa", "backward"))
_COLORS = {"forward": "#1f77b4", "D pre-pass": "#ff7f0e", "dK/dV": "#2ca02c", "dQ": "#d62728",
           "backward": "#9467bd", "backward 2": "#c5b0d5", "dQ cast": "#8c564b",
           "other": "#7f7f7f"}


def _segments(kernels: list[dict]) -> list[tuple[str, float]]:
  """(role, ms) per kernel for a stacked bar. The first kernel is the forward. Unnamed Mosaic
  kernels (runs before the kernels were named) are told apart by size: of our two backward
  kernels the dK/dV one (4 matmuls per step) is the longer (the other way round its rate would
  exceed the tensor cores' peak)."""
  roles = []
  for i, kern in enumerate(kernels):
    name = kern["kernel"]
    role = "forward" if i == 0 else next((r for frag, r in _ROLES if frag in name), "other")
    if role == "backward" and "backward" in roles:
      role = "backward 2"
    roles.append("anonymous" if i and name.startswith("anonymous") else role)
  unnamed = sorted((k["ms"], i) for i, k in enumerate(kernels) if roles[i] == "anonymous")
  for rank, (_, i) in enumerate(reversed(unnamed)):
    roles[i] = ("dK/dV", "dQ")[rank] if rank < 2 else "other"
  merged: dict[str, float] = {}
  for role, kern in zip(roles, kernels):
    merged[role] = merged.get(role, 0.0) + kern["ms"]
  order = list(_COLORS)
  return sorted(merged.items(), key=lambda kv: order.index(kv[0]))


def plot(payload: dict, path: str) -> None:
  """Stacked per-kernel bars (ms) of every implementation on every row."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  bars = []
  for row in payload["rows"]:
    tag = "x".join(map(str, row["shape"])) + (" causal" if row["causal"] else " full")
    for name, res in row.items():
      if isinstance(res, dict) and "kernels" in res:
        bars.append((f"{tag}  {name}", _segments(res["kernels"]), res["ms"]))
  fig, ax = plt.subplots(figsize=(10, 0.4 * len(bars) + 1.6))
  seen = set()
  for y, (label, segs, total) in enumerate(bars):
    left = 0.0
    for role, ms in segs:
      ax.barh(y, ms, left=left, color=_COLORS[role], label=None if role in seen else role)
      seen.add(role)
      left += ms
    ax.text(left, y, f" {total:.3f}", va="center", fontsize=8)
  ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel("ms (CUPTI, median per kernel)")
  device = payload.get("meta", {}).get("device_kind", "device unknown")   # the run's own card
  ax.set_title(f"forward + backward, per kernel ({device}, bf16)")
  ax.legend(fontsize=8, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--rows", default="16x1024x16x128,4x4096x16x128", help="BxTxNxH,...")
  ap.add_argument("--causal", default="0,1")
  ap.add_argument("--variant", action="append", default=[])
  ap.add_argument("--peers", default="cudnn,tokamax")
  ap.add_argument("--budget-s", type=float, default=400.0)
  ap.add_argument("--kv-len", type=float, default=0.0,
                  help="key lengths: odd batch rows see this fraction of the keys (kv_lengths; "
                  "cuDNN's key_value_seq_lengths), even rows all; 0: off")
  ap.add_argument("--window", type=int, default=0,
                  help="left window (keys before the diagonal a query also sees) with the causal "
                  "mask, (L, 0); cuDNN's local_window_size=(L, 0); 0: off")
  ap.add_argument("--ours-last", action="store_true",
                  help="time the variants and peers before the default (a first-timed bias check)")
  ap.add_argument("--replot", default="", help="only draw the plot of an existing JSON (CPU)")
  args = ap.parse_args()
  if args.replot:
    with open(args.replot) as f:
      plot(json.load(f), os.path.join(args.out, os.path.basename(args.replot)[:-5] + ".png"))
    return 0
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
      lens = None
      if args.kv_len:
        lens = jnp.array([t if i % 2 == 0 else max(1, round(args.kv_len * t)) for i in range(b)],
                         jnp.int32)
      window = (args.window, 0) if args.window and causal else None
      base = default_config(head_dim=h, seq_k=t, masked=causal, key_masks=lens is not None,
                            windowed=window is not None, batch=b)
      cfgs = {"ours": base,
              **{name: dataclasses.replace(base, **f) for name, f in variants.items()}}
      fns = {name: (lambda q, k, v, cfg=cfg: flash_attention(
          q, k, v, causal=causal, implementation="mosaic", config=cfg, kv_lengths=lens,
          window=window))
             for name, cfg in cfgs.items()}
      if window is not None and "cudnn" in args.peers.split(","):   # tokamax left out
        fns["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=window, implementation="cudnn")
      elif lens is None:
        fns.update(peers(causal, args.peers.split(",")))
      elif "cudnn" in args.peers.split(","):        # tokamax is not given the lengths: left out
        fns["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, key_value_seq_lengths=lens, implementation="cudnn")
      if args.ours_last:
        fns = {**{k: f for k, f in fns.items() if k != "ours"}, "ours": fns["ours"]}
      row = {"shape": [b, t, n, h], "causal": causal, "kv_len": args.kv_len, "window": window,
             "flops": timing.attention_flops(b, n, t, t, h, causal=causal, mode="fwdbwd")}
      outs = {}
      for name, fn in fns.items():
        try:
          run = jax.jit(with_grads(fn))
          kernels = timing.kernel_breakdown(run, (q, k, v, do))
          row[name] = {"kernels": kernels, "ms": sum(x["ms"] for x in kernels)}
          if name in cfgs:      # our variants: out, dq, dk, dv against the default's
            outs[name] = [a.astype(jnp.float32) for a in run(q, k, v, do)]
        except Exception as e:  # pylint: disable=broad-except
          row[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(text, causal, name, row[name].get("ms"), flush=True)
      if "ours" in outs:
        row["max_abs_ours"] = [float(jnp.max(jnp.abs(a))) for a in outs["ours"]]
        for name, got in outs.items():
          if name != "ours":
            row[name]["max_abs_diff_vs_ours"] = [
                float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, outs["ours"])]
      outs.clear()
      if "ms" in row.get("cudnn", {}):
        for name in fns:
          if "ms" in row[name]:
            row[name]["vs_cudnn"] = row["cudnn"]["ms"] / row[name]["ms"]
      payload["rows"].append(row)
      timing.write_json(path, payload)
  if payload["rows"]:
    plot(payload, path[:-5] + ".png")
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

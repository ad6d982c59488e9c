"""Ours against cuDNN with both timed in the same clock state: interleaved, after a pre-heat.

Why (session 39, `power_probe.py`): under the fwd+bwd load the H100 sits at its 700 W cap and
the SM clock falls from 1980 MHz to ~1500-1600 within the first second. A CUPTI burst of 20
calls right after compiling lands somewhere on that slope, so two implementations timed one
after the other see different clocks: at 4x4096x16x128 fwd+bwd the same session read 0.969x
(short bursts), 0.997x (sustained wall clock) and 1.011x (CUPTI right after a sustained run).

Here one jitted function runs ours and then the peer on the same inputs (an optimization
barrier keeps XLA from interleaving their kernels), so every CUPTI iteration holds one call of
each, back to back: both are timed across the same stretch of clock. The pair runs for
``--preheat`` seconds first (the power-capped steady state a training loop lives in; 0 for
the boost-clock state), and each row is timed in both orders (ours first, peer first); the
reported ratio is the peer's kernel time over ours, per order and their mean. The SM clock and
power are sampled during the measurement (pynvml or nvidia-smi; `power_probe.Sampler`).

  python3 benchmarks/paired.py --out $OUT --rows 4x4096x16x128 --causal 0,1 --preheat 2

``--against NAME:FIELD=VALUE,...`` makes the peer our own Mosaic backend with those Config
fields replaced over ``default_config`` for the row (and ours that default, explicitly): a
variant against the default in the same clock state, the way to decide a default. The pair
then launches the same kernel names on both sides, split by their order of launch per name
(``split_kernels``).

  python3 benchmarks/paired.py --out $OUT --rows 8x2048x16x128 --causal 0 --mode fwd \
      --against tail:stream_tail=True
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import timing  # noqa: E402
from mosaic_ab import parse_variant, with_grads  # noqa: E402
from pallas_attn import flash_attention  # noqa: E402
from pallas_attn.mosaic.config import default_config  # noqa: E402
from power_probe import Sampler  # noqa: E402


def implementations(causal: bool, peer: str, *, variant: tuple[str, dict] | None = None,
                    head_dim: int = 0, seq_k: int = 0, batch: int | None = None) -> dict:
  """name -> (q, k, v) -> out for ours (the Mosaic default) and the peer: ``jax.nn``'s
  ``implementation=peer``, or with ``variant`` = (name, Config fields) our Mosaic backend with
  those fields over ``default_config(head_dim, seq_k, causal, batch)`` (ours then that
  default)."""
  if variant is None:
    ours = lambda q, k, v: flash_attention(q, k, v, causal=causal, implementation="mosaic")
    other = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation=peer)
    return {"ours": ours, peer: other}
  name, fields = variant
  base = default_config(head_dim=head_dim, seq_k=seq_k, masked=causal, batch=batch)
  cfgs = {"ours": base, name: dataclasses.replace(base, **fields)}
  return {key: (lambda q, k, v, c=cfg: flash_attention(q, k, v, causal=causal,
                                                       implementation="mosaic", config=c))
          for key, cfg in cfgs.items()}


def _wrap(fn, mode: str):
  """(q, k, v) -> out as (q, k, v, do) -> (out,) or (out, dq, dk, dv)."""
  return with_grads(fn) if mode == "fwdbwd" else (lambda q, k, v, do: (fn(q, k, v),))


def in_order(first, second, mode: str):
  """One function running ``first`` then ``second`` on the same inputs; the barrier makes the
  second's inputs depend on the first's outputs, so XLA cannot interleave their kernels."""
  f1, f2 = _wrap(first, mode), _wrap(second, mode)

  def run(q, k, v, do):
    a = f1(q, k, v, do)
    a, q, k, v, do = jax.lax.optimization_barrier((a, q, k, v, do))
    return a, f2(q, k, v, do)
  return run


MAX_UNASSIGNED = 0.01   # the share of a pair's kernel time that may belong to neither side


def canonical(name: str) -> str:
  """A kernel name without XLA's numeric suffix: XLA numbers its fusions per program
  ("loop_pad_fusion" alone is "loop_pad_fusion_1" in a pair; session 41), so names are matched
  across programs without it."""
  return re.sub(r"[._]\d+$", "", name)


def split_kernels(kernels: list[dict], first_names: list[str],
                  second_names: list[str]) -> tuple[float, float, float]:
  """(first's ms, second's ms, unassigned ms) of a pair's kernel list, by canonical name: a
  kernel whose name only one implementation launches is that one's (XLA may hoist an
  implementation's data-independent kernels, e.g. a causal mask's tile tables, ahead of the
  other's: session 39); of a name both launch (a variant of ours against the default: every
  name), the first ``n`` launches are the first's, where it launches that name ``n`` times alone,
  and the rest the second's. That holds under hoisting, which keeps each name's launches in
  order; two identical kernels that XLA merged into one count once, for the first. Launches
  beyond what the two lists hold together (XLA glue that the pair fuses differently, e.g. a
  scatter fusion the lone programs do not have) are unassigned; the caller decides how much of
  that it tolerates."""
  first_names = [canonical(x) for x in first_names]
  second_names = [canonical(x) for x in second_names]
  n_first = {name: first_names.count(name) for name in set(first_names)}
  allowed = {name: n_first.get(name, 0) + second_names.count(name)
             for name in set(first_names) | set(second_names)}
  seen: dict[str, int] = {}
  first = second = unassigned = 0.0
  for x in kernels:
    name = canonical(x["kernel"])
    seen[name] = seen.get(name, 0) + 1
    if seen[name] > allowed.get(name, 0):
      unassigned += x["ms"]
    elif seen[name] <= n_first.get(name, 0):
      first += x["ms"]
    else:
      second += x["ms"]
  return first, second, unassigned


def timed_pair(first, second, args, *, mode: str, preheat: float, iterations: int,
               sampler: Sampler) -> dict:
  """Kernel ms of ``first`` and ``second`` (medians over ``iterations`` interleaved calls)."""
  names = [[x["kernel"] for x in timing.kernel_breakdown(jax.jit(_wrap(f, mode)), args,
                                                         iterations=2)]
           for f in (first, second)]
  run = jax.jit(in_order(first, second, mode))
  outs = jax.block_until_ready(run(*args))
  # (out[, dq, dk, dv]) of the two sides against each other: a variant's numerics beside its time
  diffs = [float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
           for x, y in zip(*outs)]
  t0 = time.time()
  while time.time() - t0 < preheat:
    for _ in range(4):
      out = run(*args)
    jax.block_until_ready(out)
  with sampler:
    kernels = timing.kernel_breakdown(run, args, iterations=iterations)
  first_ms, second_ms, unassigned_ms = split_kernels(kernels, *names)
  if unassigned_ms > MAX_UNASSIGNED * (first_ms + second_ms):
    raise ValueError(f"{unassigned_ms:.4f} ms of the pair's kernels belong to neither side "
                     f"(over {MAX_UNASSIGNED:.0%}): {[x['kernel'] for x in kernels]}")
  return {"first_ms": first_ms, "second_ms": second_ms, "unassigned_ms": unassigned_ms,
          "kernels": kernels, "max_abs_diff": diffs,
          "first_names": names[0], "second_names": names[1], **sampler.summary(skip_s=0.0)}


def plot(payload: dict, path: str) -> None:
  """Bars of ours / peer per row (one marker per timing order), with the 1.0 line."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  rows = [r for r in payload["rows"] if "ratio" in r]
  labels = ["x".join(map(str, r["shape"])) + (" causal" if r["causal"] else " full")
            for r in rows]
  fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.6))
  ys = range(len(rows))
  ax.barh(ys, [r["ratio"] - 1.0 for r in rows], left=1.0,
          color=["tab:green" if r["ratio"] >= 1.0 else "tab:red" for r in rows])
  for y, r in zip(ys, rows):
    ax.plot(r["ratio_by_order"], [y, y], "k|", markersize=10)
    ax.text(max(*r["ratio_by_order"], 1.0) + 0.002, y, f"{r['ratio']:.3f}x", va="center",
            fontsize=8)
  ax.axvline(1.0, color="k", linewidth=0.8)
  ax.set_yticks(list(ys), labels, fontsize=8)
  ax.invert_yaxis()
  peer = payload.get("peer", "peer")
  ax.set_xlabel(f"{peer} time / our time (> 1: ours faster; ticks: the two timing orders)")
  device = payload.get("meta", {}).get("device_kind", "device unknown")
  ax.set_title(f"{payload.get('mode', '')} interleaved with {peer}, "
               f"{payload.get('preheat_s', 0):g} s pre-heat ({device}, bf16)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--rows", default="4x4096x16x128")
  ap.add_argument("--causal", default="0,1")
  ap.add_argument("--mode", default="fwdbwd", choices=("fwd", "fwdbwd"))
  ap.add_argument("--peer", default="cudnn")
  ap.add_argument("--against", default="",
                  help="NAME:FIELD=VALUE,...: the peer is our Mosaic backend with these Config "
                       "fields over the row's default (ours: that default)")
  ap.add_argument("--preheat", type=float, default=2.0,
                  help="seconds of back-to-back pairs before the measurement (0: none)")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--budget-s", type=float, default=400.0)
  ap.add_argument("--replot", default="", help="only draw the plot of an existing JSON (CPU)")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  if args.replot:
    with open(args.replot) as f:
      plot(json.load(f), os.path.join(args.out, os.path.basename(args.replot)[:-5] + ".png"))
    return 0
  path = os.path.join(args.out, "paired.json")
  variant = parse_variant(args.against) if args.against else None
  peer = variant[0] if variant else args.peer
  payload = {"meta": timing.metadata(), "preheat_s": args.preheat, "mode": args.mode,
             "peer": peer, "variant": variant[1] if variant else None, "rows": []}
  sampler, t_start = Sampler(), time.time()
  for text in args.rows.split(","):
    b, t, n, h = (int(x) for x in text.split("x"))
    for causal in (bool(int(c)) for c in args.causal.split(",")):
      if time.time() - t_start > args.budget_s:
        payload["stopped"] = f"budget {args.budget_s} s reached"
        break
      keys = jax.random.split(jax.random.key(0), 4)
      data = tuple(jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in keys)
      fns = implementations(causal, peer, variant=variant, head_dim=h, seq_k=t, batch=b)
      row = {"shape": [b, t, n, h], "causal": causal,
             "flops": timing.attention_flops(b, n, t, t, h, causal=causal, mode=args.mode)}
      try:
        a = timed_pair(fns["ours"], fns[peer], data, mode=args.mode, preheat=args.preheat,
                       iterations=args.iters, sampler=sampler)
        z = timed_pair(fns[peer], fns["ours"], data, mode=args.mode, preheat=args.preheat,
                       iterations=args.iters, sampler=sampler)
        row["ours_first"], row["peer_first"] = a, z
        ratios = [a["second_ms"] / a["first_ms"], z["first_ms"] / z["second_ms"]]
        row["ours_ms"] = statistics.fmean([a["first_ms"], z["second_ms"]])
        row["peer_ms"] = statistics.fmean([a["second_ms"], z["first_ms"]])
        row["ratio_by_order"], row["ratio"] = ratios, statistics.fmean(ratios)
        print(f"{text} causal={causal}: ours {row['ours_ms']:.4f} ms, {peer} "
              f"{row['peer_ms']:.4f} ms, ours is {row['ratio']:.3f}x (orders "
              f"{ratios[0]:.3f} / {ratios[1]:.3f}; SM clock {a.get('sm_clock_median')} / "
              f"{z.get('sm_clock_median')} MHz)", flush=True)
      except Exception as e:  # pylint: disable=broad-except
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        print(text, causal, row["error"], flush=True)
      payload["rows"].append(row)
      timing.write_json(path, payload)
  if any("ratio" in r for r in payload["rows"]):
    plot(payload, path[:-5] + ".png")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""W4A16 benchmark: our Triton int4 kernel against XLA (bf16 weights; int4 dequant-then-dot).

For M in {1, 16, 64, 256} and weights (K, N) in {(8192, 28672), (28672, 8192), (8192, 8192)},
4-bit asymmetric, groups of 128 (``quant.rtn``), bf16 random-normal activations:

* ``C`` weight copies are rotated inside one jitted call (``C`` matmuls, kernel time divided by
  ``C``) so that the int4 working set exceeds 3x the H200's 60 MB L2 (the bf16 set is 4x that);
* (a) ``xla-bf16``: ``x @ w`` with the dequantized weight stored in bf16;
  (b) ``xla-int4``: ``x @ quant.dequantize(qw)`` under jit (XLA fuses the unpack, no kernel);
  (c) ``ours-triton``: ``quant.matmul.triton.int4_matmul`` on weights prepared once by
  ``quant.matmul.layout.prepare`` (uint8 zero points), for the heuristic config and a small sweep
  around it; the best is kept. Also ``ours_triton_api``: the public ``quant.int4_matmul(x, qw,
  implementation="triton")`` on the plain QuantizedWeight (int32 zeros), heuristic config.
  (d) ``ours-mosaic`` (``--impls`` includes "mosaic"): ``quant.matmul.mosaic.int4_matmul`` (Hopper
  wgmma, one call up to M = 128) on weights prepared once by ``layout.prepare_mosaic``
  (planar layout), the heuristic MosaicConfig and a small sweep; larger M is recorded as not
  served (``ours_mosaic_api`` times the chunked calls).
  Every variant is first checked against the float32 reference ``x @ dequantize(qw)``
  (mean|y - ref| / mean|ref| above ``TOL`` marks it wrong, never timed);
* CUPTI kernel time (median of ``--iters``; wall clock, flagged, when CUPTI is unavailable) of
  everything the call launches (the split-K reduction and act-order gather included).

Work runs in two passes: first the peers and the heuristic config for every row (what the bars
need), then the sweep; no new measurement starts after ``--budget-s`` and the JSON
(``DIR/w4a16.json``) is rewritten after each row, so a killed run keeps what it measured. Outputs: the JSON, ``DIR/w4a16.png`` (speedup
over xla-bf16 by M, one line per shape, the issue's bars dashed) and a table on stdout.

  python3 benchmarks/w4a16.py --out /tmp/w4a16             # the full grid, on the GPU
  python3 benchmarks/w4a16.py --out /tmp/w4a16 --impls mosaic    # only the Mosaic GPU kernel
  python3 benchmarks/w4a16.py --out /tmp/w4a16 --quick     # tiny shapes, on CPU (logic only)
  python3 benchmarks/w4a16.py --plot-only /tmp/w4a16/w4a16.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(_HERE), _HERE):   # repo root (quant) and benchmarks/ (timing)
  if _path not in sys.path:
    sys.path.insert(0, _path)

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position

import quant  # pylint: disable=wrong-import-position
import timing  # pylint: disable=wrong-import-position
from quant.matmul import layout  # pylint: disable=wrong-import-position
from quant.matmul import mosaic as w4_mosaic  # pylint: disable=wrong-import-position
from quant.matmul import triton as w4_triton  # pylint: disable=wrong-import-position
from quant.matmul.config import (Config, MosaicConfig, default_config,  # pylint: disable=wrong-import-position
                                 default_mosaic_config, mosaic_m_pad)

MS = (1, 16, 64, 256)
SHAPES = ((8192, 28672), (28672, 8192), (8192, 8192))
QUICK_MS = (1, 16, 64)
QUICK_SHAPES = ((256, 384), (512, 256))
GROUP = 128
L2_BYTES = 60e6
HBM_TBPS = 4.4                 # practical HBM bandwidth (BENCHMARKS.md)
TOL = 5e-3                     # bf16 output rounding alone gives ~1.3e-3
BARS = {1: 3.7, 16: 3.7, 64: 3.0, 256: 1.2}
IMPLS = ("triton", "mosaic")


def mosaic_sweep_configs(m: int, k: int, n: int, *, quick: bool) -> list[MosaicConfig]:
  """The heuristic MosaicConfig first, then a few neighbours (misfits and duplicates dropped);
  empty when one kernel call does not serve the shape (M > 128)."""
  try:
    base = default_mosaic_config(m=m, k=k, n=n, group_size=GROUP)
  except NotImplementedError:
    return []
  rep = dataclasses.replace
  # Smaller CTAs first (more warpgroups dequantizing per SM: on the H200 6- and 8-deep rings,
  # one CTA per SM, were 25-30% slower than 4-deep ones, two CTAs per SM; fold_zero 1.6-1.8x
  # slower, so it is no longer swept: benchmarks/NOTES.md, session 5).
  # Session 6: ``pipeline`` (one step of wgmmas in flight) was 7-60% slower everywhere, so only
  # one such candidate is kept, last but one; 256-row steps won at 8192 x 8192.
  # Session 9: stream-K (2 and 1 persistent CTAs per SM) first, measured -4..-6% on the 28672
  # shapes in session 8.
  cands = [rep(base, stream_ctas=264), rep(base, stream_ctas=132),
           rep(base, block_k=256), rep(base, num_stages=2), rep(base, num_stages=3),
           rep(base, block_k=256, num_stages=6), rep(base, registers_a=False),
           rep(base, block_n=64, num_stages=4), rep(base, block_n=256, num_stages=2),
           rep(base, split_k=base.split_k * 2), rep(base, split_k=max(1, base.split_k // 2)),
           rep(base, num_stages=2), rep(base, num_stages=4), rep(base, block_k=256),
           rep(base, block_n=64, num_stages=2, split_k=base.split_k * 2),
           rep(base, block_k=256, pipeline=True)]
  out = [base]
  for c in cands[: 2 if quick else None]:
    try:
      c = w4_mosaic.resolve_config(c, m=m, k=k, n=n, group_size=GROUP, asym=True)
    except NotImplementedError:
      continue
    if c.pipeline and not w4_mosaic.pipeline_fits(
        groups_per_step=max(1, c.block_k // GROUP), m_pad=mosaic_m_pad(m)):
      continue                                     # not honoured there: same as without
    if c not in out:
      out.append(c)
  return out


def sweep_configs(m: int, k: int, n: int, *, quick: bool) -> list[Config]:
  """The heuristic config first, then a few neighbours (duplicates and misfits dropped)."""
  base = default_config(m=m, k=k, n=n, group_size=GROUP)
  rep = dataclasses.replace
  if m <= 16:
    cands = [rep(base, split_k=max(1, base.split_k // 2)), rep(base, split_k=base.split_k * 2),
             rep(base, block_n=64, split_k=max(1, base.split_k // 2)),
             rep(base, block_k=128, num_stages=6), rep(base, block_n=256, num_warps=8),
             rep(base, block_k=512, num_stages=3)]
  elif m <= 64:
    cands = [rep(base, block_n=64), rep(base, block_k=256, num_stages=3),
             rep(base, num_warps=8), rep(base, split_k=base.split_k * 2)]
  else:
    cands = [Config(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4),
             Config(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
             Config(block_m=128, block_n=128, block_k=256, num_warps=8, num_stages=2),
             Config(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=3)]
  # The other unpack mode ("strided": eight nibble dots, no in-kernel reshape) next to the
  # heuristic tile.
  other = "strided" if base.unpack == "interleave" else "interleave"
  cands = [rep(base, unpack=other)] + cands
  if m <= 16:
    cands.insert(2, rep(base, unpack=other, split_k=base.split_k * 2))
  out = [base]
  for c in cands[: 2 if quick else None]:
    try:
      c = w4_triton.resolve_config(c, m=m, k=k, n=n, group_size=GROUP)
    except NotImplementedError:
      continue
    if c not in out:
      out.append(c)
  return out


def _rel_err(y, ref) -> float:
  y = y.astype(jnp.float32)
  return float(jnp.mean(jnp.abs(y - ref)) / jnp.mean(jnp.abs(ref)))


def _rotated(fn, copies: int):
  """jit of ``x, ws -> [fn(x, w) for w in ws]``: one call runs ``copies`` matmuls."""
  return jax.jit(lambda x, ws: [fn(x, w) for w in ws])


def _time(fn, x, ws, iters: int) -> timing.Timing:
  t = timing.measure(fn, (x, ws), iterations=iters)
  c = len(ws)
  return timing.Timing(t.ms / c, tuple(v / c for v in t.ms_all), t.method, t.note)


def _make_weights(k: int, n: int, copies: int):
  keys = jax.random.split(jax.random.PRNGKey(k * 7 + n), copies)
  quantize = jax.jit(lambda key: quant.rtn(jax.random.normal(key, (k, n), jnp.float32), bits=4,
                                           group_size=GROUP, sym=False))
  qws = [quantize(key) for key in keys]
  dense = [quant.dequantize(qw, dtype=jnp.bfloat16) for qw in qws]
  return qws, dense


@dataclasses.dataclass
class Problem:
  """One (K, N) weight shape: rotated copies (int4 and bf16) and the float32 reference weight."""
  k: int
  n: int
  copies: int
  qws: list
  pws: list            # the same weights after layout.prepare (uint8 zero points)
  dense: list
  ref_w: jax.Array
  mosaic: dict = dataclasses.field(default_factory=dict)   # block_k -> prepared MosaicWeights

  def mosaic_weights(self, block_k: int) -> list:
    if block_k not in self.mosaic:
      self.mosaic[block_k] = [layout.prepare_mosaic(q, block_k=block_k) for q in self.qws]
    return self.mosaic[block_k]

  @classmethod
  def make(cls, k: int, n: int, *, quick: bool) -> "Problem":
    copies = 1 if quick else max(2, math.ceil(3 * L2_BYTES / (k * n / 2)))
    qws, dense = _make_weights(k, n, copies)
    return cls(k, n, copies, qws, [layout.prepare(q) for q in qws], dense,
               quant.dequantize(qws[0], dtype=jnp.float32))


def _x(m: int, k: int) -> jax.Array:
  return jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32).astype(jnp.bfloat16)


def measure_peers(p: Problem, m: int, *, iters: int) -> dict[str, Any]:
  """Row of one (M, K, N): XLA bf16 and XLA int4 kernel times."""
  row: dict[str, Any] = dict(m=m, k=p.k, n=p.n, group_size=GROUP, copies=p.copies,
                             floor_ms=p.k * p.n / 2 / (HBM_TBPS * 1e12) * 1e3,
                             ours_triton_sweep=[], ours_mosaic_sweep=[])
  x = _x(m, p.k)
  peers = (("xla_bf16", lambda x, w: x @ w, p.dense),
           ("xla_int4", lambda x, qw: x @ quant.dequantize(qw, dtype=x.dtype), p.qws))
  if m >= 64:
    # A candidate large-M path, not a peer: the weight dequantized to bf16 in HBM by one XLA
    # kernel (the barrier keeps XLA from fusing the unpack into the dot's operand loads, which
    # is what makes "xla_int4" slow), then XLA's bf16 GEMM.
    peers += (("xla_dequant_then_dot", lambda x, qw: x @ jax.lax.optimization_barrier(
        quant.dequantize(qw, dtype=x.dtype)), p.qws),)
  for name, fn, ws in peers:
    try:
      t = _time(_rotated(fn, p.copies), x, ws, iters)
      row[name] = dict(ms=t.ms, method=t.method, note=t.note)
    except Exception as e:  # pylint: disable=broad-except
      row[name] = dict(error=f"{type(e).__name__}: {e}"[:2000])
  return row


def _check_and_time(p: Problem, m: int, fn, weights: list, *, iters: int) -> dict[str, Any]:
  """rel_err of ``fn(x, weights[0])`` against the float32 reference, then its kernel time."""
  x = _x(m, p.k)
  entry: dict[str, Any] = {}
  try:
    ref = jnp.matmul(x.astype(jnp.float32), p.ref_w, precision=jax.lax.Precision.HIGHEST)
    entry["rel_err"] = _rel_err(jax.jit(fn)(x, weights[0]), ref)
    if not entry["rel_err"] < TOL:
      entry["error"] = f"wrong: rel_err {entry['rel_err']:.2e} >= {TOL}"
    else:
      t = _time(_rotated(fn, p.copies), x, weights, iters)
      entry.update(ms=t.ms, method=t.method)
  except Exception as e:  # pylint: disable=broad-except
    entry["error"] = f"{type(e).__name__}: {e}"[:2000]
    entry["traceback"] = traceback.format_exc(limit=4)[-2000:]
  return entry


def measure_api(p: Problem, row: dict[str, Any], *, iters: int, interpret: bool) -> None:
  """The public path: ``quant.int4_matmul(x, qw, implementation="triton")`` (int32 zeros)."""
  fn = lambda x, qw: quant.int4_matmul(x, qw, implementation="triton", interpret=interpret)
  row["ours_triton_api"] = _check_and_time(p, row["m"], fn, p.qws, iters=iters)


def measure_mosaic_api(p: Problem, row: dict[str, Any], *, iters: int, interpret: bool) -> None:
  """What ``QuantLinear(mosaic=True)`` runs: ``quant.int4_matmul(x, mw)`` with the weight
  prepared by ``layout.prepare_mosaic`` (default layout) and automatic dispatch; above 128
  rows that is the kernel on equal chunks (``mosaic.chunk_rows``)."""
  fn = lambda x, mw: quant.int4_matmul(x, mw, interpret=interpret)
  block_k = layout.default_block_k(p.k, p.n, GROUP)
  row["ours_mosaic_api"] = _check_and_time(p, row["m"], fn, p.mosaic_weights(block_k),
                                           iters=iters)


def _keep_best(row: dict[str, Any], key: str, *, speedup_prefix: str) -> dict | None:
  """Sets ``row[key]`` to the fastest timed entry of ``row[key + "_sweep"]`` and the speedups
  over the XLA peers (``row[speedup_prefix + "speedup_vs_" + peer]``); returns it (None if none
  ran)."""
  timed = [e for e in row[f"{key}_sweep"] if "ms" in e]
  if not timed:
    return None
  best = min(timed, key=lambda e: e["ms"])
  row[key] = dict(ms=best["ms"], config=best["config"], rel_err=best["rel_err"],
                  method=best["method"])
  for peer in ("xla_bf16", "xla_int4"):
    if "ms" in row.get(peer, {}):
      row[f"{speedup_prefix}speedup_vs_{peer}"] = row[peer]["ms"] / best["ms"]
  return best


def measure_ours(p: Problem, row: dict[str, Any], cfg: Config, *, iters: int,
                 interpret: bool) -> None:
  """Checks ``cfg`` (prepared weights) against the reference, times it, keeps the best."""
  fn = lambda x, pw: w4_triton.int4_matmul(x, pw, config=cfg, interpret=interpret)
  entry = dict(config=dataclasses.asdict(cfg), **_check_and_time(p, row["m"], fn, p.pws,
                                                                  iters=iters))
  row["ours_triton_sweep"].append(entry)
  best = _keep_best(row, "ours_triton", speedup_prefix="")
  if best is not None:
    row["hbm_fraction"] = row["floor_ms"] / best["ms"]


def measure_mosaic(p: Problem, row: dict[str, Any], cfg: MosaicConfig, *, iters: int,
                   interpret: bool) -> None:
  """Checks ``cfg`` (prepared planar weights) against the reference, times it, keeps the best."""
  fn = lambda x, mw: w4_mosaic.int4_matmul(x, mw, config=cfg, interpret=interpret)
  try:
    weights = p.mosaic_weights(cfg.block_k)
  except Exception as e:  # pylint: disable=broad-except
    row["ours_mosaic_sweep"].append(dict(config=dataclasses.asdict(cfg),
                                         error=f"{type(e).__name__}: {e}"[:2000]))
    return
  entry = dict(config=dataclasses.asdict(cfg), **_check_and_time(p, row["m"], fn, weights,
                                                                  iters=iters))
  row["ours_mosaic_sweep"].append(entry)
  _keep_best(row, "ours_mosaic", speedup_prefix="mosaic_")


def table(results: list[dict[str, Any]]) -> str:
  lines = [f"{'M x K x N':>20} {'bf16 ms':>8} {'int4xla':>8} {'ours ms':>8} {'api ms':>8} "
           f"{'vs bf16':>8} {'vs int4':>8} {'%HBM':>5} {'mosaic':>8} {'vs bf16':>8}  "
           f"best config / error"]
  for r in results:
    def ms(name):
      v = r.get(name, {}).get("ms")
      return f"{v:8.4f}" if v is not None else f"{'-':>8}"
    sp = lambda key: f"{r[key]:8.2f}" if key in r else f"{'-':>8}"
    hbm = f"{100 * r['hbm_fraction']:5.0f}" if "hbm_fraction" in r else f"{'-':>5}"
    if "ours_triton" in r:
      c = r["ours_triton"]["config"]
      note = (f"m{c['block_m']} n{c['block_n']} k{c['block_k']} s{c['split_k']} "
              f"w{c['num_warps']} st{c['num_stages']} {c['unpack'][:6]} "
              f"err {r['ours_triton']['rel_err']:.1e}")
    else:
      errs = [e.get("error", "") for e in r.get("ours_triton_sweep", [])]
      note = r.get("error") or (errs[0][:80] if errs else "")
    if "ours_mosaic" in r:
      c = r["ours_mosaic"]["config"]
      note += f" | mosaic n{c['block_n']} k{c['block_k']} s{c['split_k']} st{c['num_stages']}"
      note += " smemA" if not c.get('registers_a', True) else ""
      note += " fold0" if c.get('fold_zero', False) else ""
    elif r.get("ours_mosaic_sweep"):
      note += " | mosaic: " + r["ours_mosaic_sweep"][0].get("error", "")[:60]
    lines.append(f"{r['m']:>5} x {r['k']:>5} x {r['n']:>5} {ms('xla_bf16')} {ms('xla_int4')} "
                 f"{ms('ours_triton')} {ms('ours_triton_api')} {sp('speedup_vs_xla_bf16')} "
                 f"{sp('speedup_vs_xla_int4')} "
                 f"{hbm} {ms('ours_mosaic')} {sp('mosaic_speedup_vs_xla_bf16')}  {note}")
  return "\n".join(lines)


def plot(results: list[dict[str, Any]], meta: dict[str, Any], path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(10, 5))
  shapes = sorted({(r["k"], r["n"]) for r in results})
  for (k, n), color in zip(shapes, ("tab:blue", "tab:orange", "tab:green", "tab:red")):
    rows = [r for r in results if (r["k"], r["n"]) == (k, n)]
    pts = [(r["m"], r["speedup_vs_xla_bf16"]) for r in rows if "speedup_vs_xla_bf16" in r]
    if pts:
      ax.plot(*zip(*pts), "-o", color=color, label=f"ours-triton K={k} N={n}")
    pts = [(r["m"], r["xla_bf16"]["ms"] / r["ours_triton_api"]["ms"]) for r in rows
           if "ms" in r.get("xla_bf16", {}) and "ms" in r.get("ours_triton_api", {})]
    if pts:
      ax.plot(*zip(*pts), "--", color=color, lw=0.9, label=f"ours via quant.int4_matmul K={k} N={n}")
    pts = [(r["m"], r["mosaic_speedup_vs_xla_bf16"]) for r in rows
           if "mosaic_speedup_vs_xla_bf16" in r]
    if pts:
      ax.plot(*zip(*pts), "-s", color=color, alpha=0.7, mfc="none",
              label=f"ours-mosaic K={k} N={n}")
    # The prepared-weight path of QuantLinear(mosaic=True): large M in equal chunks.
    pts = [(r["m"], r["xla_bf16"]["ms"] / r["ours_mosaic_api"]["ms"]) for r in rows
           if "ms" in r.get("xla_bf16", {}) and "ms" in (r.get("ours_mosaic_api") or {})]
    if pts:
      ax.plot(*zip(*pts), "-.", color=color, lw=1.2,
              label=f"ours via QuantLinear(mosaic=True) K={k} N={n}")
    pts = [(r["m"], r["xla_bf16"]["ms"] / r["xla_int4"]["ms"]) for r in rows
           if "ms" in r.get("xla_bf16", {}) and "ms" in r.get("xla_int4", {})]
    if pts:
      ax.plot(*zip(*pts), ":x", color=color, alpha=0.6, label=f"xla-int4 K={k} N={n}")
  bars = sorted(BARS.items())
  ax.step([m for m, _ in bars], [b for _, b in bars], "--", where="mid", color="gray",
          label="issue bar")
  ax.axhline(1.0, color="black", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("M (rows of x)")
  ax.set_ylabel("speedup over XLA bf16-weight matmul")
  methods = {r.get("ours_triton", {}).get("method") for r in results} - {None}
  how = "CUPTI kernel time" if methods == {"cupti"} else f"time: {'/'.join(sorted(methods))}"
  ax.set_title(f"W4A16 g{GROUP} asym, {meta.get('device_kind', '?')}, {how}")
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=os.path.join(_HERE, "results", "w4a16"),
                      help="output folder (w4a16.json, w4a16.png)")
  parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU logic check)")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--budget-s", type=float, default=240.0,
                      help="no new measurement starts after this many seconds")
  parser.add_argument("--ms", default="",
                      help=f"comma-separated M values to run (default: {','.join(map(str, MS))})")
  parser.add_argument("--plot-only", metavar="JSON", default=None)
  parser.add_argument("--impls", default=",".join(IMPLS),
                      help=f"comma-separated kernels of ours to run, from {IMPLS}")
  args = parser.parse_args(argv)
  impls = tuple(i for i in args.impls.split(",") if i)
  if not impls or set(impls) - set(IMPLS):
    parser.error(f"--impls must be a comma-separated subset of {IMPLS}, got {args.impls!r}")

  if args.plot_only:
    with open(args.plot_only) as f:
      payload = json.load(f)
    out = os.path.dirname(os.path.abspath(args.plot_only))
    plot(payload["results"], payload["meta"], os.path.join(out, "w4a16.png"))
    print(table(payload["results"]))
    return 0

  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.quick:
    print("no GPU found: run with --quick for a CPU logic check", file=sys.stderr)
    return 2
  start = time.time()
  meta = timing.metadata()
  meta.update(group_size=GROUP, iters=args.iters, quick=args.quick, partial=True,
              l2_bytes=L2_BYTES, hbm_tbps=HBM_TBPS, impls=list(impls))
  results: list[dict[str, Any]] = []
  path = os.path.join(args.out, "w4a16.json")

  def emit(row):
    results.append(row)
    timing.write_json(path, dict(meta=meta, results=results))
    print(table([row]).splitlines()[-1], flush=True)

  shapes, ms = (QUICK_SHAPES, QUICK_MS) if args.quick else (SHAPES, MS)
  if args.ms:
    ms = tuple(int(m) for m in args.ms.split(","))
  iters = 3 if args.quick else args.iters
  interpret = not on_gpu
  deadline = start + args.budget_s
  # Pass 1 (what the bars need): peers and the heuristic config for every row.
  problems, rows = {}, []
  for k, n in shapes:
    try:
      problems[k, n] = p = Problem.make(k, n, quick=args.quick)
    except Exception as e:  # pylint: disable=broad-except
      results.append(dict(m=0, k=k, n=n, error=f"{type(e).__name__}: {e}"[:2000]))
      continue
    for m in ms:
      row = measure_peers(p, m, iters=iters)
      configs = sweep_configs(m, k, n, quick=args.quick) if "triton" in impls else []
      mconfigs = mosaic_sweep_configs(m, k, n, quick=args.quick) if "mosaic" in impls else []
      if "mosaic" in impls and not mconfigs:
        row["ours_mosaic_sweep"].append(dict(
            error=f"not served by one call: M={m} (> 128 rows, or 512-row steps above 72; "
                  f"ours_mosaic_api times the chunked calls)"))
      if time.time() < deadline:
        if configs:
          measure_ours(p, row, configs[0], iters=iters, interpret=interpret)
        if mconfigs:
          measure_mosaic(p, row, mconfigs[0], iters=iters, interpret=interpret)
      else:
        row["error"] = "time budget spent"
      sweep = ([(measure_ours, c) for c in configs[1:]] +
               [(measure_mosaic, c) for c in mconfigs[1:]])
      rows.append((p, row, sweep))
      emit(row)
  # Pass 2: the public path (QuantizedWeight, int32 zeros, heuristic config) for every row, then
  # the sweep around the heuristic, round-robin over the rows while the budget lasts.
  for p, row, _ in rows:
    if time.time() < deadline and "triton" in impls:
      measure_api(p, row, iters=iters, interpret=interpret)
    if time.time() < deadline and "mosaic" in impls and not interpret:
      measure_mosaic_api(p, row, iters=iters, interpret=interpret)
  for i in range(max((len(c) for _, _, c in rows), default=0)):
    for p, row, configs in rows:
      if i >= len(configs):
        continue
      if time.time() > deadline:
        row["note"] = "sweep cut short by the time budget"
        continue
      measure, cfg = configs[i]
      measure(p, row, cfg, iters=iters, interpret=interpret)
      timing.write_json(path, dict(meta=meta, results=results))
  print("after the sweep:")
  meta.update(partial=False, elapsed_s=time.time() - start)
  timing.write_json(path, dict(meta=meta, results=results))
  try:
    plot(results, meta, os.path.join(args.out, "w4a16.png"))
  except Exception as e:  # pylint: disable=broad-except
    print(f"plot failed: {type(e).__name__}: {e}", file=sys.stderr)
  print(table(results))
  print(f"wrote {path} in {time.time() - start:.0f}s")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Attention benchmark: our backends against cuDNN, XLA and tokamax in one run, on the FA3 grid.

For each row (B, T, N, H) of the FlashAttention-3-paper grid of ../shared/BENCHMARKS.md (16k
tokens per batch, hidden 2048; T = 2048 and 8192 added so head dim 128 has five sequence
lengths), causal and full masks, each implementation and mode (forward, forward+backward):

* bf16 random-normal q, k, v (and a random cotangent for the backward), jit-compiled;
* a correctness check against a float32 XLA reference (highest matmul precision) on batch 0 and
  the first few heads (heads are independent, so a slice of the full output is checked exactly):
  forward output, and for fwd+bwd also dq, dk, dv; an error above TOL_FWD (TOL_GRAD for
  gradients) times max|ref| marks the result "wrong" and its timing invalid;
* CUPTI kernel time (median of ``--iters``; wall clock, flagged, where CUPTI is unavailable) and
  TFLOP/s: forward 4·B·N·T·S·H, halved when causal; forward+backward 3.5x that.

Every (row, mask, implementation, mode) runs in its own try/except: errors are recorded and the
run goes on. Work is ordered by importance and stops at ``--budget-s`` so that one device call
(10 minutes) always ends with results. Outputs: ``DIR/attention.json`` (rewritten after every
measurement), ``DIR/attention.png``, and a table on stdout.

  python3 benchmarks/attention.py --out /tmp/attn                      # the full grid, on the GPU
  python3 benchmarks/attention.py --out /tmp/attn --quick --impls xla  # tiny shapes, on CPU
  python3 benchmarks/attention.py --plot-only /tmp/attn/attention.json  # remake the plot and table
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(_HERE), _HERE):  # repo root (pallas_attn) and benchmarks/ (timing)
  if _path not in sys.path:
    sys.path.insert(0, _path)

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

import timing  # pylint: disable=wrong-import-position

Row = tuple[int, int, int, int]  # B, T, N, H (S = T, K = N)

IMPLS = ("ours-triton", "ours-mosaic", "cudnn", "xla", "tokamax-mosaic", "tokamax-triton")
MODES = ("fwd", "fwdbwd")
TOL_FWD = 2e-2    # max|out - ref| / max|ref| above this: wrong
TOL_GRAD = 5e-2   # same for dq, dk, dv
REF_HEADS = 4     # heads of batch 0 checked against the float32 reference

# (row, modes) in the order they run: what the issue bars need first, the rest while time lasts.
GRID_PLAN: tuple[tuple[Row, tuple[str, ...]], ...] = (
    ((4, 4096, 16, 128), MODES),
    ((1, 16384, 16, 128), MODES),
    ((16, 1024, 16, 128), MODES),
    ((4, 4096, 32, 64), ("fwd",)),
    ((4, 4096, 8, 256), ("fwd",)),
    ((8, 2048, 16, 128), MODES),
    ((2, 8192, 16, 128), MODES),
    ((4, 4096, 32, 64), ("fwdbwd",)),
    ((4, 4096, 8, 256), ("fwdbwd",)),
)
QUICK_PLAN: tuple[tuple[Row, tuple[str, ...]], ...] = (
    ((2, 128, 2, 128), MODES),
    ((1, 256, 2, 128), MODES),
    ((2, 128, 4, 64), MODES),
    ((2, 128, 1, 256), MODES),
)

COLORS = {"ours-triton": "tab:blue", "ours-mosaic": "tab:red", "cudnn": "black", "xla": "gray",
          "tokamax-mosaic": "tab:orange", "tokamax-triton": "tab:green"}


class Unavailable(Exception):
  """An implementation that cannot be imported here; later rows skip it."""


# ---------------------------------------------------------------------------------------------
# Implementations: each maps (q, k, v) [B, T, N, H] bf16 -> out [B, T, N, H].

def attention_fn(impl: str, causal: bool) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
  """The attention function of one implementation, with the mask fixed."""
  if impl.startswith("ours-"):
    try:
      from pallas_attn import flash_attention  # pylint: disable=import-outside-toplevel
      importlib.import_module(f"pallas_attn.{impl.removeprefix('ours-')}")
    except ImportError as e:
      raise Unavailable(f"{type(e).__name__}: {e}") from e
    backend = impl.removeprefix("ours-")
    return lambda q, k, v: flash_attention(q, k, v, causal=causal, implementation=backend)
  if impl in ("cudnn", "xla"):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation=impl)
  if impl.startswith("tokamax-"):
    try:
      import tokamax  # pylint: disable=import-outside-toplevel
    except ImportError as e:
      raise Unavailable(f"{type(e).__name__}: {e}") from e
    backend = impl.removeprefix("tokamax-")
    return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation=backend)
  raise ValueError(f"unknown implementation {impl!r}; known: {IMPLS}")


def fwdbwd_fn(fn: Callable[..., jax.Array]) -> Callable[..., tuple[jax.Array, ...]]:
  """(q, k, v, do) -> (out, dq, dk, dv): forward and the full backward through jax.vjp."""
  def run(q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))
  return run


# ---------------------------------------------------------------------------------------------
# Inputs and the float32 reference.

@dataclasses.dataclass
class Case:
  """Inputs of one (row, mask) and the reference on batch 0, heads [:REF_HEADS], lazily."""
  row: Row
  causal: bool
  q: jax.Array
  k: jax.Array
  v: jax.Array
  do: jax.Array
  ref_heads: int
  _ref: dict[str, Any] | None = None

  def reference(self, with_grads: bool) -> dict[str, np.ndarray]:
    """Float32, highest-precision XLA attention (and its vjp) on the checked slice."""
    if self._ref is None or (with_grads and "dq" not in self._ref):
      sl = (slice(0, 1), slice(None), slice(0, self.ref_heads), slice(None))
      q, k, v, do = (x[sl].astype(jnp.float32) for x in (self.q, self.k, self.v, self.do))
      fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=self.causal,
                                                        implementation="xla")
      with jax.default_matmul_precision("highest"):
        if with_grads:
          out, dq, dk, dv = jax.jit(fwdbwd_fn(fn))(q, k, v, do)
          self._ref = {"out": out, "dq": dq, "dk": dk, "dv": dv}
        else:
          self._ref = {"out": jax.jit(fn)(q, k, v)}
      self._ref = {name: np.asarray(x) for name, x in self._ref.items()}
    return self._ref


def make_case(row: Row, causal: bool, seed: int) -> Case:
  """Random-normal bf16 inputs for one row; never zeros."""
  b, t, n, h = row
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k, v, do = (jax.random.normal(key, (b, t, n, h), jnp.bfloat16) for key in keys)
  return Case(row, causal, q, k, v, do, ref_heads=min(n, REF_HEADS))


def relative_errors(outputs: Sequence[jax.Array], ref: dict[str, np.ndarray],
                    ref_heads: int) -> dict[str, float]:
  """max|x - ref| / max|ref| on the checked slice, for out (and dq, dk, dv when given)."""
  errors = {}
  for name, x in zip(("out", "dq", "dk", "dv"), outputs):
    got = np.asarray(x[:1, :, :ref_heads].astype(jnp.float32))
    want = ref[name]
    scale = float(np.max(np.abs(want))) or 1.0
    err = float(np.max(np.abs(got - want))) if np.all(np.isfinite(got)) else math.inf
    errors[name] = err / scale
  return errors


# ---------------------------------------------------------------------------------------------
# One measurement.

def run_one(case: Case, impl: str, mode: str, iterations: int) -> dict[str, Any]:
  """Compiles, checks and times one (case, impl, mode); returns the fields of its record."""
  fn = attention_fn(impl, case.causal)
  if mode == "fwd":
    jitted, args = jax.jit(fn), (case.q, case.k, case.v)
  else:
    jitted, args = jax.jit(fwdbwd_fn(fn)), (case.q, case.k, case.v, case.do)
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  compile_s = time.perf_counter() - start
  outputs = compiled(*args)
  outputs = outputs if isinstance(outputs, tuple) else (outputs,)
  jax.block_until_ready(outputs)
  errors = relative_errors(outputs, case.reference(mode == "fwdbwd"), case.ref_heads)
  del outputs
  wrong = [f"{name} rel err {err:.3g} > {TOL_FWD if name == 'out' else TOL_GRAD}"
           for name, err in errors.items() if not err <= (TOL_FWD if name == "out" else TOL_GRAD)]
  t = timing.measure(compiled, args, iterations)
  b, s, n, h = case.row
  flops = timing.attention_flops(b, n, s, s, h, causal=case.causal, mode=mode)
  return {
      "status": "wrong" if wrong else "ok",
      "valid": not wrong,
      "error": "; ".join(wrong),
      "ms": t.ms,
      "ms_all": list(t.ms_all),
      "method": t.method,
      "method_note": t.note,
      "tflops": timing.tflops(flops, t.ms),
      "flops": flops,
      "rel_err": errors,
      "compile_s": compile_s,
      "iterations": iterations,
  }


# ---------------------------------------------------------------------------------------------
# Tables and the plot.

def _row_label(row: Sequence[int]) -> str:
  return ", ".join(str(x) for x in row)


def _index(results: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
  return {(tuple(r["row"]), r["causal"], r["mode"], r["impl"]): r for r in results}


def _tflops(record: dict[str, Any] | None) -> float | None:
  if record is None or record.get("tflops") is None or not record.get("valid", False):
    return None
  return record["tflops"]


def format_tables(results: list[dict[str, Any]], impls: Sequence[str]) -> str:
  """Markdown tables: TFLOP/s per implementation, then ratios to cuDNN and to tokamax-triton."""
  index = _index(results)
  keys = []
  for r in results:
    key = (tuple(r["row"]), r["causal"], r["mode"])
    if key not in keys:
      keys.append(key)
  keys.sort(key=lambda k: (MODES.index(k[2]), k[0][3] != 128, k[0][3], k[0][1], k[1]))
  lines = []

  def cell(record: dict[str, Any] | None) -> str:
    if record is None:
      return ""
    if record["status"] == "error":
      return "error"
    if record["status"] == "skipped":
      error = record.get("error", "")
      return "budget" if "budget" in error else "n/a" if "unavailable" in error else "skip"
    value = record["tflops"]
    text = f"{value:.0f}" if value >= 10 else f"{value:.2g}"
    if record["status"] == "wrong":
      text += " WRONG"
    if record.get("method") != "cupti":
      text += " (wall)"
    return text

  header = "| B, T, N, H | mask | mode | " + " | ".join(impls) + " |"
  rule = "|" + "---|" * (3 + len(impls))
  lines += ["TFLOP/s (CUPTI kernel time; 'wall' = wall-clock fallback; 'budget' = not reached in "
            "the time budget; 'n/a' = implementation unavailable; 'skip' = skipped by option)",
            header, rule]
  for row, causal, mode in keys:
    cells = [cell(index.get((row, causal, mode, impl))) for impl in impls]
    lines.append(f"| {_row_label(row)} | {'causal' if causal else 'full'} | {mode} | "
                 + " | ".join(cells) + " |")
  for peer in ("cudnn", "tokamax-triton"):
    if peer not in impls:
      continue
    others = [impl for impl in impls if impl != peer]
    lines += ["", f"ratio to {peer} (same run)",
              "| B, T, N, H | mask | mode | " + " | ".join(others) + " |",
              "|" + "---|" * (3 + len(others))]
    for row, causal, mode in keys:
      base = _tflops(index.get((row, causal, mode, peer)))
      cells = []
      for impl in others:
        value = _tflops(index.get((row, causal, mode, impl)))
        cells.append(f"{value / base:.2f}" if value is not None and base else "")
      lines.append(f"| {_row_label(row)} | {'causal' if causal else 'full'} | {mode} | "
                   + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(results: list[dict[str, Any]], meta: dict[str, Any], path: str) -> None:
  """TFLOP/s vs sequence length for H = 128 (fwd / fwd+bwd x full / causal), bars for H 64, 256."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  index = _index(results)
  measured = {r["impl"] for r in results if _tflops(r) is not None}
  impls = [impl for impl in IMPLS if impl in measured] + sorted(measured - set(IMPLS))
  fig = plt.figure(figsize=(13, 12), constrained_layout=True)
  grid = fig.add_gridspec(3, 2)
  for i, mode in enumerate(MODES):
    for j, causal in enumerate((False, True)):
      ax = fig.add_subplot(grid[i, j])
      rows = sorted({tuple(r["row"]) for r in results if r["row"][3] == 128}, key=lambda x: x[1])
      for impl in impls:
        points = [(row[1], _tflops(index.get((row, causal, mode, impl)))) for row in rows]
        points = [(t, y) for t, y in points if y is not None]
        if points:
          ours = impl.startswith("ours-")
          ax.plot(*zip(*points), marker="o", label=impl, color=COLORS.get(impl),
                  linewidth=2.5 if ours else 1.5, linestyle="-" if ours else "--")
      ax.set_xscale("log", base=2)
      if rows:
        ax.set_xticks([row[1] for row in rows], [str(row[1]) for row in rows])
      ax.set_xlabel("sequence length T = S (B·T = 16k, N·H = 2048 on the full grid)")
      ax.set_ylabel("TFLOP/s")
      ax.set_ylim(bottom=0)
      ax.grid(True, alpha=0.3)
      ax.set_title(f"head dim 128, {'fwd+bwd' if mode == 'fwdbwd' else 'forward'}, "
                   f"{'causal' if causal else 'full'}")
      if i == 0 and j == 0 and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
  ax = fig.add_subplot(grid[2, :])
  groups = []
  for r in results:
    key = (tuple(r["row"]), r["causal"], r["mode"])
    if r["row"][3] != 128 and key not in groups:
      groups.append(key)
  groups.sort(key=lambda k: (k[0][3], MODES.index(k[2]), k[1]))
  width = 0.8 / max(1, len(impls))
  for n, impl in enumerate(impls):
    values = [_tflops(index.get((*g, impl))) for g in groups]
    xs = [g + (n - (len(impls) - 1) / 2) * width for g in range(len(groups))]
    ax.bar(xs, [v or 0 for v in values], width, label=impl, color=COLORS.get(impl))
  ax.set_xticks(range(len(groups)),
                [f"{_row_label(row)}\n{'causal' if c else 'full'} "
                 f"{'fwd+bwd' if m == 'fwdbwd' else 'fwd'}" for row, c, m in groups], fontsize=8)
  ax.set_ylabel("TFLOP/s")
  ax.set_title("head dims 64 and 256 (B, T, N, H)")
  ax.grid(True, axis="y", alpha=0.3)
  if groups:
    ax.legend(fontsize=8, ncols=len(impls))
  method = "CUPTI kernel time" if all(r.get("method") in (None, "cupti") for r in results) \
      else "some points wall-clock (no CUPTI)"
  fig.suptitle(f"Attention, bf16, {meta.get('device_kind', '?')}, jax {meta.get('jax', '?')}, "
               f"{meta.get('date_utc', '')[:10]} ({method}; wrong results omitted)")
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The run.

def parse_rows(text: str) -> list[Row]:
  """'4x4096x16x128,1x16384x16x128' -> [(4, 4096, 16, 128), (1, 16384, 16, 128)]."""
  rows = []
  for item in text.split(","):
    parts = item.strip().lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
      raise argparse.ArgumentTypeError(f"row {item!r} is not BxTxNxH")
    rows.append(tuple(int(p) for p in parts))
  return rows


def build_plan(args: argparse.Namespace) -> list[tuple[Row, tuple[str, ...]]]:
  """(row, modes) work items in run order, filtered by --rows and --modes."""
  plan = list(QUICK_PLAN if args.quick else GRID_PLAN)
  if args.rows:
    wanted = parse_rows(args.rows)
    plan = [item for item in plan if item[0] in wanted]
    plan += [(row, MODES) for row in wanted if all(item[0] != row for item in plan)]
  plan = [(row, tuple(m for m in modes if m in args.modes)) for row, modes in plan]
  return [(row, modes) for row, modes in plan if modes]


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=None,
                      help="output folder for attention.json and attention.png (default "
                           "benchmarks/results/attention; with --plot-only, the JSON's folder)")
  parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma list from {IMPLS}")
  parser.add_argument("--rows", default="", help="comma list of BxTxNxH (default: the grid)")
  parser.add_argument("--modes", default=",".join(MODES), help="fwd,fwdbwd")
  parser.add_argument("--rounds", type=int, default=1,
                      help="measure every implementation this many times in turn, keep the "
                           "fastest (removes the first-in-row penalty)")
  parser.add_argument("--quick", action="store_true", help="tiny shapes, few iterations")
  parser.add_argument("--iters", type=int, default=None, help="CUPTI iterations (20; quick 3)")
  parser.add_argument("--budget-s", type=float, default=400.0,
                      help="stop starting new measurements after this many seconds")
  parser.add_argument("--xla-max-seq", type=int, default=8192,
                      help="skip XLA above this sequence length (quadratic memory, slow)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--allow-cpu", action="store_true",
                      help="run the full-size grid even when jax found no GPU (else it stops)")
  parser.add_argument("--plot-only", metavar="JSON", default=None,
                      help="remake table and plot from a saved attention.json, run nothing")
  args = parser.parse_args(argv)

  if args.plot_only:
    import json  # pylint: disable=import-outside-toplevel
    with open(args.plot_only) as f:
      payload = json.load(f)
    impls = [i for i in IMPLS if any(r["impl"] == i for r in payload["results"])]
    print(format_tables(payload["results"], impls))
    out_dir = args.out or os.path.dirname(os.path.abspath(args.plot_only))
    os.makedirs(out_dir, exist_ok=True)
    out_png = os.path.join(out_dir, "attention.png")
    plot(payload["results"], payload["meta"], out_png)
    print(f"wrote {out_png}")
    return 0

  impls = [i.strip() for i in args.impls.split(",") if i.strip()]
  unknown = [i for i in impls if i not in IMPLS]
  if unknown:
    parser.error(f"unknown --impls {unknown}; known: {IMPLS}")
  args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  if any(m not in MODES for m in args.modes):
    parser.error(f"--modes must be from {MODES}")
  iterations = args.iters or (3 if args.quick else 20)
  plan = build_plan(args)
  args.out = args.out or "benchmarks/results/attention"
  out_json = os.path.join(args.out, "attention.json")
  out_png = os.path.join(args.out, "attention.png")

  meta = timing.metadata()
  if meta["platform"] != "gpu" and not (args.quick or args.allow_cpu):
    print(f"attention.py: jax runs on {meta['platform']!r}, not a GPU: stopping before the "
          "full-size grid (use --quick or --allow-cpu)", flush=True)
    return 2
  meta.update(tokamax=timing.package_version("tokamax"), argv=sys.argv[1:],
              iterations=iterations, tol_fwd=TOL_FWD, tol_grad=TOL_GRAD, ref_heads=REF_HEADS,
              cupti=timing.prime_cupti() or "ok")
  print(f"attention benchmark on {meta['device_kind']} ({meta['platform']}), jax {meta['jax']}, "
        f"tokamax {meta['tokamax']}, CUPTI: {meta['cupti']}", flush=True)
  results: list[dict[str, Any]] = []
  unavailable: dict[str, str] = {}
  start = time.monotonic()

  def save(partial: bool) -> None:
    timing.write_json(out_json, {"meta": {**meta, "partial": partial,
                                          "elapsed_s": time.monotonic() - start},
                                 "results": results})

  for row, modes in plan:
    for causal in (False, True):
      case = None
      best: dict[tuple[str, str], dict[str, Any]] = {}
      for rnd, impl, mode in ((r, i, m) for r in range(args.rounds) for i in impls
                              for m in modes):
        record: dict[str, Any] = {"row": list(row), "causal": causal, "impl": impl,
                                  "mode": mode, "status": "skipped", "valid": False,
                                  "tflops": None, "error": ""}
        elapsed = time.monotonic() - start
        if elapsed > args.budget_s:
          record["error"] = f"time budget {args.budget_s:.0f}s spent"
        elif impl in unavailable:
          record["error"] = f"unavailable: {unavailable[impl]}"
        elif impl == "xla" and row[1] > args.xla_max_seq:
          record["error"] = f"XLA skipped above T={args.xla_max_seq} (--xla-max-seq)"
        else:
          try:
            if case is None:
              case = make_case(row, causal, args.seed)
            record.update(run_one(case, impl, mode,
                                  iterations if impl != "xla" else max(3, iterations // 4)))
          except Unavailable as e:
            unavailable[impl] = str(e)
            record.update(status="error", error=f"unavailable: {e}")
          except Exception as e:  # pylint: disable=broad-except
            tb = traceback.format_exc(limit=-3)
            record.update(status="error", error=f"{type(e).__name__}: {e}"[:2000],
                          traceback=tb[-3000:])
        record["round"] = rnd
        # --rounds: every implementation is measured once per round, in turn, and the table
        # keeps its fastest round (a failed or wrong round is kept instead: never hidden).
        # The first measurement of a row ran ~5% slow in session 14 (whichever config it was),
        # and "ours" is always first: one round charged it that.
        prev = best.get((impl, mode))
        round_ms = (prev or {}).get("round_ms", []) + [record.get("ms")]
        if (prev is None or record["status"] != "ok"
            or (prev["status"] == "ok" and record["ms"] < prev["ms"])):
          best[(impl, mode)] = record
        best[(impl, mode)]["round_ms"] = round_ms
        tag = f"[{time.monotonic() - start:6.1f}s] {'x'.join(map(str, row))} " \
              f"{'causal' if causal else 'full  '} {impl:14s} {mode:6s}" \
              + (f" r{rnd}" if args.rounds > 1 else "")
        if record["status"] in ("ok", "wrong"):
          errs = " ".join(f"{k} {v:.1e}" for k, v in record["rel_err"].items())
          print(f"{tag} {record['ms']:9.3f} ms {record['tflops']:7.1f} TFLOP/s "
                f"({record['method']}) {record['status'].upper()} err[{errs}] "
                f"compile {record['compile_s']:.1f}s", flush=True)
        else:
          print(f"{tag} {record['status'].upper()}: {record['error'][:300]}", flush=True)
      results.extend(best[(impl, mode)] for impl in impls for mode in modes
                     if (impl, mode) in best)
      save(partial=True)
      del case
  save(partial=False)
  print("\n" + format_tables(results, impls), flush=True)
  try:
    plot(results, meta, out_png)
    print(f"wrote {out_json} and {out_png}", flush=True)
  except Exception:  # pylint: disable=broad-except
    traceback.print_exc()
    print(f"wrote {out_json}; plot FAILED", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""SM clock and board power while one attention implementation runs back to back.

Question (session 39): is the H100/H200 power-limited during our backward? If the SM clock
drops under sustained tensor-core load, a partial last wave (fewer busy SMs) runs at a higher
clock and costs less than the wave model says, and the time tracks the work's energy rather
than its idle slots: that would explain why the persistent and stream-tail backward forms did
not shrink the dK/dV grid (NOTES, sessions 38-39).

For each implementation the jitted (fwd or fwd+bwd) call runs for ``--seconds`` while a
sampler reads the SM clock, power and clock-event reasons (pynvml if importable, else
``nvidia-smi -lms``). Written: per implementation the calls per second (wall clock, queue kept
full), the median / min SM clock, mean / max power, and the reasons seen.

  python3 benchmarks/power_probe.py --out $OUT --rows 4x4096x16x128 --causal 0
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import timing  # noqa: E402
from mosaic_ab import parse_variant, peers, with_grads  # noqa: E402
from pallas_attn import flash_attention  # noqa: E402
from pallas_attn.mosaic.config import default_config  # noqa: E402

_QUERY = "clocks.sm,power.draw,clocks_throttle_reasons.active"


class Sampler:
  """Background samples of (t, sm clock MHz, power W, reasons bitmask)."""

  def __init__(self, period_s: float = 0.01):
    self.period_s, self.rows, self._stop = period_s, [], threading.Event()
    self._thread = None
    self._proc = None
    try:
      import pynvml  # pylint: disable=import-outside-toplevel
      pynvml.nvmlInit()
      self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # pylint: disable=broad-except
      self._nvml = None

  def _poll(self):
    nv, h = self._nvml, self._handle
    while not self._stop.is_set():
      self.rows.append((time.time(), nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                        nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                        nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)))
      time.sleep(self.period_s)

  def _read_smi(self):
    for line in self._proc.stdout:
      parts = [p.strip() for p in line.split(",")]
      try:
        self.rows.append((time.time(), float(parts[0]), float(parts[1]), int(parts[2], 16)))
      except (ValueError, IndexError):
        continue

  def __enter__(self):
    self.rows = []
    if self._nvml is not None:
      self._thread = threading.Thread(target=self._poll, daemon=True)
    else:
      try:
        self._proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits",
             f"-lms={max(10, int(self.period_s * 1000))}"],
            stdout=subprocess.PIPE, text=True)
      except FileNotFoundError:        # no GPU driver here: no samples
        self._thread = threading.Thread(target=lambda: None, daemon=True)
        self._thread.start()
        return self
      self._thread = threading.Thread(target=self._read_smi, daemon=True)
    self._stop.clear()
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    if self._proc is not None:
      self._proc.terminate()
    self._thread.join(timeout=2)

  def summary(self, skip_s: float) -> dict:
    if not self.rows:
      return {"samples": 0, "source": "pynvml" if self._nvml else "nvidia-smi"}
    t0 = self.rows[0][0]
    rows = [r for r in self.rows if r[0] - t0 >= skip_s] or self.rows
    clocks, power = [r[1] for r in rows], [r[2] for r in rows]
    reasons = 0
    for r in rows:
      reasons |= r[3]
    return {"samples": len(rows), "source": "pynvml" if self._nvml else "nvidia-smi",
            "sm_clock_median": statistics.median(clocks), "sm_clock_min": min(clocks),
            "sm_clock_max": max(clocks), "power_mean": statistics.fmean(power),
            "power_max": max(power), "reasons_mask": hex(reasons)}


def sustained(fn, args, seconds: float, sampler: Sampler) -> dict:
  """Calls per second with the dispatch queue kept full, and the sampler's summary."""
  jax.block_until_ready(fn(*args))
  with sampler:
    t0, n, out = time.time(), 0, None
    while time.time() - t0 < seconds:
      for _ in range(8):
        out = fn(*args)
      n += 8
      jax.block_until_ready(out)
    wall = time.time() - t0
  return {"calls": n, "ms_per_call": 1e3 * wall / n,
          **sampler.summary(skip_s=min(1.0, seconds / 4))}


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--rows", default="4x4096x16x128")
  ap.add_argument("--causal", default="0")
  ap.add_argument("--mode", default="fwdbwd", choices=("fwd", "fwdbwd"))
  ap.add_argument("--variant", action="append", default=[])
  ap.add_argument("--peers", default="cudnn")
  ap.add_argument("--seconds", type=float, default=4.0)
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  variants = dict(parse_variant(v) for v in args.variant)
  sampler = Sampler()
  payload = {"meta": timing.metadata(), "variants": variants, "rows": []}
  with sampler:       # idle clocks, before any work
    time.sleep(0.5)
  payload["idle"] = sampler.summary(skip_s=0.0)
  print("idle", payload["idle"], flush=True)
  for text in args.rows.split(","):
    b, t, n, h = (int(x) for x in text.split("x"))
    for causal in (bool(int(c)) for c in args.causal.split(",")):
      keys = jax.random.split(jax.random.key(0), 4)
      q, k, v, do = (jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in keys)
      base = default_config(head_dim=h, seq_k=t, masked=causal, batch=b)
      cfgs = {"ours": base, **{nm: base.replace(**f) if hasattr(base, "replace") else
                                __import__("dataclasses").replace(base, **f)
                                for nm, f in variants.items()}}
      fns = {nm: (lambda q, k, v, cfg=cfg: flash_attention(
          q, k, v, causal=causal, implementation="mosaic", config=cfg))
             for nm, cfg in cfgs.items()}
      fns.update(peers(causal, args.peers.split(",")))
      row = {"shape": [b, t, n, h], "causal": causal, "mode": args.mode}
      for name, fn in fns.items():
        run = jax.jit(with_grads(fn)) if args.mode == "fwdbwd" else jax.jit(fn)
        call_args = (q, k, v, do) if args.mode == "fwdbwd" else (q, k, v)
        try:
          row[name] = sustained(run, call_args, args.seconds, sampler)
          row[name]["cupti_ms"] = timing.measure(run, call_args, iterations=20).ms
        except Exception as e:  # pylint: disable=broad-except
          row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(text, causal, name, json.dumps(row[name]), flush=True)
      payload["rows"].append(row)
      timing.write_json(os.path.join(args.out, "power_probe.json"), payload)
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Shared helpers for the GPU benchmarks: kernel timing, FLOP counts and JSON results.

Timing follows ../shared/BENCHMARKS.md: GPU kernel time from CUPTI through
``jax.experimental.mosaic.gpu.profiler.measure(f, iterations=n)``, whose wrapper returns
``(outputs, timings)`` with ``timings`` a list of per-iteration milliseconds (kernel times summed
within an iteration; a single float when ``iterations == 1``) or ``None`` when CUPTI saw no
kernel. The first CUPTI session of a process can come back empty, so one throw-away session is
run before the first real measurement. Where CUPTI is unavailable (CPU, missing Mosaic GPU
extension) or returns nothing, a wall-clock timer with ``block_until_ready`` is used instead and
the result says so in ``method``.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

_CUPTI_PRIMED = False


@dataclasses.dataclass(frozen=True)
class Timing:
  """One measurement: median and all per-iteration times in milliseconds.

  ``method`` is "cupti" (GPU kernel time, the number to quote) or "wallclock" (host time around
  a blocking call, includes launch overhead; only a fallback). ``note`` says why CUPTI was not used.
  """
  ms: float
  ms_all: tuple[float, ...]
  method: str
  note: str = ""


def _cupti_measure(fn: Callable[..., Any], args: Sequence[Any], iterations: int):
  """Returns per-iteration kernel times (ms) from one CUPTI session, or None if it saw nothing."""
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  _, timings = profiler.measure(fn, iterations=iterations)(*args)
  if timings is None:
    return None
  if isinstance(timings, (int, float)):
    timings = [timings]
  return [float(t) for t in timings]


def prime_cupti() -> str:
  """Runs and discards one CUPTI session (the first of a process can be empty). Idempotent.

  Returns "" on success or the reason CUPTI cannot be used.
  """
  global _CUPTI_PRIMED
  if _CUPTI_PRIMED:
    return ""
  try:
    x = jnp.ones((256, 256), jnp.float32)
    _cupti_measure(jax.jit(lambda a: a @ a), (x,), 2)
  except Exception as e:  # pylint: disable=broad-except
    return f"{type(e).__name__}: {e}"
  _CUPTI_PRIMED = True
  return ""


def wallclock_ms(fn: Callable[..., Any], args: Sequence[Any], iterations: int) -> list[float]:
  """Host time of ``iterations`` blocking calls after one warm-up, in milliseconds each."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iterations):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return times


def measure(fn: Callable[..., Any], args: Sequence[Any], iterations: int = 20) -> Timing:
  """Median GPU kernel time of ``fn(*args)`` in ms: CUPTI, else wall clock (flagged).

  ``fn`` should already be jit-compiled (``profiler.measure`` jits it otherwise). CUPTI runs one
  warm-up call, then ``iterations`` calls in one session. An empty first session is retried once.
  """
  note = prime_cupti()
  if not note:
    try:
      times = _cupti_measure(fn, args, iterations)
      if times is None:
        times = _cupti_measure(fn, args, iterations)
      if times:
        return Timing(statistics.median(times), tuple(times), "cupti")
      note = "CUPTI returned no kernel timings"
    except Exception as e:  # pylint: disable=broad-except
      note = f"CUPTI failed: {type(e).__name__}: {e}"
  times = wallclock_ms(fn, args, iterations)
  return Timing(statistics.median(times), tuple(times), "wallclock", note)


def kernel_breakdown(fn: Callable[..., Any], args: Sequence[Any],
                     iterations: int = 10) -> list[dict[str, Any]]:
  """Median ms of every kernel one call of ``fn`` launches, in launch order (CUPTI through the
  Mosaic GPU profiler with ``aggregate=False``; GPU only)."""
  from jax.experimental.mosaic.gpu import profiler  # pylint: disable=import-outside-toplevel
  _, per_iter = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
  names = [n for n, _ in per_iter[0]]
  return [dict(kernel=n, ms=statistics.median(it[i][1] for it in per_iter))
          for i, n in enumerate(names)]


def attention_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, *,
                    causal: bool, mode: str) -> float:
  """FLOPs of attention as BENCHMARKS.md counts them.

  Forward 4·B·N·T·S·H (two matmuls of 2·T·S·H per head), halved when causal; "fwdbwd" is
  3.5x the forward (backward = 2.5x forward: five matmuls against two).
  """
  flops = 4.0 * batch * heads * q_len * kv_len * head_dim
  if causal:
    flops /= 2
  if mode == "fwd":
    return flops
  if mode == "fwdbwd":
    return 3.5 * flops
  raise ValueError(f"mode must be 'fwd' or 'fwdbwd', got {mode!r}")


def matmul_flops(m: int, k: int, n: int) -> float:
  """FLOPs of an (m, k) x (k, n) matrix product: 2·M·K·N."""
  return 2.0 * m * k * n


def tflops(flops: float, ms: float) -> float:
  """TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
  return flops / (ms * 1e-3) / 1e12


def metadata() -> dict[str, Any]:
  """Date, device and software versions for a results file."""
  device = jax.devices()[0]
  return {
      "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "device_kind": device.device_kind,
      "platform": device.platform,
      "device_count": jax.device_count(),
      "jax": jax.__version__,
      "jaxlib": getattr(jax.lib, "__version__", None) or _version("jaxlib"),
      "python": platform.python_version(),
      "host": platform.node(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }


def _version(package: str) -> str | None:
  try:
    from importlib import metadata as importlib_metadata  # pylint: disable=import-outside-toplevel
    return importlib_metadata.version(package)
  except Exception:  # pylint: disable=broad-except
    return None


def package_version(package: str) -> str | None:
  """Installed version of a distribution, or None."""
  return _version(package)


def write_json(path: str, payload: dict[str, Any]) -> None:
  """Writes ``payload`` as indented JSON atomically (a partial file never replaces a good one)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(payload, f, indent=1, default=str)
    f.write("\n")
  os.replace(tmp, path)

"""Autotuning of the Mosaic GPU forward: try a small Config space on the device, cache the winner.

The cache is a JSON file mapping a problem key (head dim, key-length bucket, causal, dtype) to the
fastest Config found; ``ops.attention`` reads it when no config and no window are given
(``lookup``) and takes its forward fields, the backward ones coming from today's heuristic
(``with_backward_of``).
Location: ``$PALLAS_ATTN_TUNE_CACHE`` or ``~/.cache/pallas_attn/mosaic_tune.json``.

Example (on an H200)::

    from pallas_attn.mosaic import autotune
    best = autotune.tune(batch=4, seq_q=4096, seq_k=4096, heads=16, kv_heads=16, head_dim=128,
                         causal=True)
    # later calls with head_dim 128, S in the same power-of-two bucket, causal, bf16 use ``best``
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from pallas_attn.mosaic.config import Config, default_config, padded_head_dim

ENV_VAR = "PALLAS_ATTN_TUNE_CACHE"


def search_space(*, head_dim: int, seq_k: int, causal: bool) -> tuple[Config, ...]:
  """Tiles, ring depth, launch style and (at head dim 128) the consumer count around
  ``default_config``: every other field (the
  backward, the measured forward flags) stays at the default, so a cached winner never silently
  switches to e.g. the slower Mosaic backward."""
  base = default_config(head_dim=head_dim, seq_k=seq_k, masked=causal)
  # The persistent launch is tried at head dim 128 and where it is the default (masked H = 64):
  # 256-key blocks hang in its loop compiled (ops._forward runs those on the grid instead) and
  # other head dims have not run it at scale; a tuning run must not stall.
  hp = padded_head_dim(head_dim)
  launches = (False, True) if hp == 128 or base.persistent else (False,)
  # Besides the 128-byte-swizzle blocks, FlashAttention-3's key block for the head dim (its
  # tile_size_fwd_sm90: 80 at 256, 176 at 128 unmasked; 192 at 64), which the V ring's narrower
  # swizzle allows (operands.pv_swizzle).
  fa3 = {64: (192,), 128: () if causal else (176,), 256: (80,)}.get(hp, ())
  two = tuple(dataclasses.replace(base, block_q=bq, block_kv=bkv, num_stages=st, persistent=p,
                                  consumers=2)
              for bq in (64, 128) for bkv in (64, 128, 256) + fa3 for st in (2, 3)
              for p in launches)
  # Three consumers (the default on long unmasked rows) only at head dim 128, where 64-row
  # tiles with 64- or 128-key blocks fit their 160 registers a thread; the grid launch (the
  # persistent one is written for two).
  three = tuple(dataclasses.replace(base, block_q=64, block_kv=bkv, num_stages=st,
                                    persistent=False, consumers=3)
                for bkv in (64, 128) for st in (2, 3)) if hp == 128 else ()
  return two + three


def cache_path() -> str:
  return os.environ.get(ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "pallas_attn",
                                                 "mosaic_tune.json")


def problem_key(*, head_dim: int, seq_k: int, causal: bool, dtype) -> str:
  """Cache key: padded head dim, key length rounded up to a power of two, causal, dtype."""
  bucket = 1 << max(0, (int(seq_k) - 1).bit_length())
  mask = "causal" if causal else "full"
  return f"h{padded_head_dim(head_dim)}-s{bucket}-{mask}-{jnp.dtype(dtype).name}"


def _load(path: str) -> dict[str, Any]:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return {}


def lookup(*, head_dim: int, seq_k: int, causal: bool, dtype, path: str | None = None
           ) -> Config | None:
  """The cached Config for this problem, or None (unknown problem, no or unreadable cache)."""
  entry = _load(path or cache_path()).get(problem_key(head_dim=head_dim, seq_k=seq_k,
                                                      causal=causal, dtype=dtype))
  if not entry:
    return None
  try:
    return Config(**entry["config"])
  except (KeyError, TypeError, ValueError):
    return None


def backward_fields() -> tuple[str, ...]:
  """Config fields that choose the backward: ``backward`` and every ``bwd_*``."""
  return tuple(f.name for f in dataclasses.fields(Config)
               if f.name == "backward" or f.name.startswith("bwd_"))


def with_backward_of(tuned: Config, base: Config) -> Config:
  """``tuned``'s forward with ``base``'s backward fields (``backward_fields``).

  ``tune`` times the forward only, so a cached winner's backward fields are just the defaults of
  the day it ran, for its problem class: ops.attention takes them from today's heuristic for
  the call at hand (its masks included) instead, so that old caches do not pin an old backward.
  """
  return dataclasses.replace(tuned, **{f: getattr(base, f) for f in backward_fields()})


def _wall_ms(fn: Callable[[], Any], iterations: int) -> float:
  jax.block_until_ready(fn())                       # compile + warm up
  times = []
  for _ in range(iterations):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append((time.perf_counter() - start) * 1e3)
  return sorted(times)[len(times) // 2]


def tune(*, batch: int, seq_q: int, seq_k: int, heads: int, kv_heads: int, head_dim: int,
         causal: bool = False, dtype=jnp.bfloat16, space: Iterable[Config] | None = None,
         iterations: int = 10, path: str | None = None, interpret: bool = False,
         timer: Callable[[Callable[[], Any], int], float] = _wall_ms) -> Config:
  """Times the forward for every Config of ``space`` and stores the fastest in the cache.

  ``space`` defaults to ``search_space(head_dim, seq_k, causal)``. Configs that the backend
  declines (NotImplementedError, e.g. over shared memory) or that fail to
  compile are skipped. ``timer(fn, iterations) -> ms`` may be replaced (the tests inject one; a
  profiler-based timer gives kernel time instead of wall clock). Returns the winner.
  Raises ValueError for non-positive sizes or when no Config of ``space`` runs.
  """
  from pallas_attn import flash_attention  # pylint: disable=import-outside-toplevel
  for name, val in (("batch", batch), ("seq_q", seq_q), ("seq_k", seq_k), ("heads", heads),
                    ("kv_heads", kv_heads), ("head_dim", head_dim), ("iterations", iterations)):
    if int(val) <= 0:
      raise ValueError(f"{name} must be positive, got {val}")
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (batch, seq_q, heads, head_dim), dtype)
  k = jax.random.normal(keys[1], (batch, seq_k, kv_heads, head_dim), dtype)
  v = jax.random.normal(keys[2], (batch, seq_k, kv_heads, head_dim), dtype)
  if space is None:
    space = search_space(head_dim=head_dim, seq_k=seq_k, causal=causal)
  results: list[tuple[float, Config]] = []
  errors: dict[str, str] = {}
  for cfg in tqdm(list(space), desc="mosaic autotune", leave=False):
    fn = jax.jit(lambda q, k, v, cfg=cfg: flash_attention(
        q, k, v, causal=causal, implementation="mosaic", config=cfg, interpret=interpret))
    try:
      ms = timer(lambda fn=fn: fn(q, k, v), iterations)
    except Exception as e:  # pylint: disable=broad-except  (a config that does not compile)
      errors[str(cfg)] = f"{type(e).__name__}: {str(e)[:200]}"
      continue
    results.append((ms, cfg))
  if not results:
    raise ValueError(f"no Config of the search space ran: {errors}")
  ms, best = min(results, key=lambda r: r[0])
  path = path or cache_path()
  cache = _load(path)
  cache[problem_key(head_dim=head_dim, seq_k=seq_k, causal=causal, dtype=dtype)] = {
      "config": dataclasses.asdict(best), "ms": ms,
      "shape": [batch, seq_q, seq_k, heads, kv_heads, head_dim],
      "tried": {str(c): t for t, c in results}, "failed": errors}
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(cache, f, indent=1, sort_keys=True)
  return best

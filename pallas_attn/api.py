"""``flash_attention``: argument checks, mask canonicalisation and backend dispatch.

Backends live in sub-packages and share one calling convention (see ``_call_backend``). A backend
that cannot serve a valid call raises NotImplementedError; with ``implementation=None`` dispatch
then tries the next one, ending at the always-available "xla" reference.
"""
from __future__ import annotations

import importlib
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_attn import reference

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("mosaic", "triton", "xla")
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _backend(name: str):
  if name == "xla":
    return _xla_backend
  try:
    module = importlib.import_module(f"pallas_attn.{name}")
  except ImportError as e:  # a backend this install lacks cannot serve the call: fall through
    raise NotImplementedError(f"pallas_attn.{name} does not import: {e}") from e
  return module.attention


def _xla_backend(q, k, v, *, causal, scale, window, softcap, q_segment_ids, kv_segment_ids,
                 kv_lengths, return_lse, config, interpret):
  del interpret
  if config is not None:
    raise NotImplementedError("the xla backend takes no config")
  return reference.attention(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                             q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                             kv_lengths=kv_lengths, return_lse=return_lse, accumulate_f32=True,
                             # float32 means float32: XLA:GPU's default precision is TF32 (1e-3).
                             precision=(jax.lax.Precision.HIGHEST if q.dtype == jnp.float32
                                        else None))


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def default_order() -> tuple[str, ...]:
  """Backends tried by ``implementation=None``, fastest first.

  On CPU only "xla": the Pallas backends run there only in interpret mode, a slow simulator meant
  for tests, so they are used on CPU only when asked for by name.

  On a Hopper GPU "mosaic" comes first: its FlashAttention-3 forward measured 1.3-1.4x the
  Triton FA2 forward on an H200 (benchmarks/NOTES.md); its default Config takes the Triton FA2
  backward, measured faster than the Mosaic wgmma backward. Elsewhere it declines
  (NotImplementedError) and "triton" serves.
  """
  if not _on_gpu():
    return ("xla",)
  return ("mosaic", "triton", "xla")


def _check_ids(name: str, ids, batch: int, length: int, length_name: str):
  if ids is None:
    return
  if not hasattr(ids, "shape") or ids.shape != (batch, length):
    raise ValueError(f"{name} must have shape [B, {length_name}] = {(batch, length)}, "
                     f"got {getattr(ids, 'shape', type(ids))}")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got {ids.dtype}")


def check_inputs(q, k, v, *, scale, window, softcap, q_segment_ids, kv_segment_ids, kv_lengths,
                 implementation):
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "ndim") or x.ndim != 4:
      raise ValueError(f"{name} must be rank 4 [B, T|S, N|K, H], got shape "
                       f"{getattr(x, 'shape', type(x))}")
    if x.dtype not in _DTYPES:
      raise ValueError(f"{name} dtype must be bfloat16, float16 or float32, got {x.dtype}")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
  b, t, n, h = q.shape
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
  if k.shape[0] != b:
    raise ValueError(f"k batch {k.shape[0]} != q batch {b}")
  if k.shape[3] != h:
    raise ValueError(f"head dim of k/v ({k.shape[3]}) must equal q's ({h})")
  if k.shape[2] == 0 or n % k.shape[2]:
    raise ValueError(f"q heads N={n} must be a multiple of k/v heads K={k.shape[2]}")
  if t == 0 or k.shape[1] == 0 or h == 0 or b == 0:
    raise ValueError(f"empty dimension in q {q.shape} / k {k.shape}")
  real = lambda x: isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(
      x, (bool, np.bool_))
  if scale is not None and not (real(scale) and math.isfinite(scale)):
    raise ValueError(f"scale must be a Python float (finite), got {scale!r}")
  if softcap is not None and not (real(softcap) and math.isfinite(softcap) and softcap > 0):
    raise ValueError(f"softcap must be a positive finite float, got {softcap!r}")
  if window is not None:
    whole = lambda w: isinstance(w, (int, np.integer)) and not isinstance(w, (bool, np.bool_))
    if (not isinstance(window, (tuple, list)) or len(window) != 2 or
        any(w is not None and (not whole(w) or w < 0) for w in window)):
      raise ValueError(f"window must be (left, right) with ints >= 0 or None, got {window!r}")
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("q_segment_ids and kv_segment_ids must be given together")
  _check_ids("q_segment_ids", q_segment_ids, b, t, "T")
  _check_ids("kv_segment_ids", kv_segment_ids, b, k.shape[1], "S")
  if kv_lengths is not None:
    if not hasattr(kv_lengths, "shape") or kv_lengths.shape != (b,):
      raise ValueError(f"kv_lengths must have shape [B] = {(b,)}, got "
                       f"{getattr(kv_lengths, 'shape', type(kv_lengths))}")
    if not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
      raise ValueError(f"kv_lengths must be an integer array, got {kv_lengths.dtype}")
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, "
                     f"got {implementation!r}")


def flash_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    kv_lengths: Int[Array, "B"] | None = None,
    return_lse: bool = False,
    implementation: str | None = None,
    config: Any = None,
    interpret: bool | None = None,
):
  r"""Multi-head attention with online softmax, ``jax.nn.dot_product_attention`` layout.

  .. math::
     \mathrm{out}_i = \sum_j \frac{e^{s_{ij}}}{\sum_{j'} e^{s_{ij'}}} v_j, \quad
     s_{ij} = \mathrm{softcap}(\mathrm{scale}\; q_i \cdot k_j), \quad
     \mathrm{lse}_i = \log \sum_j e^{s_{ij}}

  over the keys j visible to query i. Masks combine: ``causal`` (bottom-right aligned: query i
  sees keys j <= i + S - T), ``window=(left, right)`` (same alignment; None = unbounded side),
  packed sequences (``q_segment_ids[b, i] == kv_segment_ids[b, j]``) and padding
  (``j < kv_lengths[b]``). A query with no visible key gets out 0, lse -inf and zero gradients.
  GQA/MQA: query head n reads K/V head ``n // (N // K)``.

  Args:
    q: ``[B, T, N, H]`` queries. k, v: ``[B, S, K, H]`` with ``N % K == 0``.
    implementation: "mosaic" (Hopper, FlashAttention-3), "triton" (FlashAttention-2) or "xla"
      (reference). None picks the fastest backend that supports the call.
    config: the chosen backend's frozen Config (None = heuristics).
    interpret: run a Pallas backend in interpret mode; None = when no GPU is present.

  Returns:
    ``out [B, T, N, H]`` in q's dtype, and with ``return_lse`` also ``lse [B, N, T]`` float32.

  Example:
    >>> q = jax.random.normal(jax.random.key(0), (2, 128, 8, 64), jnp.bfloat16)
    >>> k = v = jax.random.normal(jax.random.key(1), (2, 128, 2, 64), jnp.bfloat16)
    >>> out = flash_attention(q, k, v, causal=True)   # GQA 8:2
  """
  check_inputs(q, k, v, scale=scale, window=window, softcap=softcap,
               q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
               kv_lengths=kv_lengths, implementation=implementation)
  kwargs = dict(causal=bool(causal), scale=None if scale is None else float(scale),
                window=None if window is None else tuple(
                    None if w is None else int(w) for w in window),
                softcap=None if softcap is None else float(softcap),
                q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                kv_lengths=kv_lengths, return_lse=return_lse, config=config)
  if implementation is not None:
    if interpret is None:
      interpret = implementation != "xla" and not _on_gpu()
    return _backend(implementation)(q, k, v, interpret=interpret, **kwargs)
  errors = []
  for name in default_order():
    try:
      run_interpret = (not _on_gpu()) if interpret is None else interpret
      if name == "xla" and config is not None:
        # The last resort serves every valid call: a Pallas backend's Config does not apply.
        kwargs = dict(kwargs, config=None)
      return _backend(name)(q, k, v, interpret=run_interpret, **kwargs)
    except NotImplementedError as e:
      log.debug("flash_attention: backend %s declined: %s", name, e)
      errors.append(f"{name}: {e}")
  raise NotImplementedError("no backend served the call: " + "; ".join(errors))

"""Round-to-nearest (RTN) quantization and the min/max quantizer shared by GPTQ and AWQ.

For a group of weights ``x`` (one group of ``group_size`` input features of one output column):

    asymmetric:  lo = min(min x, 0),  hi = max(max x, 0),  s = (hi - lo) / maxq,  z = round(-lo / s)
    symmetric:   a = max(|min x|, max x),  s = 2 a / maxq,  z = 2**(bits-1)
    q = clip(round(x / s) + z, 0, maxq),   x_hat = (q - z) * s,   maxq = 2**bits - 1

Including 0 in the range (as GPTQ's ``Quantizer.find_params`` does) keeps zero exactly
representable; an all-zero group uses ``[-1, 1]`` so the scale is never 0.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from quant import formats


def quant_params(x: Float[Array, "... R N"], *, bits: int, sym: bool, clip: Any = 1.0):
  """Scale and zero point of the groups ``x[..., :, n]`` (reduced over axis -2).

  ``clip`` (broadcastable to the result) shrinks the range for AWQ's clipping search.
  Returns ``(scale, zero)`` (float32, or float64 for float64 input) of shape ``x.shape[:-2] + x.shape[-1:]``; zero is integral.
  """
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  maxq = 2 ** bits - 1
  lo = jnp.minimum(x.min(axis=-2), 0.0) * clip
  hi = jnp.maximum(x.max(axis=-2), 0.0) * clip
  if sym:
    a = jnp.maximum(-lo, hi)
    a = jnp.where(a == 0, 1.0, a)
    scale = 2 * a / maxq
    zero = jnp.full_like(scale, 2 ** (bits - 1))
  else:
    dead = (lo == 0) & (hi == 0)
    lo = jnp.where(dead, -1.0, lo)
    hi = jnp.where(dead, 1.0, hi)
    scale = (hi - lo) / maxq
    zero = jnp.clip(jnp.round(-lo / scale), 0, maxq)
  return scale, zero


def quantize_codes(x, scale, zero, *, bits: int):
  """Integer codes ``clip(round(x / s) + z, 0, maxq)`` as float32 (exact small integers)."""
  return jnp.clip(jnp.round(x / scale) + zero, 0, 2 ** bits - 1)


def fake_quantize(x, scale, zero, *, bits: int):
  """``(q - z) * s``: the value the quantized weight represents."""
  return (quantize_codes(x, scale, zero, bits=bits) - zero) * scale


def rtn(w: Float[Array, "K N"], *, bits: int = 4, group_size: int | None = 128,
        sym: bool = False) -> formats.QuantizedWeight:
  """Round-to-nearest quantization of ``w[K_in, N_out]`` with groups of ``group_size`` along K.

  Args:
    w: float weight in Flax orientation.
    bits: code width, 2..8.
    group_size: input features per scale; -1 or None for one scale per output column.
    sym: symmetric (no stored zero points) instead of asymmetric.

  Example:
    >>> qw = quant.rtn(jax.random.normal(key, (256, 64)), bits=4, group_size=128)
    >>> quant.dequantize(qw).shape
    (256, 64)
  """
  w = _check_weight(w)
  k, n = w.shape
  gs = formats.canonical_group_size(group_size, k)
  formats.check_k(k, gs, bits)
  codes, scale, zero = _rtn(w, bits=bits, group_size=gs, sym=bool(sym))
  return formats.QuantizedWeight.from_codes(codes, scale, None if sym else zero, bits=bits,
                                            group_size=gs)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "sym"))
def _rtn(w, *, bits, group_size, sym):
  k, n = w.shape
  x = w.astype(jnp.float32).reshape(k // group_size, group_size, n)
  scale, zero = quant_params(x, bits=bits, sym=sym)
  q = quantize_codes(x, scale[:, None], zero[:, None], bits=bits)
  return q.reshape(k, n).astype(jnp.int32), scale, zero.astype(jnp.int32)


def _check_weight(w) -> jax.Array:
  w = jnp.asarray(w)
  if w.ndim != 2:
    raise ValueError(f"w must be 2-D [K_in, N_out], got shape {w.shape}")
  if not jnp.issubdtype(w.dtype, jnp.floating):
    raise TypeError(f"w must be floating point, got {w.dtype}")
  if not isinstance(w, jax.core.Tracer) and not bool(jnp.isfinite(w).all()):
    raise ValueError("w contains NaN or inf")          # as gptq: a NaN would quantise silently
  return w

"""Reference W4A16 matmul: ``x @ dequantize(qw)`` in plain jnp (also the "xla" backend).

The expanded weight is materialised, so this is the correctness oracle and the CPU path, not the
fast one. Accumulation is float32; the result has ``x``'s dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from quant import formats


def int4_matmul(x: Float[Array, "... K"], qw: formats.QuantizedWeight, *,
                bias: Float[Array, "N"] | None = None) -> Float[Array, "... N"]:
  """``y = x @ dequantize(qw) (+ bias)`` with float32 accumulation, returned in x.dtype."""
  w = formats.dequantize(qw, dtype=x.dtype)
  y = jnp.matmul(x, w, preferred_element_type=jnp.float32,
                 precision=jax.lax.Precision.HIGHEST)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype)

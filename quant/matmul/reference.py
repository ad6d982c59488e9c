"""Reference W4A16 matmul: ``x @ dequantize(qw)`` in plain jnp (also the "xla" backend).

The expanded weight is materialised, so this is the correctness oracle and the CPU path, not the
fast one. The weight is expanded in float32 and the product taken in float32, so the only
rounding to ``x``'s dtype is the result's. (Expanding to bf16 instead rounds every weight to 8
significant bits: ~1.7e-3 mean relative output error, above TESTING.md's 1e-3 bar, which the
fused kernels meet by applying the scales to their float32 accumulators.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from quant import formats


def int4_matmul(x: Float[Array, "... K"], qw: formats.QuantizedWeight, *,
                bias: Float[Array, "N"] | None = None) -> Float[Array, "... N"]:
  """``y = x @ dequantize(qw) (+ bias)`` in float32, returned in x.dtype."""
  w = formats.dequantize(qw, dtype=jnp.float32)
  y = jnp.matmul(x.astype(jnp.float32), w, preferred_element_type=jnp.float32,
                 precision=jax.lax.Precision.HIGHEST)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype)

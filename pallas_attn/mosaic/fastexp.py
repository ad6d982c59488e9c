"""2^x on the FMA pipe: a software exponential to take work off the MUFU (XU) unit.

On an H200 the forward at head dim 64 issues one ``MUFU.EX2`` per score. Nsight Compute
(benchmarks/NOTES.md, session 9) put the XU pipe at ~48% busy and the tensor pipe at ~48%: the
exponentials cost as much time as the matmuls. The multi-function unit does 16 results per clock
per SM, the FMA pipe 128, so part of the scores can be exponentiated with a short polynomial on
the FMA pipe instead (FlashAttention-4 does this on Blackwell, where the same imbalance is worse).

Maths (Cody-Waite range reduction, then a polynomial):

  2^x = 2^n * 2^f,   n = round(x),   f = x - n in [-1/2, 1/2],
  2^f ~ c0 + c1 f + c2 f^2 + c3 f^3   (relative error < 7.5e-5 on [-1/2, 1/2]),

and 2^n * p is formed by adding n to p's exponent field (``bits(p) + (n << 23)``). ``round`` is
the float trick t = x + 1.5 * 2^23: for |x| < 2^22 the sum's low mantissa bits hold round(x) in
two's complement, so ``bits(t) << 23`` is ``n << 23`` and t - 1.5 * 2^23 is n as a float. All of
it is FADD / FFMA / integer shift-add: no MUFU.

The error is far below what the result is rounded to anyway (P goes to bf16, 2^-9 relative).
Inputs must be finite and <= 0 (the softmax's s - max); they are clamped at -126, so a score
126 or more below the row max gives ~2^-126 instead of 0, which no float32 sum of ones notices.
Masked scores (-inf) must not come here: use ``jnp.exp2`` for those.

Example::

  x = -jnp.arange(0.0, 30.0, 0.37)
  assert jnp.allclose(exp2_poly(x), jnp.exp2(x), rtol=1e-4)
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

# Degree-3 fit of 2^f on [-1/2, 1/2] minimising the maximum relative error (7.48e-5).
POLY = (0.9999280728460014, 0.6932610273880949, 0.242611137922823, 0.05517145363393282)
ROUND_MAGIC = 12582912.0        # 1.5 * 2^23
MIN_EXPONENT = -126.0           # smallest normal float32 exponent


def exp2_poly(x: Float[Array, "..."]) -> Float[Array, "..."]:
  """2^x for finite float32 x <= 0 with FADD / FFMA / integer ops only (see the module doc)."""
  x = jnp.maximum(x, MIN_EXPONENT)
  # The barrier keeps compilers from folding (x + C) - C back to x, which is exact algebra but
  # not float arithmetic (XLA's simplifier does it, and the rounding is the point).
  t = lax.optimization_barrier(x + ROUND_MAGIC)
  f = x - (t - ROUND_MAGIC)
  c0, c1, c2, c3 = POLY
  p = c0 + f * (c1 + f * (c2 + f * c3))
  n_bits = lax.shift_left(lax.bitcast_convert_type(t, jnp.int32), jnp.int32(23))
  return lax.bitcast_convert_type(lax.bitcast_convert_type(p, jnp.int32) + n_bits, jnp.float32)


def exp2_split(x: Float[Array, "rows cols"], poly_cols: int) -> Float[Array, "rows cols"]:
  """2^x with the first ``poly_cols`` columns on the FMA pipe (``exp2_poly``), the rest on MUFU.

  The split is by column so that it is a register slice in the wgmma accumulator layout (whose
  tiles are 8 columns wide): ``poly_cols`` must be a multiple of 8. The caller guarantees that
  those columns hold finite values <= 0 (an unmasked block).
  """
  cols = x.shape[-1]
  if poly_cols <= 0:
    return jnp.exp2(x)
  if poly_cols >= cols:
    return exp2_poly(x)
  return jnp.concatenate([exp2_poly(x[:, :poly_cols]), jnp.exp2(x[:, poly_cols:])], axis=1)

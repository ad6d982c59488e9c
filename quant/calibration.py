"""Streaming calibration statistics: the GPTQ Hessian and AWQ's per-channel activation scale.

For the inputs ``x_t in R^K`` of one linear layer over ``n`` calibration tokens:

    H   = 2/n sum_t x_t x_t^T        (Hessian of the output error ||X W - X W_hat||^2 / n, GPTQ Eq. 1)
    s_x = 1/n sum_t |x_t|            (AWQ's activation magnitude per input channel, Sec. 3.2)

Both are sums, so batches are folded in one at a time (``update``) and never kept. Sums are
float32; float32 inputs use full float32 matmul precision, bf16/f16 inputs multiply exactly in
float32 (``preferred_element_type``).

Example:
  >>> stats = calibration.init(k)
  >>> for x in batches:                       # x: [..., K]
  ...   stats = calibration.update(stats, x)
  >>> h = calibration.hessian(stats)          # [K, K]
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class CalibrationStats(NamedTuple):
  """Running sums over calibration tokens (a pytree; pass it through jit freely)."""
  xtx: Float[Array, "K K"]      # sum_t x_t x_t^T
  abs_sum: Float[Array, "K"]    # sum_t |x_t|
  count: Int[Array, ""]         # number of tokens
  finite: jax.Array             # False once a NaN / inf was seen


def init(k: int) -> CalibrationStats:
  """Empty statistics for a layer with ``k`` input features."""
  if not isinstance(k, int) or k <= 0:
    raise ValueError(f"k must be a positive int, got {k!r}")
  return CalibrationStats(jnp.zeros((k, k), jnp.float32), jnp.zeros((k,), jnp.float32),
                          jnp.zeros((), jnp.int32), jnp.ones((), jnp.bool_))


def update(stats: CalibrationStats, x: Float[Array, "... K"]) -> CalibrationStats:
  """Adds the tokens of ``x[..., K]`` (all leading axes are tokens)."""
  k = stats.abs_sum.shape[0]
  if not hasattr(x, "shape") or x.ndim < 1 or x.shape[-1] != k:
    raise ValueError(f"x must have shape [..., {k}], got {getattr(x, 'shape', type(x))}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"x must be floating point, got {x.dtype}")
  return _update(stats, x)


@jax.jit
def _update(stats, x):
  x = x.reshape(-1, x.shape[-1])
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  xtx = jnp.einsum("tk,tl->kl", x, x, preferred_element_type=jnp.float32, precision=precision)
  abs_sum = jnp.sum(jnp.abs(x).astype(jnp.float32), axis=0)
  finite = jnp.isfinite(xtx).all() & jnp.isfinite(abs_sum).all()
  return CalibrationStats(stats.xtx + xtx, stats.abs_sum + abs_sum, stats.count + x.shape[0],
                          stats.finite & finite)


def _check(stats: CalibrationStats) -> None:
  if not bool(stats.finite):
    raise ValueError("calibration data contained NaN or inf")
  if int(stats.count) == 0:
    raise ValueError("no calibration tokens were seen")


def hessian(stats: CalibrationStats) -> Float[Array, "K K"]:
  """``H = 2/n sum x x^T``. Raises ValueError if the data had NaN/inf or no tokens."""
  _check(stats)
  return stats.xtx * (2.0 / stats.count.astype(jnp.float32))


def mean_abs(stats: CalibrationStats) -> Float[Array, "K"]:
  """``s_x = 1/n sum |x|`` per input channel (AWQ)."""
  _check(stats)
  return stats.abs_sum / stats.count.astype(jnp.float32)


def from_batches(batches: Iterable[jax.Array]) -> CalibrationStats:
  """Statistics of an iterable of ``[..., K]`` arrays."""
  stats = None
  for x in batches:
    if stats is None:
      stats = init(int(x.shape[-1]))
    stats = update(stats, x)
  if stats is None:
    raise ValueError("no calibration batches were given")
  return stats


def hessian_from_batches(batches: Iterable[jax.Array]) -> Float[Array, "K K"]:
  """Shortcut: ``hessian(from_batches(batches))``."""
  return hessian(from_batches(batches))

"""One GPTQ block as a Pallas Triton kernel: the whole sequential column loop in registers.

The inner loop of GPTQ (Algorithm 1, lines 5-10 of the paper) is sequential over the ``bs``
features of a block but independent across the N output columns. Each program of the kernel
holds a ``[bs, tn]`` tile of the block in registers and runs all ``bs`` steps on it:

    q_j = clip(round(w_j / s) + z, 0, maxq)                 w_j: row j of the tile
    e_j = (w_j - (q_j - z) s) / U_jj
    W_tile <- W_tile - U_{j,:}^T e_j                        (rows i < j: U_ji = 0)

so a block costs one launch instead of ``bs`` rounds of small XLA kernels. Rows are selected
with masks (registers cannot be indexed dynamically) and row ``j`` of ``U`` is read as column
``j`` of ``U^T``. Rounding is half-to-even, as ``jnp.round``, built from ``floor``.

Used by ``quant.gptq`` for dynamic groups that start on block boundaries (``group_size`` a
multiple of the block, or one group per column); on CPU it runs in interpret mode (tests).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

TILE_N = 32       # output columns per program


def supported(bs: int, n: int) -> bool:
  """Block lengths the kernel handles: powers of two from 16 to 128."""
  del n
  return 16 <= bs <= 128 and bs & (bs - 1) == 0


def _round_half_even(x):
  r = jnp.floor(x)
  f = x - r                                   # exact for |x| < 2**23
  odd = (r - 2.0 * jnp.floor(r * 0.5)) == 1.0
  up = (f > 0.5) | ((f == 0.5) & odd)
  return r + up.astype(x.dtype)


def _block_kernel(w_ref, ut_ref, s_ref, z_ref, q_ref, e_ref, *, bs: int, maxq: int):
  w = w_ref[...]
  s = s_ref[...]                                                  # [1, tn]
  z = z_ref[...]
  rows = lax.broadcasted_iota(jnp.int32, (bs, 1), 0)

  def step(j, carry):
    w, q_acc, e_acc = carry
    sel = rows == j
    wj = jnp.sum(jnp.where(sel, w, 0.0), axis=0, keepdims=True)   # [1, tn]
    u_col = ut_ref[:, pl.ds(j, 1)]                                 # [bs, 1] = U[j, :]^T
    d = jnp.sum(jnp.where(sel, u_col, 0.0), axis=0, keepdims=True)
    q = jnp.clip(_round_half_even(wj / s) + z, 0.0, float(maxq))
    e = (wj - (q - z) * s) / d
    w = w - u_col * e
    return w, jnp.where(sel, q, q_acc), jnp.where(sel, e, e_acc)

  zeros = jnp.zeros_like(w)
  _, q, e = lax.fori_loop(0, bs, step, (w, zeros, zeros))
  q_ref[...] = q
  e_ref[...] = e


@functools.partial(jax.jit, static_argnames=("bits", "interpret"))
def gptq_block(w1, u1, scale, zero, *, bits: int, interpret: bool = False):
  """Quantizes one block: ``w1 [bs, N]``, ``u1 [bs, bs]`` (upper Cholesky rows of the block),
  ``scale, zero [N]``. Returns float32 codes and scaled errors ``e``, both ``[bs, N]``."""
  bs, n = w1.shape
  npad = -(-n // TILE_N) * TILE_N
  pad = ((0, 0), (0, npad - n))
  w1 = jnp.pad(w1.astype(jnp.float32), pad)
  s = jnp.pad(scale.astype(jnp.float32)[None], pad, constant_values=1.0)
  z = jnp.pad(zero.astype(jnp.float32)[None], pad)
  ut = u1.astype(jnp.float32).T
  kwargs = {}
  if not interpret:
    from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
    kwargs["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=1)
  q, e = pl.pallas_call(
      functools.partial(_block_kernel, bs=bs, maxq=2 ** bits - 1),
      grid=(npad // TILE_N,),
      in_specs=[pl.BlockSpec((bs, TILE_N), lambda i: (0, i)),
                pl.BlockSpec((bs, bs), lambda i: (0, 0)),
                pl.BlockSpec((1, TILE_N), lambda i: (0, i)),
                pl.BlockSpec((1, TILE_N), lambda i: (0, i))],
      out_specs=[pl.BlockSpec((bs, TILE_N), lambda i: (0, i)),
                 pl.BlockSpec((bs, TILE_N), lambda i: (0, i))],
      out_shape=[jax.ShapeDtypeStruct((bs, npad), jnp.float32),
                 jax.ShapeDtypeStruct((bs, npad), jnp.float32)],
      interpret=interpret, name="gptq_block", **kwargs,
  )(w1, ut, s, z)
  return q[:, :n], e[:, :n]

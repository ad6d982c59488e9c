"""One pass of FP8 quantisation for Q and K: Hadamard rotation, amax and e4m3 codes together.

``pallas_attn.fp8.quantize_inputs`` in XLA makes three passes over each of Q and K: the
rotation (a dot that writes the rotated tensor), the amax per token (reads it) and the codes
(reads it again, writes e4m3). At 2^25 elements a tensor that is ~300 MB of traffic against
the ~100 MB of one pass that reads the 16-bit input and writes the codes. This Pallas Triton
kernel is that one pass: each program loads ``block`` tokens x D of one head, rotates them on
the tensor cores (the +-1 Hadamard matrix as a bf16 operand: exact products, float32 sums, as
``fp8.hadamard`` does), takes the amax per token (or over the block: one scale per
``block`` keys) and stores the codes and the scales.

Semantics are those of ``fp8.quantize_tokens(fp8.hadamard(x).astype(x.dtype), block=...)``:
the rotation rounded to the input's 16-bit dtype, ``scale = amax / 448`` (1 for an all-zero
token or block), ``codes = clip(x / scale, -448, 448)`` in e4m3. Tokens at or past
``lengths[b]`` are zeroed and do not count towards a block's amax.

Opt-in (``flash_attention_fp8(fused_quantize=True)``): 0.10-0.13 ms faster end to end than
XLA's passes on an H100, but a GPU hang was seen with it before the FP8 kernel (session 26;
``benchmarks/fp8_hang_probe.py``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_attn.fp8 import E4M3, E4M3_MAX, ROTATION_BLOCK, combine_blocks, hadamard_signs

BLOCKS = (16, 32, 64, 128, 256)     # token rows per program: powers of two (Triton tiles)


def _rotated(x_ref, signs, rows, *, r: int, rotate: bool, inv_sqrt_d: float):
  """Rows ``rows`` (a pl.ds) of the tile in float32, rotated with ``rotate``, as a list of
  column blocks of r (one block up to D = 128; ``fp8.combine_blocks``)."""
  d = x_ref.shape[-1]
  xs = [x_ref[rows, pl.ds(i * r, r)] for i in range(d // r)]           # [sub, r], 16-bit
  if not rotate:
    return [x.astype(jnp.float32) for x in xs]
  # x H / sqrt(D): +-1 entries make every product exact; the float32 sum is the rotation,
  # rounded back to x's dtype as the XLA path does (fp8.quantize_inputs). H_256 = H_2 (x) H_128:
  # two 128-column dots and their sum and difference, so the program holds a 32 KB matrix,
  # not 128 KB.
  ys = combine_blocks([plgpu.dot(x, signs) for x in xs])
  return [(y * inv_sqrt_d).astype(xs[0].dtype).astype(jnp.float32) for y in ys]


def _quantize_kernel(x_ref, signs_ref, len_ref, codes_ref, scale_ref, *, rotate: bool,
                     per_block: bool, block: int, sub: int, inv_sqrt_d: float):
  """One program: ``block`` tokens x D of one (batch, head), ``sub`` rows at a time (a
  [256, 128] float32 tile would not fit the registers). With ``per_block`` the block's amax
  takes a first pass (the rotation is recomputed in the second: the tile is in L1 / L2, and
  the dot is ~1% of the tensor cores' time next to the pass's bytes)."""
  start = pl.program_id(1) * block
  length = len_ref[0]
  signs = signs_ref[...] if rotate else None          # loaded once per program
  r = signs_ref.shape[0]

  def chunk(i):
    rows = pl.ds(i * sub, sub)
    ys = _rotated(x_ref, signs, rows, r=r, rotate=rotate, inv_sqrt_d=inv_sqrt_d)
    valid = start + i * sub + jnp.arange(sub, dtype=jnp.int32) < length
    return rows, [jnp.where(valid[:, None], y, 0.0) for y in ys]

  def row_amax(ys):
    amax = jnp.max(jnp.abs(ys[0]), axis=1)
    for y in ys[1:]:
      amax = jnp.maximum(amax, jnp.max(jnp.abs(y), axis=1))
    return amax

  block_amax = None
  if per_block:
    block_amax = jnp.float32(0.0)
    for i in range(block // sub):
      block_amax = jnp.maximum(block_amax, jnp.max(row_amax(chunk(i)[1])))
  for i in range(block // sub):
    rows, ys = chunk(i)
    amax = jnp.broadcast_to(block_amax, (sub,)) if per_block else row_amax(ys)
    scale = amax / E4M3_MAX
    safe = jnp.where(scale > 0, scale, 1.0)
    for c, y in enumerate(ys):
      codes_ref[rows, pl.ds(c * r, r)] = jnp.clip(y / safe[:, None], -E4M3_MAX,
                                                  E4M3_MAX).astype(E4M3)
    scale_ref[rows] = safe


def supported(*, head_dim: int, dtype, scale_block: int) -> bool:
  """Whether ``quantize`` serves these inputs: a power-of-two head dim of 16-256, a 16-bit
  dtype, and one scale per token or per a power-of-two block of at most 256 tokens."""
  return (head_dim in (16, 32, 64, 128, 256) and dtype in (jnp.bfloat16, jnp.float16)
          and (scale_block == 1 or scale_block in BLOCKS))


@functools.partial(jax.jit, static_argnames=("rotate", "scale_block", "interpret"))
def quantize(x: Float[Array, "B L N D"], lengths: Int[Array, "B"] | None = None, *,
             rotate: bool = True, scale_block: int = 1, interpret: bool = False):
  """e4m3 codes and scales of x (rotated first with ``rotate``) in one pass: returns
  ``(codes [B, L, N, D] float8_e4m3fn, scale [B, N, L] float32)``, as
  ``fp8.quantize_tokens(fp8.hadamard(x).astype(x.dtype), block=scale_block, valid=...)``
  with ``valid = arange(L) < lengths[b]`` (None: every token).

  Raises NotImplementedError where ``supported`` says no (the caller falls back to XLA).

  Example:
    >>> codes, scale = quantize(k, kv_lengths, scale_block=256)    # k [B, S, K, 128] bf16
  """
  b, length, n, d = x.shape
  if not supported(head_dim=d, dtype=x.dtype, scale_block=scale_block):
    raise NotImplementedError(f"fused FP8 quantisation needs a 16-bit x with a power-of-two "
                              f"head dim <= 256 and scale_block 1 or one of {BLOCKS}; got "
                              f"{x.dtype}, D={d}, scale_block={scale_block}")
  r = min(d, ROTATION_BLOCK)
  sub = max(16, min(64, 8192 // d, pl.next_power_of_2(length)))  # <= 64 float32 a thread
  if scale_block > 1:           # a program holds one scale block, ``sub`` rows at a time
    sub, block = min(sub, scale_block), scale_block
  else:
    block = sub
  padded = -(-length // block) * block
  if padded != length:          # Triton tiles do not mask a partial block: pad (a copy)
    x = jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, 0)))
  lens = (jnp.full((b,), length, jnp.int32) if lengths is None
          else jnp.clip(lengths.astype(jnp.int32), 0, length))
  kernel = functools.partial(_quantize_kernel, rotate=rotate, per_block=scale_block > 1,
                             block=block, sub=sub,
                             inv_sqrt_d=float(1.0 / np.sqrt(d)))
  tile = pl.BlockSpec((None, block, None, d), lambda bi, li, ni: (bi, li, ni, 0))
  codes, scale = pl.pallas_call(
      kernel,
      grid=(b, padded // block, n),
      in_specs=[tile, pl.BlockSpec((r, r), lambda bi, li, ni: (0, 0)),
                pl.BlockSpec((None, 1), lambda bi, li, ni: (bi, 0))],
      out_specs=[tile, pl.BlockSpec((None, None, block), lambda bi, li, ni: (bi, ni, li))],
      out_shape=[jax.ShapeDtypeStruct((b, padded, n, d), E4M3),
                 jax.ShapeDtypeStruct((b, n, padded), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="fp8_quantize",
  )(x, jnp.asarray(hadamard_signs(r), x.dtype), lens[:, None])
  return codes[:, :length], scale[:, :, :length]

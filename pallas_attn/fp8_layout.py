"""Where V's FP8 codes sit for the Mosaic FP8 kernel: transposed, keys permuted in 16-key groups.

An 8-bit wgmma B operand must be K-major, so P V reads V^T ``[B, K, H, S]`` (keys fastest). With
``Config.fp8_p_registers`` P is the wgmma's A operand straight from the registers that held S,
regrouped to the 8-bit register layout, which leaves each 16-key group of P in the order
``fp8_key_order``; V's keys are permuted to match, so the product is unchanged (a sum over the
keys in any order). ``flash_attention_fp8_kv`` keeps a ``QuantizedKV``'s V in this layout
(``quantize_kv(..., v_layout="kernel")``) so that the transposition, about 0.023 ms a call at
2^25 elements on the H200 (session 27), is paid once. Pure jnp: no Mosaic import.

Example:
  >>> vt = kernel_v_layout(v_codes)                   # [B, S, K, H] -> [B, K, H, S16]
  >>> assert (bskd_v_layout(vt, num_keys=v_codes.shape[1]) == v_codes).all()
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 16            # keys per permuted group


def fp8_key_order(num_keys: int) -> np.ndarray:
  """The key order of ``operands.p_as_8bit_operand``: position 4q + j of each 16-key group holds
  key (2q, 2q + 1, 8 + 2q, 9 + 2q)[j] of the group. ``v[..., order]`` permutes V's keys to it."""
  if num_keys % GROUP:
    raise ValueError(f"num_keys must be a multiple of {GROUP}, got {num_keys}")
  group = np.array([[2 * q, 2 * q + 1, 8 + 2 * q, 9 + 2 * q] for q in range(4)]).reshape(GROUP)
  return (np.arange(0, num_keys, GROUP)[:, None] + group[None, :]).reshape(-1)


def _swap_groups(x: jax.Array) -> jax.Array:
  *lead, s = x.shape
  if s % GROUP:
    raise ValueError(f"the last axis must be a multiple of {GROUP}, got {s}")
  groups = x.reshape(*lead, s // GROUP, 2, 4, 2)
  return jnp.swapaxes(groups, -3, -2).reshape(*lead, s)


def to_fp8_key_order(x: jax.Array) -> jax.Array:
  """``x[..., fp8_key_order(S)]`` as a reshape and a transpose (XLA fuses it into one copy; the
  gather it replaces cost ~0.12 ms a call at 4x4096x16x128 on the H200). Key 8h + 2q + p of a
  16-key group (h, p in {0, 1}, q in 0..3) goes to position 4q + 2h + p."""
  return _swap_groups(x)                   # (group, h, q, p) -> (group, q, h, p)


def from_fp8_key_order(x: jax.Array) -> jax.Array:
  """The inverse of ``to_fp8_key_order``: position 4q + 2h + p back to key 8h + 2q + p (the
  same swap of the (2, 4) axes, read the other way)."""
  *lead, s = x.shape
  if s % GROUP:
    raise ValueError(f"the last axis must be a multiple of {GROUP}, got {s}")
  groups = x.reshape(*lead, s // GROUP, 4, 2, 2)                 # (group, q, h, p)
  return jnp.swapaxes(groups, -3, -2).reshape(*lead, s)         # (group, h, q, p)


def kernel_v_layout(v: jax.Array) -> jax.Array:
  """V's codes ``[B, S, K, H]`` -> ``[B, K, H, S16]``: transposed, keys zero-padded to a multiple
  of 16 and permuted by ``fp8_key_order``."""
  s = v.shape[1]
  vt = jnp.transpose(v, (0, 2, 3, 1))
  vt = jnp.pad(vt, ((0, 0), (0, 0), (0, 0), (0, -s % GROUP)))
  return to_fp8_key_order(vt)


def bskd_v_layout(vt: jax.Array, *, num_keys: int) -> jax.Array:
  """The inverse of ``kernel_v_layout``: ``[B, K, H, S16]`` -> ``[B, S, K, H]``, S = num_keys."""
  return jnp.transpose(from_fp8_key_order(vt)[..., :num_keys], (0, 3, 1, 2))


def kernel_v_operand(vt: jax.Array, *, in_key_order: bool, key_order: bool, head_dim: int,
                     num_keys: int) -> jax.Array:
  """V^T's codes ``[B, K, H, S']`` as the kernel reads them: H zero-padded to ``head_dim``,
  keys to ``num_keys`` (a multiple of 16), in ``fp8_key_order`` iff ``key_order``.
  ``in_key_order``: vt is already permuted (``kernel_v_layout``; S' a multiple of 16, so the
  padding, whole groups, commutes with the permutation); else its keys are in order.
  Both routes give the same array for the same codes (tests/pallas_attn/test_fp8_layout.py)."""
  h, s = vt.shape[-2:]
  if in_key_order and s % GROUP:
    raise ValueError(f"a permuted V^T has a multiple of {GROUP} keys, got {s}")
  if num_keys % GROUP or num_keys < s:
    raise ValueError(f"num_keys must be a multiple of {GROUP} and >= {s}, got {num_keys}")
  vt = jnp.pad(vt, ((0, 0), (0, 0), (0, head_dim - h), (0, num_keys - s)))
  if in_key_order == key_order:
    return vt
  return to_fp8_key_order(vt) if key_order else from_fp8_key_order(vt)

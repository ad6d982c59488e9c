"""Kernel-ready weight for the W4A16 kernels, produced once at load time by ``prepare``.

The Triton kernel reads our packed codes as they are (``QuantizedWeight.qweight``), so the only
change is the zero points: ``QuantizedWeight.zeros`` is int32 (4 bytes per group and column, 6%
of the int4 bytes at group 128), which ``prepare`` narrows to uint8 (codes are < 16). At decode,
where the kernel streams every byte once, that is ~5% less traffic. Act-order stays a row
permutation (``perm``): the kernel gathers x's columns and never sees ``g_idx``. GPTQ / AWQ
checkpoints come in through ``quant.from_gptq`` / ``quant.from_awq`` first.

Example:
  >>> qw = quant.rtn(w, bits=4, group_size=128)
  >>> pw = prepare(qw)                                   # once, at load time
  >>> y = quant.matmul.triton.int4_matmul(x, pw, config=None, interpret=False)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt8

from quant import formats


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
  """A ``QuantizedWeight`` with uint8 zero points; same fields and static metadata otherwise."""
  qweight: Int[Array, "Kp N"]
  scales: Float[Array, "G N"]
  zeros: UInt8[Array, "G N"] | None
  perm: Int[Array, "K"] | None
  bits: int = dataclasses.field(metadata=dict(static=True), default=4)
  group_size: int = dataclasses.field(metadata=dict(static=True), default=128)
  sym: bool = dataclasses.field(metadata=dict(static=True), default=False)
  shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True), default=(0, 0))


def prepare(qw: formats.QuantizedWeight) -> PackedWeight:
  """``QuantizedWeight`` -> ``PackedWeight`` (zero points as uint8). Exact; jit-compatible.

  Raises TypeError / ValueError like ``formats.check_quantized`` for an inconsistent weight, and
  NotImplementedError for codes wider than 8 bits (none exist in our format).
  """
  formats.check_quantized(qw)
  zeros = None if qw.zeros is None else qw.zeros.astype(jnp.uint8)
  return PackedWeight(qweight=qw.qweight, scales=qw.scales, zeros=zeros, perm=qw.perm,
                      bits=qw.bits, group_size=qw.group_size, sym=qw.sym, shape=qw.shape)


def check_packed(pw: Any) -> None:
  """Raises TypeError / ValueError when ``pw`` is not a consistent PackedWeight."""
  if not isinstance(pw, PackedWeight):
    raise TypeError(f"expected a PackedWeight, got {type(pw).__name__}")
  k, n = pw.shape
  formats.check_k(k, pw.group_size, pw.bits)
  if pw.qweight.dtype != jnp.int32:
    raise TypeError(f"qweight must be int32 packed words, got {pw.qweight.dtype}")
  if pw.qweight.shape != (k // formats.per_word(pw.bits), n):
    raise ValueError(f"qweight shape {pw.qweight.shape} does not match shape {pw.shape}")
  if pw.scales.shape != (k // pw.group_size, n):
    raise ValueError(f"scales shape {pw.scales.shape} does not match groups "
                     f"{(k // pw.group_size, n)}")
  if pw.zeros is not None:
    if pw.zeros.dtype != jnp.uint8:
      raise TypeError(f"PackedWeight zeros must be uint8, got {pw.zeros.dtype}")
    if pw.zeros.shape != pw.scales.shape:
      raise ValueError(f"zeros shape {pw.zeros.shape} does not match scales {pw.scales.shape}")

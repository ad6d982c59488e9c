"""Quantized weight format, integer packing and the GPTQ / AWQ checkpoint layouts.

Our layout (Flax orientation, weights ``w[K_in, N_out]``, groups run along K)::

    qweight  int32 [K / per_word, N]   codes packed along K: word j of column n holds rows
                                        per_word*j + i at bit offset field*i (i = 0..per_word-1)
    scales   float [G, N]              G = K / group_size
    zeros    int32 [G, N] or None      integer zero points (asymmetric); None = symmetric
    perm     int32 [K] or None         act-order: stored row i is input feature perm[i]

``field`` is the width of one code slot: 4 bits (8 codes per int32) for ``bits <= 4`` and 8 bits
(4 codes per int32) for ``5 <= bits <= 8``. A 2- or 3-bit code therefore still occupies one
nibble; this keeps one unpacking routine for every width (the kernel only needs shifts and masks).

Dequantization is exact (no rounding beyond the final cast):

    w[perm[i], n] = (q[i, n] - z[i // group_size, n]) * s[i // group_size, n]

with ``z = 2**(bits - 1)`` when ``sym`` (like GPTQ's ``(maxq + 1) / 2``) and ``perm`` = identity
when absent. ``g_idx[k]`` (the GPTQ name) is the group of input feature ``k``.

Checkpoint layouts (PyTorch ``nn.Linear`` weight is ``[out, in]``; the packed tensors below are
already in ``[in, out]`` orientation, the same as ours):

* GPTQ (AutoGPTQ / GPTQModel): ``qweight int32 [K*bits/32, N]`` packed along K, ``qzeros int32
  [G, N*bits/32]`` packed along N, ``scales [G, N]``, ``g_idx int32 [K]``, rows in original order.
  Format "gptq" (v1) stores ``zero - 1`` (the historical off-by-one), "gptq_v2" stores ``zero``.
* AWQ GEMM (llm-awq / AutoAWQ): ``qweight int32 [K, N/8]`` packed along N, ``qzeros int32
  [G, N/8]``, ``scales [G, N]``; nibble i of a word holds column ``8j + AWQ_ORDER[i]`` with
  ``AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``; zeros stored as is; 4-bit asymmetric only.

Example:
  >>> codes = jnp.arange(16, dtype=jnp.int32).reshape(16, 1)
  >>> packed = pack(codes, bits=4)                 # int32 [2, 1]
  >>> bool((unpack(packed, bits=4) == codes).all())
  True
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_INVERSE = tuple(int(i) for i in np.argsort(AWQ_ORDER))


def field_bits(bits: int) -> int:
  """Width of one code slot in our packing: 4 for bits <= 4, else 8."""
  _check_bits(bits)
  return 4 if bits <= 4 else 8


def per_word(bits: int) -> int:
  """Codes per int32 word in our packing (8 for bits <= 4, 4 for 5..8 bits)."""
  return 32 // field_bits(bits)


def _check_bits(bits: Any) -> None:
  if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool) or not 2 <= bits <= 8:
    raise ValueError(f"bits must be an int in [2, 8], got {bits!r}")


def _to_uint32_words(fields: jax.Array, width: int) -> jax.Array:
  """fields [..., P] (uint32, each < 2**width) -> [...] int32 word with field i at width*i."""
  p = fields.shape[-1]
  shifts = (jnp.arange(p, dtype=jnp.uint32) * width)
  word = jnp.sum(fields << shifts, axis=-1, dtype=jnp.uint32)  # disjoint bits: sum == or
  return jax.lax.bitcast_convert_type(word, jnp.int32)


def _from_words(words: jax.Array, width: int) -> jax.Array:
  """int32 words [...] -> uint32 fields [..., 32 // width]."""
  u = jax.lax.bitcast_convert_type(words, jnp.uint32)
  shifts = jnp.arange(32 // width, dtype=jnp.uint32) * width
  return ((u[..., None] >> shifts) & jnp.uint32((1 << width) - 1))


def _check_codes(codes: jax.Array, name: str = "codes") -> None:
  if not jnp.issubdtype(codes.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {codes.dtype}")


def _check_words(words: jax.Array, name: str) -> None:
  if words.dtype != jnp.int32:
    raise TypeError(f"{name} must be int32 packed words, got {words.dtype}")


def pack(codes: Int[Array, "K N"], *, bits: int = 4, width: int | None = None) -> Int[Array, "Kp N"]:
  """Packs integer codes along axis 0: ``32 // width`` codes per int32 word.

  Word ``j`` holds codes ``j*P .. j*P + P-1`` (P = 32 // width), code ``j*P + i`` at bits
  ``[width*i, width*(i+1))``. ``width`` defaults to our slot width ``field_bits(bits)``.
  Codes must lie in ``[0, 2**bits)``; this is not checked under jit.
  """
  _check_codes(codes)
  width = field_bits(bits) if width is None else width
  p = 32 // width
  k = codes.shape[0]
  if codes.ndim != 2 or k % p:
    raise ValueError(f"codes must be 2-D with shape[0] divisible by {p}, got {codes.shape}")
  fields = codes.astype(jnp.uint32).reshape(k // p, p, *codes.shape[1:])
  return _to_uint32_words(jnp.moveaxis(fields, 1, -1), width)


def unpack(words: Int[Array, "Kp N"], *, bits: int = 4, width: int | None = None) -> Int[Array, "K N"]:
  """Inverse of ``pack``: int32 words [K/P, N] -> int32 codes [K, N]."""
  _check_words(words, "packed words")
  width = field_bits(bits) if width is None else width
  fields = _from_words(words, width)                      # [K/P, N, P]
  fields = jnp.moveaxis(fields, -1, 1)                    # [K/P, P, N]
  return fields.reshape(-1, *words.shape[1:]).astype(jnp.int32)


def pack_cols(codes: Int[Array, "K N"], *, width: int) -> Int[Array, "K Np"]:
  """Packs along the last axis (GPTQ qzeros / AWQ layout): [K, N] -> [K, N*width/32]."""
  return pack(codes.T, bits=8, width=width).T


def unpack_cols(words: Int[Array, "K Np"], *, width: int) -> Int[Array, "K N"]:
  return unpack(words.T, bits=8, width=width).T


# ----------------------------------------------------------------------------------------------
# QuantizedWeight
# ----------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """Packed low-bit weight ``[K, N]`` in Flax orientation (a registered pytree).

  Array children: ``qweight``, ``scales``, ``zeros`` (None when symmetric), ``perm`` (None
  unless act-order reordered the rows). Static metadata: ``bits``, ``group_size`` (the effective
  group length; ``K`` for per-channel), ``sym``, ``shape = (K, N)``. Build it with
  ``QuantizedWeight.from_codes`` or the algorithms (``rtn``, ``gptq``, ``awq``); the constructor
  itself does not validate because JAX rebuilds pytrees with placeholder leaves.
  """
  qweight: Int[Array, "Kp N"]
  scales: Float[Array, "G N"]
  zeros: Int[Array, "G N"] | None
  perm: Int[Array, "K"] | None
  bits: int = dataclasses.field(metadata=dict(static=True), default=4)
  group_size: int = dataclasses.field(metadata=dict(static=True), default=128)
  sym: bool = dataclasses.field(metadata=dict(static=True), default=False)
  shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True), default=(0, 0))

  @property
  def num_groups(self) -> int:
    return self.shape[0] // self.group_size

  @property
  def codes(self) -> Int[Array, "K N"]:
    """Unpacked integer codes in stored (possibly permuted) row order."""
    return unpack(self.qweight, bits=self.bits)

  @property
  def zero_points(self) -> Int[Array, "G N"]:
    """Integer zero points; ``2**(bits-1)`` everywhere when symmetric."""
    if self.zeros is not None:
      return self.zeros
    return jnp.full(self.scales.shape, 2 ** (self.bits - 1), jnp.int32)

  @property
  def g_idx(self) -> Int[Array, "K"]:
    """Group index of each input feature in original order (GPTQ's ``g_idx``)."""
    k, g = self.shape[0], self.group_size
    stored = jnp.arange(k, dtype=jnp.int32) // g
    if self.perm is None:
      return stored
    return jnp.zeros((k,), jnp.int32).at[self.perm].set(stored)

  @classmethod
  def from_codes(cls, codes: Int[Array, "K N"], scales: Float[Array, "G N"],
                 zeros: Int[Array, "G N"] | None, *, bits: int, group_size: int | None,
                 perm: Int[Array, "K"] | None = None) -> "QuantizedWeight":
    """Packs ``codes`` (stored row order) and validates every shape; sym iff zeros is None."""
    _check_codes(codes)
    if codes.ndim != 2:
      raise ValueError(f"codes must be 2-D [K, N], got shape {codes.shape}")
    k, n = codes.shape
    gs = canonical_group_size(group_size, k)
    check_k(k, gs, bits)
    g = k // gs
    if scales.shape != (g, n):
      raise ValueError(f"scales must have shape {(g, n)}, got {scales.shape}")
    if not jnp.issubdtype(scales.dtype, jnp.floating):
      raise TypeError(f"scales must be floating point, got {scales.dtype}")
    if zeros is not None:
      _check_codes(zeros, "zeros")
      if zeros.shape != (g, n):
        raise ValueError(f"zeros must have shape {(g, n)}, got {zeros.shape}")
      zeros = zeros.astype(jnp.int32)
    if perm is not None:
      _check_codes(perm, "perm")
      if perm.shape != (k,):
        raise ValueError(f"perm must have shape {(k,)}, got {perm.shape}")
      perm = perm.astype(jnp.int32)
    return cls(qweight=pack(codes.astype(jnp.int32), bits=bits), scales=scales, zeros=zeros,
               perm=perm, bits=int(bits), group_size=gs, sym=zeros is None, shape=(k, n))


def canonical_group_size(group_size: int | None, k: int) -> int:
  """-1 or None means one group over all of K (per output channel)."""
  if group_size is None or group_size == -1:
    return k
  if not isinstance(group_size, (int, np.integer)) or isinstance(group_size, bool) or group_size <= 0:
    raise ValueError(f"group_size must be a positive int, -1 or None, got {group_size!r}")
  return int(group_size)


def check_k(k: int, group_size: int, bits: int) -> None:
  _check_bits(bits)
  if k % group_size:
    raise ValueError(f"K={k} (input features) must be divisible by group_size={group_size}")
  if k % per_word(bits):
    raise ValueError(f"K={k} must be divisible by {per_word(bits)} to pack {bits}-bit codes")


def check_quantized(qw: Any) -> None:
  """Raises TypeError / ValueError when ``qw`` is not a consistent QuantizedWeight."""
  if not isinstance(qw, QuantizedWeight):
    raise TypeError(f"expected a quant.QuantizedWeight, got {type(qw).__name__}")
  _check_words(qw.qweight, "qweight")
  k, n = qw.shape
  if qw.qweight.shape != (k // per_word(qw.bits), n):
    raise ValueError(f"qweight shape {qw.qweight.shape} does not match shape {qw.shape}")
  if qw.scales.shape != (k // qw.group_size, n):
    raise ValueError(f"scales shape {qw.scales.shape} does not match groups {(k // qw.group_size, n)}")
  if not jnp.issubdtype(qw.scales.dtype, jnp.floating):
    raise TypeError(f"scales must be floating point, got {qw.scales.dtype}")
  if qw.zeros is not None and qw.zeros.dtype != jnp.int32:
    raise TypeError(f"zeros must be int32, got {qw.zeros.dtype}")
  if qw.zeros is not None and qw.zeros.shape != qw.scales.shape:
    raise ValueError(f"zeros shape {qw.zeros.shape} does not match scales {qw.scales.shape}")
  if qw.perm is not None:
    if not jnp.issubdtype(qw.perm.dtype, jnp.integer):
      raise TypeError(f"perm must be an integer array, got {qw.perm.dtype}")
    if qw.perm.shape != (k,):
      raise ValueError(f"perm must have shape {(k,)}, got {qw.perm.shape}")


def dequantize(qw: QuantizedWeight, *, dtype: Any = None) -> Float[Array, "K N"]:
  """Exact dequantization ``w[perm[i]] = (q[i] - z[g(i)]) * s[g(i)]`` in original row order.

  The product is formed in float32 (exact for codes < 2**8 and float32/bf16/f16 scales) and
  cast to ``dtype`` (default: the scales' dtype).

  Example:
    >>> qw = quant.rtn(w, bits=4, group_size=128)
    >>> w_hat = quant.dequantize(qw)          # same shape as w
  """
  check_quantized(qw)
  dtype = qw.scales.dtype if dtype is None else dtype
  k, n = qw.shape
  g = qw.group_size
  ct = jnp.promote_types(qw.scales.dtype, jnp.float32)
  q = qw.codes.reshape(k // g, g, n).astype(ct)
  z = qw.zero_points.astype(ct)[:, None, :]
  s = qw.scales.astype(ct)[:, None, :]
  w = ((q - z) * s).reshape(k, n)
  if qw.perm is not None:
    w = jnp.zeros_like(w).at[qw.perm].set(w)
  return w.astype(dtype)


# ----------------------------------------------------------------------------------------------
# Checkpoint converters (bit-exact)
# ----------------------------------------------------------------------------------------------

def _np(x):
  return np.asarray(x)


def to_gptq(qw: QuantizedWeight, *, version: int = 1) -> dict[str, np.ndarray]:
  """Our layout -> GPTQ tensors ``qweight, qzeros, scales, g_idx`` (NumPy, rows in original order).

  ``version=1`` stores ``zero - 1`` (mod 2**bits) like AutoGPTQ's "gptq" format; 2 stores
  ``zero`` ("gptq_v2"). Supports bits 2, 4, 8 (a whole number of codes per int32).
  """
  check_quantized(qw)
  if version not in (1, 2):
    raise ValueError(f"version must be 1 or 2, got {version!r}")
  if 32 % qw.bits:
    raise NotImplementedError(f"GPTQ packing of {qw.bits}-bit codes is not supported (bits 2, 4, 8)")
  k, n = qw.shape
  if n % (32 // qw.bits):
    raise ValueError(f"N={n} must be divisible by {32 // qw.bits} to pack GPTQ qzeros")
  codes = qw.codes
  if qw.perm is not None:
    codes = jnp.zeros_like(codes).at[qw.perm].set(codes)
  mask = (1 << qw.bits) - 1
  z = qw.zero_points
  if version == 1:
    z = (z - 1) & mask
  return dict(qweight=_np(pack(codes, bits=8, width=qw.bits)),
              qzeros=_np(pack_cols(z, width=qw.bits)),
              scales=_np(qw.scales), g_idx=_np(qw.g_idx))


def from_gptq(qweight, qzeros, scales, g_idx=None, *, bits: int = 4, sym: bool = False,
              version: int = 1) -> QuantizedWeight:
  """GPTQ tensors -> QuantizedWeight. Inverse of ``to_gptq`` (bit-exact both ways).

  An act-order ``g_idx`` becomes ``perm = argsort(g_idx, stable)``; every group must then hold
  exactly ``K / G`` rows. ``sym=True`` requires every zero point to equal ``2**(bits-1)``.
  """
  if version not in (1, 2):
    raise ValueError(f"version must be 1 or 2, got {version!r}")
  _check_bits(bits)
  if 32 % bits:
    raise NotImplementedError(f"GPTQ packing of {bits}-bit codes is not supported (bits 2, 4, 8)")
  qweight, qzeros, scales = jnp.asarray(qweight), jnp.asarray(qzeros), jnp.asarray(scales)
  _check_words(qweight, "qweight")
  _check_words(qzeros, "qzeros")
  codes = unpack(qweight, bits=8, width=bits)
  k, n = codes.shape
  g = scales.shape[0]
  if scales.ndim != 2 or scales.shape[1] != n or g == 0 or k % g:
    raise ValueError(f"scales shape {scales.shape} does not fit qweight for K={k}, N={n}")
  z = unpack_cols(qzeros, width=bits)
  if z.shape != (g, n):
    raise ValueError(f"qzeros unpack to {z.shape}, expected {(g, n)}")
  if version == 1:
    z = (z + 1) & ((1 << bits) - 1)
  gs = k // g
  perm = None
  if g_idx is not None:
    g_idx = np.asarray(g_idx)
    if g_idx.shape != (k,):
      raise ValueError(f"g_idx must have shape {(k,)}, got {g_idx.shape}")
    if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= g):
      raise ValueError(f"g_idx must hold group ids in [0, {g}), got [{g_idx.min()}, "
                       f"{g_idx.max()}]")
    if not np.array_equal(g_idx, np.arange(k) // gs):
      order = np.argsort(g_idx, kind="stable")
      if not np.array_equal(g_idx[order], np.arange(k) // gs):
        raise NotImplementedError("g_idx groups of unequal size are not supported")
      perm = jnp.asarray(order, jnp.int32)
      codes = codes[perm]
  zeros = z
  if sym:
    if not bool((z == 2 ** (bits - 1)).all()):
      raise ValueError(f"sym=True but some zero points differ from {2 ** (bits - 1)}")
    zeros = None
  return QuantizedWeight.from_codes(codes, scales, zeros, bits=bits, group_size=gs, perm=perm)


def to_awq(qw: QuantizedWeight) -> dict[str, np.ndarray]:
  """Our layout -> AWQ GEMM tensors ``qweight [K, N/8], qzeros [G, N/8], scales [G, N]``."""
  check_quantized(qw)
  if qw.bits != 4:
    raise NotImplementedError(f"the AWQ GEMM layout is 4-bit only, got bits={qw.bits}")
  if qw.perm is not None:
    raise NotImplementedError("the AWQ layout has no act-order permutation")
  k, n = qw.shape
  if n % 8:
    raise ValueError(f"N={n} must be divisible by 8 for the AWQ layout")
  return dict(qweight=_np(_awq_pack(qw.codes)), qzeros=_np(_awq_pack(qw.zero_points)),
              scales=_np(qw.scales))


def from_awq(qweight, qzeros, scales) -> QuantizedWeight:
  """AWQ GEMM tensors -> QuantizedWeight (asymmetric 4-bit). Inverse of ``to_awq``."""
  qweight, qzeros, scales = jnp.asarray(qweight), jnp.asarray(qzeros), jnp.asarray(scales)
  _check_words(qweight, "qweight")
  _check_words(qzeros, "qzeros")
  codes, z = _awq_unpack(qweight), _awq_unpack(qzeros)
  k, n = codes.shape
  g = scales.shape[0]
  if scales.ndim != 2 or scales.shape[1] != n or g == 0 or k % g or z.shape != (g, n):
    raise ValueError(f"inconsistent AWQ shapes: qweight {qweight.shape}, qzeros {qzeros.shape}, "
                     f"scales {scales.shape}")
  return QuantizedWeight.from_codes(codes, scales, z, bits=4, group_size=k // g)


def _awq_pack(codes: jax.Array) -> jax.Array:
  k, n = codes.shape
  c = codes.reshape(k, n // 8, 8)[..., jnp.array(AWQ_ORDER)]   # nibble i <- column 8j + order[i]
  return _to_uint32_words(c.astype(jnp.uint32), 4)


def _awq_unpack(words: jax.Array) -> jax.Array:
  f = _from_words(words, 4)                                      # [K, N/8, 8] nibble order
  f = f[..., jnp.array(_AWQ_INVERSE)]
  return f.reshape(words.shape[0], -1).astype(jnp.int32)

r"""FP8 attention for inference: e4m3 Q, K, V with fine-grained scales and a Hadamard rotation.

FlashAttention-3 (Shah et al. 2024, Section 3.3) runs both matmuls of the forward on Hopper's
FP8 tensor cores (twice the bf16 rate) and keeps the error down with two tricks, both here:

* **Block quantisation.** Each block of tokens gets its own scale, so one outlier token does
  not cost the others their precision: ``x ~= x8 * s`` with ``s = amax(|x_block|) / 448``
  (448 is e4m3's largest finite value). Q gets one scale per token (``scale_block``, default
  1) and K one per 256 keys (``k_scale_block``). Where K's blocks are a multiple of the
  kernel's key block (64-256 keys; 256 serves every head dim's default tile), the key scale is
  one number per step and S's scaling :math:`s_{q,i} s_k` is one factor per row, folded with
  the softmax scale into the FMA of :math:`2^{c_i x - m_i}` (FA3's block quantisation; Q per
  token then costs nothing). Per-key scales (``k_scale_block=1``) cost one multiply per logit:
  the kernel measured 15% slower with them on the H200 (0.846 against 0.719 ms at
  4x4096x16x128) at the same error (V's rounding dominates it). V is scaled per channel (over
  the keys), so its scale multiplies the output once at the end.
* **Incoherent processing.** Q and K are multiplied by the same orthonormal Hadamard matrix
  :math:`\mathcal{H}` along the head dim before quantisation: :math:`(Q\mathcal{H})
  (K\mathcal{H})^\top = Q K^\top`, but the rotation spreads an outlier channel over all
  channels, so the per-token amax (and the rounding error relative to it) shrinks. FA3 reports
  2.6x lower error than plain per-tensor FP8 on inputs with outliers.

P is rounded to e4m3 inside the kernel (it lies in [0, 1]); its row sums, the softmax and O's
accumulation stay float32. Forward only: gradients raise NotImplementedError (train with
``flash_attention``).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_attn import api, fp8_layout, reference

log = logging.getLogger(__name__)

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
IMPLEMENTATIONS = ("mosaic", "xla")
ROTATION_BLOCK = 128           # the rotation runs as blocks of this many columns (combine_blocks)


class Fp8Tensor(NamedTuple):
  """``codes * scale`` ~= the tensor. codes: float8_e4m3fn; scale: float32, broadcast over the
  axes it lacks (see ``quantize_tokens`` / ``quantize_channels``)."""
  codes: jax.Array
  scale: jax.Array


@functools.lru_cache(maxsize=None)
def hadamard_signs(d: int) -> np.ndarray:
  """Sylvester's Hadamard matrix of order d (a power of two): its +-1 entries, float32 (the
  orthonormal rotation is this divided by sqrt(d))."""
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < d:
    h = np.block([[h, h], [h, -h]])
  return h


def hadamard(x: Float[Array, "... D"]) -> Float[Array, "... D"]:
  r"""``x @ H_D / sqrt(D)`` in float32: an orthonormal rotation of the last axis (D a power of
  two), its own inverse. :math:`(x\mathcal{H})\cdot(y\mathcal{H}) = x \cdot y`.

  Example:
    >>> q2 = hadamard(q)             # q [..., 128]; hadamard(q2) == q up to rounding
  """
  d = x.shape[-1]
  if d < 1 or d & (d - 1):
    raise ValueError(f"hadamard needs a power-of-two last axis, got {d}")
  r = min(d, ROTATION_BLOCK)
  signs = hadamard_signs(r)
  parts = [x[..., i * r:(i + 1) * r] for i in range(d // r)]
  if x.dtype in (jnp.bfloat16, jnp.float16):
    # 16-bit inputs times +-1 are exact products and the sum is float32, so one pass on the
    # tensor cores gives the float32 result; HIGHEST (float32 operands, several bf16 passes or
    # the CUDA cores) made this rotation most of the FP8 call's quantisation time on the H200.
    parts = [jnp.einsum("...d,de->...e", p, jnp.asarray(signs, x.dtype),
                        preferred_element_type=jnp.float32) for p in parts]
  else:
    parts = [jnp.einsum("...d,de->...e", p.astype(jnp.float32), jnp.asarray(signs),
                        precision=jax.lax.Precision.HIGHEST) for p in parts]
  y = jnp.concatenate(combine_blocks(parts), axis=-1) if len(parts) > 1 else parts[0]
  return y * np.float32(1.0 / np.sqrt(d))


def combine_blocks(parts: list) -> list:
  r"""Column blocks of :math:`x\mathcal{H}_d` from :math:`p_i = x_i \mathcal{H}_r` (x's i-th
  block of r columns): Sylvester's matrix is a Kronecker product, :math:`\mathcal{H}_d =
  \mathcal{H}_{d/r} \otimes \mathcal{H}_r`, so block j is :math:`\sum_i
  (\mathcal{H}_{d/r})_{ij}\, p_i`, summed in order of i (the fused Triton pass adds in the
  same order, so both round alike)."""
  small = hadamard_signs(len(parts))
  out = []
  for j in range(len(parts)):
    y = parts[0]
    for i in range(1, len(parts)):
      y = y + parts[i] if small[i, j] > 0 else y - parts[i]
    out.append(y)
  return out


def _to_codes(x, scale):
  safe = jnp.where(scale > 0, scale, 1.0)
  return jnp.clip(x / safe, -E4M3_MAX, E4M3_MAX).astype(E4M3), safe


def quantize_tokens(x: Float[Array, "B L N H"], *, block: int = 1,
                    valid: Array | None = None) -> Fp8Tensor:
  """e4m3 codes of ``x`` with one scale per ``block`` consecutive tokens and head:
  ``scale[b, n, l] = amax(|x[b, block of l, n, :]|) / 448`` (1 where the block is all zero).

  valid: optional bool ``[B, L]``; tokens outside it are zeroed first (padding may hold
  anything, NaN included) and do not count towards their block's amax.
  Returns ``Fp8Tensor(codes [B, L, N, H], scale [B, N, L])``.
  """
  if not isinstance(block, int) or block < 1:
    raise ValueError(f"block must be a positive int, got {block!r}")
  x = x.astype(jnp.float32)
  if valid is not None:
    x = jnp.where(valid[:, :, None, None], x, 0.0)
  amax = jnp.max(jnp.abs(x), axis=-1)                              # [B, L, N]
  if block > 1:
    b, l, n = amax.shape
    padded = -(-l // block) * block
    blocks = jnp.pad(amax, ((0, 0), (0, padded - l), (0, 0))).reshape(b, -1, block, n)
    amax = jnp.repeat(blocks.max(axis=2), block, axis=1)[:, :l]
  codes, scale = _to_codes(x, (amax / E4M3_MAX)[..., None])
  return Fp8Tensor(codes, jnp.transpose(scale[..., 0], (0, 2, 1)))


def quantize_channels(v: Float[Array, "B S K H"], *, valid: Array | None = None) -> Fp8Tensor:
  """e4m3 codes of ``v`` with one scale per (batch, head, channel) over the tokens in ``valid``
  (bool ``[B, S]``; the rest are zeroed). Returns ``Fp8Tensor(codes [B, S, K, H],
  scale [B, K, H])``."""
  v = v.astype(jnp.float32)
  if valid is not None:
    v = jnp.where(valid[:, :, None, None], v, 0.0)
  codes, scale = _to_codes(v, jnp.max(jnp.abs(v), axis=1, keepdims=True) / E4M3_MAX)
  return Fp8Tensor(codes, scale[:, 0])


def dequantize(x: Fp8Tensor, *, per: str) -> jax.Array:
  """float32 ``codes * scale``; ``per`` = "token" (scale [B, N, L]) or "channel" ([B, K, H])."""
  scale = jnp.transpose(x.scale, (0, 2, 1))[..., None] if per == "token" else x.scale[:, None]
  return x.codes.astype(jnp.float32) * scale


def _padded_dim(h: int, use_hadamard: bool) -> int:
  """The head dim the codes have: a power of two for the rotation, else h."""
  return 1 << max(h - 1, 0).bit_length() if use_hadamard else h


def _pad(x, d: int):
  h = x.shape[-1]
  return x if d == h else jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, d - h)))


def _quantize_rows(x, lengths, *, rotate: bool, d: int, block: int, fused: bool,
                   interpret: bool | None) -> Fp8Tensor:
  """Q or K: padded to d, rotated with ``rotate``, quantised per ``block`` tokens; tokens at or
  past ``lengths`` (clipped, or None) zeroed. ``fused``: one Pallas Triton pass where it serves
  x (``pallas_attn.triton.fp8_quantize``: the same codes), else XLA."""
  x = _pad(x, d)
  if fused:
    from pallas_attn.triton import fp8_quantize as fq   # pylint: disable=import-outside-toplevel
    if fq.supported(head_dim=d, dtype=x.dtype, scale_block=block):
      return Fp8Tensor(*fq.quantize(
          x, lengths, rotate=rotate, scale_block=block,
          interpret=jax.default_backend() != "gpu" if interpret is None else bool(interpret)))
  if rotate:
    # The rotation's float32 result goes back to a 16-bit input's dtype: e4m3 keeps 3 of
    # bf16's 8 mantissa bits, so the double rounding costs nothing measurable, and the
    # quantisation pass reads 2 bytes an element instead of 4 (twice: amax, then codes).
    x = hadamard(x).astype(x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32)
  valid = None if lengths is None else jnp.arange(x.shape[1])[None, :] < lengths[:, None]
  return quantize_tokens(x, block=block, valid=valid)


def quantize_inputs(q, k, v, *, use_hadamard: bool = True, scale_block: int = 1,
                    k_scale_block: int | None = 256, kv_lengths=None, fused: bool = False,
                    interpret: bool | None = None) -> tuple[Fp8Tensor, Fp8Tensor, Fp8Tensor]:
  """The FP8 inputs of ``flash_attention_fp8``: Q and K rotated (``use_hadamard``; the head dim
  zero-padded to a power of two, as is V's) and quantised per ``scale_block`` tokens (K per
  ``k_scale_block``, None: the same), V per channel. Keys at or past ``kv_lengths`` are
  zeroed. ``fused``: Q and K each in one Pallas Triton pass (rotation, amax and codes
  together, ``pallas_attn.triton.fp8_quantize``; the same codes), where it serves them (16-bit
  inputs, blocks of 1 or a power of two up to 256), else XLA; ``interpret`` None: on a CPU."""
  d = _padded_dim(q.shape[-1], use_hadamard)
  qf = _quantize_rows(q, None, rotate=bool(use_hadamard), d=d, block=scale_block,
                      fused=fused, interpret=interpret)
  kv = quantize_kv(k, v, use_hadamard=use_hadamard,
                   k_scale_block=scale_block if k_scale_block is None else k_scale_block,
                   kv_lengths=kv_lengths, fused=fused, v_layout="bskd", interpret=interpret)
  return qf, kv.k, kv.v


V_LAYOUTS = ("kernel", "bskd")


@functools.partial(jax.tree_util.register_dataclass, data_fields=("k", "v", "kv_lengths"),
                   meta_fields=("head_dim", "rotated", "k_scale_block", "v_layout"))
@dataclasses.dataclass(frozen=True)
class QuantizedKV:
  """K and V in e4m3, quantised once (``quantize_kv``) for many ``flash_attention_fp8_kv``
  calls: a prompt's keys and values reused across queries, cross-attention's memory. A pytree
  (it passes through ``jax.jit``); ``head_dim`` (before padding), ``rotated``,
  ``k_scale_block`` and ``v_layout`` are static.

  k: codes [B, S, K, D] (rotated by the Hadamard matrix when ``rotated``) and scale [B, K, S];
  v: scale [B, K, D] (per channel) and codes [B, S, K, D] (``v_layout`` "bskd") or, as the
  Mosaic kernel reads them (``v_layout`` "kernel", the default of ``quantize_kv``),
  [B, K, D, S16]: transposed, keys padded to a multiple of 16 and permuted in 16-key groups
  (``pallas_attn.fp8_layout``); ``v_bskd()`` gives them back as [B, S, K, D]. D: head_dim,
  padded to a power of two when rotated. kv_lengths: int32 [B] (clipped to S) if quantised
  with them, else None; ``flash_attention_fp8_kv`` masks with them unless given others."""
  k: Fp8Tensor
  v: Fp8Tensor
  head_dim: int
  rotated: bool
  k_scale_block: int
  kv_lengths: jax.Array | None = None
  v_layout: str = "bskd"

  def v_bskd(self) -> Fp8Tensor:
    """V's codes as [B, S, K, D] whatever ``v_layout`` is (a copy for "kernel")."""
    if self.v_layout == "bskd":
      return self.v
    return Fp8Tensor(fp8_layout.bskd_v_layout(self.v.codes, num_keys=self.k.codes.shape[1]),
                     self.v.scale)


def quantize_kv(k: Float[Array, "B S K H"], v: Float[Array, "B S K H"], *,
                use_hadamard: bool = True, k_scale_block: int = 256,
                kv_lengths: Int[Array, "B"] | None = None, fused: bool = False,
                v_layout: str = "kernel", interpret: bool | None = None) -> QuantizedKV:
  r"""K and V for ``flash_attention_fp8_kv``, quantised once: :math:`K' = \mathrm{q8}(K
  \mathcal{H})` with one scale per ``k_scale_block`` keys (a multiple of the kernel's key
  block, as the default 256, lets the kernel scale S per row only) and :math:`V' =
  \mathrm{q8}(V)` with one scale per channel over the keys. Keys at or past ``kv_lengths`` are
  zeroed and do not count towards any scale; the QuantizedKV keeps them, and
  ``flash_attention_fp8_kv`` masks with them by default.
  ``fused``: K's rotation, amax and codes in one Pallas Triton pass (opt-in: see
  ``flash_attention_fp8``'s ``fused_quantize``). ``v_layout``: "kernel" keeps V's codes in
  the Mosaic kernel's layout (transposed, keys permuted; saves ~0.023 ms a call at 2^25
  elements on the H200, 3-9% of an fp8-kv call), "bskd" as [B, S, K, D] (see QuantizedKV).

  The scales span many keys (V's all of them), so appending keys later means quantising again.

  Example:
    >>> kv = quantize_kv(k, v)                       # once
    >>> out = flash_attention_fp8_kv(q, kv)          # per query block, Q quantised per call
  """
  for name, x in (("k", k), ("v", v)):
    if getattr(x, "ndim", None) != 4:
      raise ValueError(f"{name} must be rank 4 [B, S, K, H], got shape "
                       f"{getattr(x, 'shape', type(x))}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
  if not isinstance(k_scale_block, int) or isinstance(k_scale_block, bool) or k_scale_block < 1:
    raise ValueError(f"k_scale_block must be a positive int, got {k_scale_block!r}")
  if v_layout not in V_LAYOUTS:
    raise ValueError(f"v_layout must be one of {V_LAYOUTS}, got {v_layout!r}")
  h = k.shape[-1]
  d = _padded_dim(h, bool(use_hadamard))
  lengths = None if kv_lengths is None else jnp.clip(kv_lengths, 0, k.shape[1])
  valid = None if lengths is None else jnp.arange(k.shape[1])[None, :] < lengths[:, None]
  kf = _quantize_rows(k, lengths, rotate=bool(use_hadamard), d=d, block=k_scale_block,
                      fused=fused, interpret=interpret)
  vf = quantize_channels(_pad(v, d), valid=valid)
  if v_layout == "kernel":
    vf = Fp8Tensor(fp8_layout.kernel_v_layout(vf.codes), vf.scale)
  return QuantizedKV(k=kf, v=vf, head_dim=h, rotated=bool(use_hadamard),
                     k_scale_block=k_scale_block,
                     kv_lengths=None if lengths is None else lengths.astype(jnp.int32),
                     v_layout=v_layout)


def _xla_backend(qf, kf, vf, *, out_dtype, return_lse, config, interpret, k_scale_block,
                 **masks):
  """Reference semantics: the dequantised inputs in float32 through ``reference.attention``
  (P is not rounded to e4m3 here, unlike the kernel)."""
  del interpret, k_scale_block
  if config is not None:
    raise NotImplementedError("the xla backend takes no config")
  res = reference.attention(dequantize(qf, per="token"), dequantize(kf, per="token"),
                            dequantize(vf, per="channel"), return_lse=return_lse,
                            accumulate_f32=True, precision=jax.lax.Precision.HIGHEST, **masks)
  if return_lse:
    return res[0].astype(out_dtype), res[1]
  return res.astype(out_dtype)


def _mosaic_backend(qf, kv: QuantizedKV, **kwargs):
  try:
    module = importlib.import_module("pallas_attn.mosaic.fp8")
  except ImportError as e:
    raise NotImplementedError(f"pallas_attn.mosaic.fp8 does not import: {e}") from e
  return module.attention(qf.codes, qf.scale, kv.k.codes, kv.k.scale, kv.v.codes, kv.v.scale,
                          v_in_key_order=kv.v_layout == "kernel", **kwargs)


@jax.custom_vjp
def _forward_only(x):
  return x


def _forward_only_fwd(x):
  return x, None


def _forward_only_bwd(_, g):
  raise NotImplementedError("flash_attention_fp8 is forward only (inference); for gradients "
                            "use pallas_attn.flash_attention")


_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd)


def flash_attention_fp8(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    kv_lengths: Int[Array, "B"] | None = None,
    return_lse: bool = False,
    use_hadamard: bool = True,
    scale_block: int = 1,
    k_scale_block: int | None = 256,
    fused_quantize: bool = False,
    implementation: str | None = None,
    config: Any = None,
    interpret: bool | None = None,
):
  r"""``flash_attention``'s forward on FP8 (e4m3) Q, K, V: same arguments, masks and layout.

  .. math::
     Q' = \mathrm{q8}(Q\mathcal{H}),\; K' = \mathrm{q8}(K\mathcal{H}),\; V' = \mathrm{q8}(V),
     \quad \mathrm{out} = \mathrm{softmax}(\mathrm{scale}\; Q' K'^\top) V'

  with per-``scale_block``-token scales for Q, per-``k_scale_block``-key scales for K (None:
  ``scale_block``; a multiple of the kernel's key block, as the default 256, lets it scale S
  per row only: see the module docstring), per-channel scales for V and the rotation
  :math:`\mathcal{H}` only with ``use_hadamard``. The quantisation runs before the kernel, in
  XLA (three passes over each of Q and K), or with ``fused_quantize`` in one Pallas Triton
  pass each (``quantize_inputs``): on an H100 that took the end-to-end overhead from
  0.28-0.31 to 0.18-0.19 ms at 2^25 elements a tensor, but it stays opt-in because a GPU hang
  was seen with it (``flash_attention_fp8_kv`` at 16x1024x16x128, session 26;
  benchmarks/NOTES.md). "mosaic" (Hopper) runs both matmuls on the FP8 tensor cores; "xla"
  computes the same attention of the dequantised inputs in float32 (the kernel also rounds P
  to e4m3). None picks "mosaic" on a Hopper GPU, else "xla".

  Returns ``out [B, T, N, H]`` in q's dtype (and ``lse [B, N, T]`` float32). Forward only:
  differentiating through it raises NotImplementedError. The Mosaic kernel is tested in
  interpret mode and compiled on Hopper (``tests/pallas_attn/test_fp8.py``). Speed (H100,
  session 26, one process): the kernel is 1.05-1.4x our bf16 forward on long rows
  (1x16384x16x128 full 2.29 against 3.24 ms); end to end with XLA's quantisation 1.28x there
  but 0.82x at 4x4096x16x128. Where K and V are reused across calls, quantise them once
  (``quantize_kv``, ``flash_attention_fp8_kv``).

  Example:
    >>> out = flash_attention_fp8(q, k, v, causal=True)     # q, k, v bf16, as flash_attention
    >>> out = flash_attention_fp8(q, k, v, k_scale_block=1)   # a scale per key (slower)
  """
  api.check_inputs(q, k, v, scale=scale, window=window, softcap=softcap,
                   q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                   kv_lengths=kv_lengths, implementation=None)
  _check_blocks(scale_block=scale_block, k_scale_block=k_scale_block)
  k_scale_block = scale_block if k_scale_block is None else k_scale_block
  d = _padded_dim(q.shape[-1], bool(use_hadamard))
  fused = bool(fused_quantize)
  q, k, v = (_forward_only(x) for x in (q, k, v))
  qf = _quantize_rows(q, None, rotate=bool(use_hadamard), d=d, block=scale_block, fused=fused,
                      interpret=interpret)
  # V straight into the kernel's layout when the kernel may run (its quantisation pass then
  # writes it transposed); the xla backend reads [B, S, K, D].
  xla_only = implementation == "xla" or (implementation is None
                                         and jax.default_backend() != "gpu")
  kv = quantize_kv(k, v, use_hadamard=bool(use_hadamard), k_scale_block=k_scale_block,
                   kv_lengths=kv_lengths, fused=fused, interpret=interpret,
                   v_layout="bskd" if xla_only else "kernel")
  return _attend(qf, kv, out_dtype=q.dtype, causal=causal, scale=scale, window=window,
                 softcap=softcap, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                 kv_lengths=kv_lengths, return_lse=return_lse, implementation=implementation,
                 config=config, interpret=interpret)


def flash_attention_fp8_kv(
    q: Float[Array, "B T N H"],
    kv: QuantizedKV,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    kv_lengths: Int[Array, "B"] | None = None,
    return_lse: bool = False,
    scale_block: int = 1,
    fused_quantize: bool = False,
    implementation: str | None = None,
    config: Any = None,
    interpret: bool | None = None,
):
  r"""``flash_attention_fp8`` with K and V quantised beforehand (``quantize_kv``): only Q is
  quantised per call (rotated as K was, per ``scale_block`` tokens), so a prompt's keys and
  values, or cross-attention's memory, pay their quantisation once. The arguments and the
  result are ``flash_attention_fp8``'s; ``kv_lengths`` None takes the ones ``kv`` was
  quantised with (``kv.kv_lengths``: keys past them were zeroed there and are masked here).

  Example:
    >>> kv = quantize_kv(k, v)                               # k, v bf16 [B, S, K, H], once
    >>> out = flash_attention_fp8_kv(q, kv, causal=True)     # q bf16 [B, T, N, H], per call
  """
  if not isinstance(kv, QuantizedKV):
    raise ValueError(f"kv must be a QuantizedKV (from quantize_kv), got {type(kv).__name__}")
  kv_lengths = kv.kv_lengths if kv_lengths is None else kv_lengths
  b, s, kh, _ = kv.k.codes.shape
  shape = jax.ShapeDtypeStruct((b, s, kh, kv.head_dim), getattr(q, "dtype", jnp.float32))
  api.check_inputs(q, shape, shape, scale=scale, window=window, softcap=softcap,
                   q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                   kv_lengths=kv_lengths, implementation=None)
  _check_blocks(scale_block=scale_block, k_scale_block=kv.k_scale_block)
  d = kv.k.codes.shape[-1]
  qf = _quantize_rows(_forward_only(q), None, rotate=kv.rotated, d=d, block=scale_block,
                      fused=bool(fused_quantize), interpret=interpret)
  return _attend(qf, kv, out_dtype=q.dtype, causal=causal, scale=scale, window=window,
                 softcap=softcap, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                 kv_lengths=kv_lengths, return_lse=return_lse, implementation=implementation,
                 config=config, interpret=interpret)


def _check_blocks(*, scale_block, k_scale_block):
  for name, value in (("scale_block", scale_block), ("k_scale_block", k_scale_block)):
    if name == "k_scale_block" and value is None:
      continue
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")


def _attend(qf: Fp8Tensor, kv: QuantizedKV, *, out_dtype, causal, scale, window, softcap,
            q_segment_ids, kv_segment_ids, kv_lengths, return_lse, implementation, config,
            interpret):
  """The attention of quantised inputs on the first backend that serves it."""
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, "
                     f"got {implementation!r}")
  h = kv.head_dim
  kwargs = dict(out_dtype=out_dtype, causal=bool(causal),
                scale=h ** -0.5 if scale is None else float(scale),
                window=None if window is None else tuple(
                    None if w is None else int(w) for w in window),
                softcap=None if softcap is None else float(softcap),
                q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                kv_lengths=kv_lengths, return_lse=return_lse, config=config,
                k_scale_block=kv.k_scale_block)
  on_gpu = jax.default_backend() == "gpu"
  order = (implementation,) if implementation else (("mosaic", "xla") if on_gpu else ("xla",))
  errors = []
  for name in order:
    try:
      if name == "mosaic":
        res = _mosaic_backend(qf, kv, interpret=(not on_gpu) if interpret is None else interpret,
                              **kwargs)
      else:
        res = _xla_backend(qf, kv.k, kv.v_bskd(), interpret=interpret, **kwargs)
    except NotImplementedError as e:
      if implementation is not None:
        raise
      log.debug("flash_attention_fp8: backend %s declined: %s", name, e)
      errors.append(f"{name}: {e}")
      continue
    out, lse = res if return_lse else (res, None)
    out = out[..., :h]
    return (out, lse) if return_lse else out
  raise NotImplementedError("no backend served the call: " + "; ".join(errors))

"""``plgpu.kernel`` wrapper, padding and custom VJP of the Mosaic GPU (FlashAttention-3) backend.

Forward: ``kernels.fwd_kernel`` (TMA ring + two ping-ponging wgmma consumers). Backward, for now:
the FlashAttention-2 kernels of the Triton backend on the same residuals (out, lse), through
``pallas_attn.triton.ops.backward``; a Mosaic GPU backward is the next step (benchmarks/NOTES.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import masks
from pallas_attn.mosaic import autotune, kernels
from pallas_attn.mosaic.config import Config, default_config, padded_head_dim
from pallas_attn.triton import ops as triton_ops

SMEM_LIMIT_BYTES = 227 * 1024
_DTYPES = (jnp.bfloat16, jnp.float16)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def attention(q, k, v, *, causal, scale, window, softcap, q_segment_ids, kv_segment_ids,
              kv_lengths, return_lse, config, interpret):
  """Mosaic GPU backend entry point (called by ``pallas_attn.api.flash_attention``).

  Raises NotImplementedError (dispatch then falls back) for float32 (wgmma would compute in TF32),
  head dims over 256, a foreign config, a tile set over shared memory, or when not on a Hopper GPU
  and not in interpret mode.
  """
  hp = padded_head_dim(q.shape[-1])                 # NotImplementedError over 256
  if q.dtype not in _DTYPES:
    raise NotImplementedError(f"mosaic backend takes bfloat16/float16, got {q.dtype} (wgmma on "
                              "float32 would round to TF32)")
  if not interpret and not _on_hopper():
    raise NotImplementedError("mosaic backend needs a Hopper GPU (sm90) or interpret=True")
  b, t, n, h = q.shape
  s = k.shape[1]
  if config is None:
    # A winner of autotune.tune for this problem class, else the heuristic.
    cfg = (autotune.lookup(head_dim=h, seq_k=s, causal=causal, dtype=q.dtype)
           or default_config(head_dim=h, seq_k=s))
  elif isinstance(config, Config):
    cfg = config
  else:
    raise NotImplementedError(f"config of type {type(config).__name__} is not a mosaic Config")
  if kv_lengths is not None:
    # Keys past a row's length may hold anything (NaN padding); P is 0 there but 0 * NaN is not.
    valid = jnp.arange(s)[None, :] < jnp.clip(kv_lengths, 0, s)[:, None]
    v = jnp.where(valid[:, :, None, None], v, jnp.zeros((), v.dtype))
  fn = functools.partial(
      _attention, causal=causal, scale=h ** -0.5 if scale is None else scale, window=window,
      softcap=softcap, cfg=cfg, head_dim_padded=hp, interpret=interpret)
  out, lse = fn(q, k, v, q_segment_ids, kv_segment_ids, kv_lengths)
  return (out, lse) if return_lse else out


def _on_hopper() -> bool:
  try:
    return any(getattr(d, "compute_capability", "") == "9.0" for d in jax.devices("gpu"))
  except RuntimeError:
    return False


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12))
def _attention(q, k, v, q_seg, kv_seg, kv_lengths, causal, scale, window, softcap, cfg,
               head_dim_padded, interpret):
  return _forward(q, k, v, q_seg, kv_seg, kv_lengths, causal=causal, scale=scale, window=window,
                  softcap=softcap, cfg=cfg, hp=head_dim_padded, interpret=interpret)


def _attention_fwd(q, k, v, q_seg, kv_seg, kv_lengths, causal, scale, window, softcap, cfg,
                   head_dim_padded, interpret):
  out, lse = _forward(q, k, v, q_seg, kv_seg, kv_lengths, causal=causal, scale=scale,
                      window=window, softcap=softcap, cfg=cfg, hp=head_dim_padded,
                      interpret=interpret)
  return (out, lse), (q, k, v, q_seg, kv_seg, kv_lengths, out, lse)


def _attention_bwd(causal, scale, window, softcap, cfg, head_dim_padded, interpret, res, cts):
  del cfg, head_dim_padded
  q, k, v, q_seg, kv_seg, kv_lengths, out, lse = res
  do, dlse = cts
  dq, dk, dv = triton_ops.backward(
      q, k, v, out, lse, do, dlse, causal=causal, scale=scale, window=window, softcap=softcap,
      q_segment_ids=q_seg, kv_segment_ids=kv_seg, kv_lengths=kv_lengths,
      interpret=bool(interpret))
  return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _forward(q, k, v, q_seg, kv_seg, kv_lengths, *, causal, scale, window, softcap, cfg: Config,
             hp: int, interpret):
  """Pads to the CTA tile (2 * block_q rows, block_kv keys, hp lanes), runs the kernel, unpads."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  cta_q = kernels.COMPUTE_WGS * cfg.block_q
  tq, tk = _round_up(t, cta_q), _round_up(s, cfg.block_kv)
  left, right = masks.canonical_window(causal=causal, window=window)
  spec = masks.MaskSpec(left=left, right=right, offset=s - t)
  has_kv_len = kv_lengths is not None or tk != s
  st = kernels.Statics(
      scale=scale, softcap=softcap, spec=spec, has_kv_len=has_kv_len,
      has_segments=q_seg is not None, groups=n // kh, block_q=cfg.block_q,
      block_kv=cfg.block_kv, num_stages=cfg.num_stages, num_kv_blocks=tk // cfg.block_kv,
      registers_pv=not interpret)
  smem = kernels.smem_bytes(st=st, head_dim=hp, itemsize=q.dtype.itemsize)
  if smem > SMEM_LIMIT_BYTES:
    raise NotImplementedError(f"mosaic config needs ~{smem // 1024} KB of shared memory at head "
                              f"dim {hp} (limit {SMEM_LIMIT_BYTES // 1024} KB)")

  def pad(x, length):
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, hp - h)))

  inputs = [pad(q, tq), pad(k, tk), pad(v, tk)]
  has_meta = st.any_mask
  if has_meta:
    kv_len = (jnp.full((b,), s, jnp.int32) if kv_lengths is None
              else jnp.clip(kv_lengths.astype(jnp.int32), 0, s))
    ranges = masks.kv_block_ranges(spec=spec, seq_q=t, seq_k=s, block_q=cta_q,
                                   block_k=cfg.block_kv, batch=b, kv_lengths=kv_len,
                                   q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    ranges = jnp.pad(ranges, ((0, 0), (0, tq // cta_q - ranges.shape[1]), (0, 0)))
    extra = jnp.zeros(ranges.shape[:2] + (kernels.META_LEN - 5,), jnp.int32)
    meta = jnp.concatenate(
        [ranges, jnp.broadcast_to(kv_len[:, None, None], ranges.shape[:2] + (1,)), extra], -1)
    inputs.append(meta)
  if st.has_segments:
    inputs.append(jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, tq - t)), constant_values=-1))
    inputs.append(jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, tk - s)), constant_values=-2))

  # Inside shard_map(check_vma=True) the outputs must vary over q's mesh axes, and every operand
  # over the same ones (as in the Triton backend).
  axes = frozenset().union(*(triton_ops._vma(x) for x in inputs))
  if axes:
    inputs = triton_ops._match_vma(inputs, axes)
  smem_types, bar_types = kernels.scratch_types(st=st, head_dim=hp, dtype=q.dtype,
                                                has_meta=has_meta)
  out, lse = plgpu.kernel(
      functools.partial(kernels.fwd_kernel, st=st, has_meta=has_meta),
      out_type=(jax.ShapeDtypeStruct((b, tq, n, hp), q.dtype),
                jax.ShapeDtypeStruct((b, n, tq), jnp.float32)),
      scratch_types=(smem_types, bar_types),
      grid=(n, tq // cta_q, b),
      grid_names=("heads", "q_seq", "batch"),
      num_threads=kernels.COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(*inputs)
  if axes:
    # plgpu.kernel traces its body with the vma check off and returns non-varying types: mark the
    # outputs as varying like the inputs they are computed from.
    out, lse = triton_ops._match_vma([out, lse], axes)
  return out[:, :t, :, :h], lse[:, :, :t]

"""``pallas_call`` wrappers, padding and the custom VJP of the Triton FlashAttention-2 backend."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn import masks
from pallas_attn.vma import match_vma, out_struct, vma
from pallas_attn.triton import kernels
from pallas_attn.triton.config import (SMEM_LIMIT_BYTES, Config, default_config, fit_to_lengths,
                                       forward_smem_bytes)

MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything static about one call: shapes after padding, tiles, kernel statics."""
  st: kernels.Statics
  cfg: Config
  batch: int
  heads: int
  kv_heads: int
  seq_q: int          # padded T
  seq_k: int          # padded S
  head_dim: int       # padded H
  interpret: bool


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _pow2(n: int, floor: int = 16) -> int:
  p = floor
  while p < n:
    p *= 2
  return p


def attention(q, k, v, *, causal, scale, window, softcap, q_segment_ids, kv_segment_ids,
              kv_lengths, return_lse, config, interpret):
  """Triton backend entry point (called by ``pallas_attn.api.flash_attention``)."""
  plan, args, ranges = _prepare(q, k, v, causal=causal, scale=scale, window=window,
                                softcap=softcap, q_segment_ids=q_segment_ids,
                                kv_segment_ids=kv_segment_ids, kv_lengths=kv_lengths,
                                config=config, interpret=interpret)
  qp, kp, vp, kv_len2d, q_seg, kv_seg = args
  out, lse = _flash(qp, kp, vp, ranges, kv_len2d, q_seg, kv_seg, plan)
  t, h = q.shape[1], q.shape[3]
  out = out[:, :t, :, :h]
  lse = lse[:, :, :t]
  return (out, lse) if return_lse else out


def backward(q, k, v, out, lse, do, dlse, *, causal, scale, window, softcap, q_segment_ids,
             kv_segment_ids, kv_lengths, config=None, interpret=False):
  """dQ, dK, dV of attention from saved (out, lse): the FA2 backward kernels on their own.

  Used by backends whose forward differs (the Mosaic GPU forward saves the same residuals:
  out [B, T, N, H] and lse [B, N, T] in natural log). ``dlse`` may be None.
  """
  plan, args, ranges = _prepare(q, k, v, causal=causal, scale=scale, window=window,
                                softcap=softcap, q_segment_ids=q_segment_ids,
                                kv_segment_ids=kv_segment_ids, kv_lengths=kv_lengths,
                                config=config, interpret=interpret)
  qp, kp, vp, kv_len2d, q_seg, kv_seg = args
  t, h = q.shape[1], q.shape[3]
  pad_rows = ((0, 0), (0, plan.seq_q - t), (0, 0), (0, plan.head_dim - h))
  outp = jnp.pad(out, pad_rows)
  dop = jnp.pad(do.astype(q.dtype), pad_rows)
  # Padding rows: lse = -inf makes their P zero; their dO and dlse are zero.
  lsep = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, plan.seq_q - t)),
                 constant_values=-jnp.inf)
  dlsep = (jnp.zeros_like(lsep) if dlse is None else
           jnp.pad(dlse.astype(jnp.float32), ((0, 0), (0, 0), (0, plan.seq_q - t))))
  res = (qp, kp, vp, ranges, kv_len2d, q_seg, kv_seg, outp, lsep)
  dq, dk, dv, *_ = _flash_bwd(plan, res, (dop, dlsep))
  s = k.shape[1]
  return dq[:, :t, :, :h], dk[:, :s, :, :h], dv[:, :s, :, :h]


def _prepare(q, k, v, *, causal, scale, window, softcap, q_segment_ids, kv_segment_ids,
             kv_lengths, config, interpret):
  """Plan (tiles, statics), padded operands and block ranges of one call."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  if h > MAX_HEAD_DIM:
    raise NotImplementedError(f"triton backend supports head_dim <= {MAX_HEAD_DIM}, got {h}")
  if config is None:
    cfg = default_config(head_dim=h, seq_q=t, seq_k=s, itemsize=q.dtype.itemsize)
  elif isinstance(config, Config):
    cfg = fit_to_lengths(config, seq_q=t, seq_k=s)
  else:
    raise NotImplementedError(f"config of type {type(config).__name__} is not a triton Config")
  smem = forward_smem_bytes(cfg, head_dim=h, itemsize=q.dtype.itemsize)
  if smem > SMEM_LIMIT_BYTES and not interpret:
    raise NotImplementedError(f"config needs ~{smem // 1024} KB of shared memory for head_dim {h} "
                              f"(limit {SMEM_LIMIT_BYTES // 1024} KB): lower block_q/block_k/num_stages")
  left, right = masks.canonical_window(causal=causal, window=window)
  spec = masks.MaskSpec(left=left, right=right, offset=s - t)
  tq = _round_up(t, max(cfg.block_q, cfg.block_q_dkv, cfg.block_q_dq))
  tk = _round_up(s, max(cfg.block_k, cfg.block_k_dkv, cfg.block_k_dq))
  hp = _pow2(h)
  has_kv_len = kv_lengths is not None or tk != s
  st = kernels.Statics(
      scale=h ** -0.5 if scale is None else scale, softcap=softcap, spec=spec,
      has_kv_len=has_kv_len, has_segments=q_segment_ids is not None, groups=n // kh,
      precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
  plan = _Plan(st=st, cfg=cfg, batch=b, heads=n, kv_heads=kh, seq_q=tq, seq_k=tk, head_dim=hp,
               interpret=bool(interpret))

  def pad(x, length):
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, hp - h)))

  kv_len = None
  if has_kv_len:
    kv_len = jnp.full((b,), s, jnp.int32) if kv_lengths is None else jnp.clip(
        kv_lengths.astype(jnp.int32), 0, s)
  q_seg = kv_seg = None
  if q_segment_ids is not None:
    q_seg = jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, tq - t)), constant_values=-1)
    kv_seg = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, tk - s)), constant_values=-2)
  ranges = _block_ranges(plan, seq_q=t, seq_k=s, kv_len=kv_len, q_seg=q_segment_ids,
                         kv_seg=kv_segment_ids)
  kv_len2d = None if kv_len is None else kv_len[:, None]
  args = [pad(q, tq), pad(k, tk), pad(v, tk), kv_len2d, q_seg, kv_seg]
  axes = frozenset().union(*(vma(x) for x in args + list(ranges or ()) if x is not None))
  if axes:
    args = match_vma(args, axes)
    ranges = None if ranges is None else tuple(match_vma(ranges, axes))
  return plan, args, ranges


def _block_ranges(plan: _Plan, *, seq_q, seq_k, kv_len, q_seg, kv_seg):
  """Loop bounds for the three kernels (None when no mask: loops then run over every block)."""
  if not plan.st.any_mask:
    return None
  cfg = plan.cfg
  common = dict(spec=plan.st.spec, seq_q=seq_q, seq_k=seq_k, batch=plan.batch,
                kv_lengths=kv_len, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
  fwd = masks.kv_block_ranges(block_q=cfg.block_q, block_k=cfg.block_k, **common)
  dq = masks.kv_block_ranges(block_q=cfg.block_q_dq, block_k=cfg.block_k_dq, **common)
  dkdv = masks.q_block_ranges(
      masks.kv_block_ranges(block_q=cfg.block_q_dkv, block_k=cfg.block_k_dkv, **common),
      num_k_blocks=plan.seq_k // cfg.block_k_dkv)
  return _pad_blocks(fwd, plan.seq_q // cfg.block_q), dkdv, _pad_blocks(
      dq, plan.seq_q // cfg.block_q_dq)


def _pad_blocks(r, nblocks):
  # Padding queries (past T) form extra Q blocks only when T was rounded up to a larger tile.
  return jnp.pad(r, ((0, 0), (0, nblocks - r.shape[1]), (0, 0)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, ranges, kv_len, q_seg, kv_seg, plan):
  return _forward(q, k, v, ranges, kv_len, q_seg, kv_seg, plan)


def _flash_fwd(q, k, v, ranges, kv_len, q_seg, kv_seg, plan):
  out, lse = _forward(q, k, v, ranges, kv_len, q_seg, kv_seg, plan)
  return (out, lse), (q, k, v, ranges, kv_len, q_seg, kv_seg, out, lse)


def _forward(q, k, v, ranges, kv_len, q_seg, kv_seg, plan: _Plan):
  cfg, st = plan.cfg, plan.st
  bq, bk = cfg.block_q, cfg.block_k
  nq = plan.seq_q // bq
  g = st.groups
  kernel = functools.partial(kernels.fwd_kernel, block_q=bq, block_k=bk,
                             num_k_blocks=plan.seq_k // bk, st=st)
  full_kv = pl.BlockSpec((None, plan.seq_k, None, plan.head_dim),
                         lambda i, b, n: (b, 0, n // g, 0))
  q_tile = pl.BlockSpec((None, bq, None, plan.head_dim), lambda i, b, n: (b, i, n, 0))
  in_specs = [
      None if ranges is None else pl.BlockSpec((None, None, 4), lambda i, b, n: (b, i, 0)),
      None if kv_len is None else pl.BlockSpec((None, 1), lambda i, b, n: (b, 0)),
      None if q_seg is None else pl.BlockSpec((None, bq), lambda i, b, n: (b, i)),
      None if kv_seg is None else pl.BlockSpec((None, plan.seq_k), lambda i, b, n: (b, 0)),
      q_tile, full_kv, full_kv,
  ]
  out, lse = pl.pallas_call(
      kernel,
      grid=(nq, plan.batch, plan.heads),
      in_specs=in_specs,
      out_specs=[q_tile, pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))],
      out_shape=[out_struct(q.shape, q.dtype, q),
                 out_struct((plan.batch, plan.heads, plan.seq_q), jnp.float32, q)],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=plan.interpret,
      name="flash_attention_fwd",
  )(None if ranges is None else ranges[0], kv_len, q_seg, kv_seg, q, k, v)
  return out, lse


def _delta(do, out, dlse, plan: _Plan):
  """D = rowsum(dO * O) - dlse as [B, N, T] float32, by kernels.delta_kernel."""
  bq = plan.cfg.block_q_dq
  tile = pl.BlockSpec((None, bq, None, plan.head_dim), lambda i, b, n: (b, i, n, 0))
  row = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))
  return pl.pallas_call(
      kernels.delta_kernel,
      grid=(plan.seq_q // bq, plan.batch, plan.heads),
      in_specs=[tile, tile, row],
      out_specs=row,
      out_shape=out_struct((plan.batch, plan.heads, plan.seq_q), jnp.float32, out),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=plan.interpret,
      name="flash_attention_delta",
  )(do, out, dlse)


def _flash_bwd(plan: _Plan, res, cotangents):
  q, k, v, ranges, kv_len, q_seg, kv_seg, out, lse = res
  do, dlse = cotangents
  cfg, st = plan.cfg, plan.st
  g = st.groups
  hp = plan.head_dim
  # Pre-pass D = rowsum(dO * O) (FA2 Alg. 2 line 4); a cotangent on lse adds to dS as -dlse.
  delta = _delta(do, out, dlse, plan)
  lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * kernels.LOG2E)   # empty rows: P = 0
  do = do.astype(q.dtype)

  # dK, dV: grid over K/V tiles, loop over the group's query heads and their Q tiles.
  bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
  nq, nk = plan.seq_q // bq, plan.seq_k // bk
  kv_tile = pl.BlockSpec((None, bk, None, hp), lambda j, b, h: (b, j, h, 0))
  all_q = pl.BlockSpec((None, plan.seq_q, plan.heads, hp), lambda j, b, h: (b, 0, 0, 0))
  rows = pl.BlockSpec((None, plan.heads, plan.seq_q), lambda j, b, h: (b, 0, 0))
  dk, dv = pl.pallas_call(
      functools.partial(kernels.dkdv_kernel, block_q=bq, block_k=bk, num_q_blocks=nq, st=st),
      grid=(nk, plan.batch, plan.kv_heads),
      in_specs=[
          None if ranges is None else pl.BlockSpec((None, None, 4), lambda j, b, h: (b, j, 0)),
          None if kv_len is None else pl.BlockSpec((None, 1), lambda j, b, h: (b, 0)),
          None if q_seg is None else pl.BlockSpec((None, plan.seq_q), lambda j, b, h: (b, 0)),
          None if kv_seg is None else pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
          all_q, kv_tile, kv_tile, all_q, rows, rows,
      ],
      out_specs=[kv_tile, kv_tile],
      out_shape=[out_struct(k.shape, k.dtype, k), out_struct(v.shape, v.dtype, v)],
      compiler_params=plgpu.CompilerParams(num_warps=cfg.bwd_num_warps,
                                           num_stages=cfg.bwd_num_stages),
      interpret=plan.interpret,
      name="flash_attention_dkdv",
  )(None if ranges is None else ranges[1], kv_len, q_seg, kv_seg, q, k, v, do, lse2, delta)

  # dQ: grid over Q tiles, loop over K/V tiles.
  bq, bk = cfg.block_q_dq, cfg.block_k_dq
  nq = plan.seq_q // bq
  q_tile = pl.BlockSpec((None, bq, None, hp), lambda i, b, n: (b, i, n, 0))
  full_kv = pl.BlockSpec((None, plan.seq_k, None, hp), lambda i, b, n: (b, 0, n // g, 0))
  row_tile = pl.BlockSpec((None, None, bq), lambda i, b, n: (b, n, i))
  dq = pl.pallas_call(
      functools.partial(kernels.dq_kernel, block_q=bq, block_k=bk,
                        num_k_blocks=plan.seq_k // bk, st=st),
      grid=(nq, plan.batch, plan.heads),
      in_specs=[
          None if ranges is None else pl.BlockSpec((None, None, 4), lambda i, b, n: (b, i, 0)),
          None if kv_len is None else pl.BlockSpec((None, 1), lambda i, b, n: (b, 0)),
          None if q_seg is None else pl.BlockSpec((None, bq), lambda i, b, n: (b, i)),
          None if kv_seg is None else pl.BlockSpec((None, plan.seq_k), lambda i, b, n: (b, 0)),
          q_tile, full_kv, full_kv, q_tile, row_tile, row_tile,
      ],
      out_specs=q_tile,
      out_shape=out_struct(q.shape, q.dtype, q),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.bwd_num_warps,
                                           num_stages=cfg.bwd_num_stages),
      interpret=plan.interpret,
      name="flash_attention_dq",
  )(None if ranges is None else ranges[2], kv_len, q_seg, kv_seg, q, k, v, do, lse2, delta)
  return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)

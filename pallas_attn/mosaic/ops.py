"""``plgpu.kernel`` wrapper, padding and custom VJP of the Mosaic GPU (FlashAttention-3) backend.

Forward: ``kernels.fwd_kernel`` (TMA ring + two ping-ponging wgmma consumers). Backward:
``backward_dq.dq_kernel`` and ``backward.dkdv_kernel`` (wgmma, deterministic GQA sums), or with
``Config.bwd_fused_dq`` the dK/dV kernel alone, dQ reduced into a float32 accumulator; at head
dims whose dK/dV tiles exceed shared memory (over 128), ``backward_split.dkdv_split_kernel``
(``Config.bwd_split_dkdv``, on in ``default_config`` there) and the dQ kernel with a shallower V
ring, or the Triton FA2 kernels on the same residuals where neither fits or they are not asked
for.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as plgpu_triton

from pallas_attn import masks
from pallas_attn.fp8_layout import kernel_v_operand
from pallas_attn.vma import match_vma, out_struct, vma
from pallas_attn.mosaic import (autotune, backward, backward_dq, backward_joint, backward_split,
                                kernels, operands, stream_merge, stream_tail)
from pallas_attn.mosaic.backward_split import split_smem_bytes
from pallas_attn.mosaic.config import Config, default_config, padded_head_dim
from pallas_attn.mosaic.fused_dq import dq_width, visited_parts
from pallas_attn.triton import kernels as triton_kernels
from pallas_attn.triton import ops as triton_ops

SMEM_LIMIT_BYTES = 227 * 1024
# Key blocks whose persistent launch hangs compiled (see _forward); benchmarks/mosaic_one.py
# --probe-stall empties it to try a config that might not hang.
STALLING_BLOCK_KV = (256,)
INTERPRET_CTAS = 3           # persistent launches in interpret mode: several tiles per CTA
_DTYPES = (jnp.bfloat16, jnp.float16)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


# The longest tile any kernel cuts from the sequence axes (H = 64 key blocks, 128-query dK/dV
# steps' dQ CTAs): shorter sequences are padded, whatever the kernel.
_TAIL_MIN = 256


def tma_tails(*, interpret, h: int, hp: int, t: int, s: int) -> bool:
  """Whether Q, K, V, O and dO go to the compiled kernels unpadded along T and S.

  A TMA load of a tile that runs past the array's end fills the missing rows with zeros and a
  TMA store drops them, so the kernels need no padded copies (an XLA pad per operand, ~0.05 ms
  each at 2^25 bf16 elements, and a slice per output). The masks already hide keys past S
  (``has_kv_len``) and rows past T are never stored. Not: in interpret mode (its copies are
  dynamic slices, which clamp instead), where the head dim is padded (the pad is needed
  anyway), where a sequence is shorter than one tile (a slice may not exceed its axis), or
  where T or S is not a multiple of the shared-memory tiles' 8 rows (Mosaic tiles the global
  array by them)."""
  return not interpret and h == hp and min(t, s) >= _TAIL_MIN and t % 8 == 0 and s % 8 == 0


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
    # A winner of autotune.tune for this problem class (its forward; the backward is always
    # the heuristic's for this call), else the heuristic. tune has no window: a windowed call
    # (tiles of other lengths than the full or causal class it would look up) keeps the
    # heuristic.
    cfg = default_config(head_dim=h, seq_k=s, masked=causal or window is not None,
                         key_masks=q_segment_ids is not None or kv_lengths is not None,
                         windowed=window is not None, batch=b)
    tuned = (autotune.lookup(head_dim=h, seq_k=s, causal=causal, dtype=q.dtype)
             if window is None else None)
    if tuned is not None:
      cfg = autotune.with_backward_of(tuned, cfg)
  elif isinstance(config, Config):
    cfg = config
  else:
    raise NotImplementedError(f"config of type {type(config).__name__} is not a mosaic Config")
  fn = functools.partial(
      _attention, causal=causal, scale=h ** -0.5 if scale is None else scale, window=window,
      softcap=softcap, cfg=cfg, head_dim_padded=hp, interpret=interpret)
  out, lse = fn(q, k, v, q_segment_ids, kv_segment_ids, kv_lengths)
  return (out, lse) if return_lse else out


def _grid(heads: int, tiles: int, batch: int, *, seq: str, seq_major: bool) -> dict:
  """``plgpu.kernel``'s grid and grid names. Mosaic GPU puts the last grid axis on blockIdx.x,
  so CTAs launch batch fastest, then tiles, then heads (one head's tiles resident together,
  sharing its operands in L2); with ``seq_major`` batch, heads, tiles. Kernels index by name,
  so the order changes only which CTAs run together (not "heads fastest": session 38)."""
  if seq_major:
    return dict(grid=(tiles, heads, batch), grid_names=(seq, "heads", "batch"))
  return dict(grid=(heads, tiles, batch), grid_names=("heads", seq, "batch"))


def _num_sms(interpret: bool) -> int:
  """CTAs of a persistent launch: the GPU's SM count (132 on an H200); in interpret mode a
  few, so that the CPU tests still walk several tiles per CTA."""
  if interpret:
    return INTERPRET_CTAS
  return int(getattr(jax.local_devices()[0], "core_count", 0) or 132)


def _on_hopper() -> bool:
  try:
    return any(getattr(d, "compute_capability", "") == "9.0" for d in jax.devices("gpu"))
  except RuntimeError:
    return False


def _zero_padding(x, kv_lengths):
  """``x`` [B, S, ...] with the keys past each row's length set to 0.

  Keys past a row's length may hold anything (NaN padding). The kernels mask S with a select, so
  NaN in K never reaches the forward's softmax, but P V multiplies V's NaN by P's 0, and the
  backward's dQ = dS K and dP = dO V^T do the same with K and V. The select runs inside the
  custom VJP, not before it: its own VJP would otherwise be a second full pass over dK and dV,
  which the kernels already leave 0 there (P = dS = 0 on finite keys)."""
  s = x.shape[1]
  valid = jnp.arange(s)[None, :] < jnp.clip(kv_lengths, 0, s)[:, None]
  return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, jnp.zeros((), x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12))
def _attention(q, k, v, q_seg, kv_seg, kv_lengths, causal, scale, window, softcap, cfg,
               head_dim_padded, interpret):
  if kv_lengths is not None:      # the forward alone: only V's NaN would reach the output
    v = _zero_padding(v, kv_lengths)
  return _forward(q, k, v, q_seg, kv_seg, kv_lengths, causal=causal, scale=scale, window=window,
                  softcap=softcap, cfg=cfg, hp=head_dim_padded, interpret=interpret)


def _attention_fwd(q, k, v, q_seg, kv_seg, kv_lengths, causal, scale, window, softcap, cfg,
                   head_dim_padded, interpret):
  if kv_lengths is not None:      # K too: the backward's residuals
    k, v = _zero_padding(k, kv_lengths), _zero_padding(v, kv_lengths)
  out, lse = _forward(q, k, v, q_seg, kv_seg, kv_lengths, causal=causal, scale=scale,
                      window=window, softcap=softcap, cfg=cfg, hp=head_dim_padded,
                      interpret=interpret)
  return (out, lse), (q, k, v, q_seg, kv_seg, kv_lengths, out, lse)


def _attention_bwd(causal, scale, window, softcap, cfg, head_dim_padded, interpret, res, cts):
  q, k, v, q_seg, kv_seg, kv_lengths, out, lse = res
  do, dlse = cts
  mask_kw = dict(causal=causal, scale=scale, window=window, softcap=softcap)
  st_dq, st_dkdv = _backward_statics(q, k, q_seg, kv_lengths, cfg=cfg, interpret=interpret,
                                     **mask_kw)
  fused = fused_dq_served(cfg, st_dkdv, head_dim_padded, q, k, v, do)
  if st_dkdv.dq_writer and not fused:      # the two kernels after all
    st_dq, st_dkdv = (dataclasses.replace(x, dq_writer=False) for x in (st_dq, st_dkdv))
  dkdv_smem = backward_smem_bytes(st=st_dkdv, head_dim=head_dim_padded, fused_dq=fused)
  # Head dims over 128: one consumer cannot hold both of its keys' dK and dV accumulators (at
  # 192, where the tiles do fit in shared memory, ptxas spilled ~500 B and serialised the
  # wgmmas, C7512), nor at 256 do they fit in shared memory; the consumers then split dK / dV
  # by role (backward_split.py).
  split = (cfg.bwd_split_dkdv and not fused
           and (dkdv_smem > SMEM_LIMIT_BYTES or head_dim_padded > 128)
           and split_smem_bytes(st=st_dkdv, head_dim=head_dim_padded) <= SMEM_LIMIT_BYTES)
  if split:
    dkdv_smem = split_smem_bytes(st=st_dkdv, head_dim=head_dim_padded)
  smem = max(0 if fused else dq_smem_bytes(st=st_dq, head_dim=head_dim_padded), dkdv_smem)
  if cfg.backward == "triton" or smem > SMEM_LIMIT_BYTES:
    # Chosen, or tiles that do not fit in shared memory: the FA2 kernels instead.
    dq, dk, dv = triton_ops.backward(
        q, k, v, out, lse, do, dlse, q_segment_ids=q_seg, kv_segment_ids=kv_seg,
        kv_lengths=kv_lengths, interpret=bool(interpret), **mask_kw)
  else:
    dq, dk, dv = _backward(q, k, v, out, lse, do, dlse, q_seg, kv_seg, kv_lengths, st_dq,
                           st_dkdv, hp=head_dim_padded, interpret=interpret, fused_dq=fused,
                           split=split, seq_major=cfg.seq_major, persistent=cfg.bwd_persistent,
                           self_fed=cfg.bwd_self_fed, stream=cfg.bwd_stream_tail,
                           fold_batch=cfg.bwd_fold_batch, joint=cfg.bwd_joint)
  return dq, dk, dv, None, None, None


def backward_smem_bytes(*, st: kernels.Statics, head_dim: int, itemsize: int = 2,
                        fused_dq: bool = False, persistent: bool = False) -> int:
  """Shared memory of a dK/dV CTA: its K/V tiles (two sets, ``persistent``) plus the Q/dO/rows
  ring (and, with the fused dQ, two buffers of both consumers' dS^T and their fp32 dQ
  partials)."""
  kv_sets = 2 if persistent else 1
  tiles = (2 * kv_sets * kernels.COMPUTE_WGS * st.block_kv * head_dim
           + 2 * st.num_stages * st.block_q * head_dim)
  if not st.registers_pv or st.pt_smem:
    tiles += kernels.COMPUTE_WGS * st.block_kv * st.block_q
  extra = 0
  if fused_dq:
    tiles += 2 * kernels.COMPUTE_WGS * st.block_kv * st.block_q
    extra = kernels.COMPUTE_WGS * st.block_q * dq_width(head_dim) * 4
  return tiles * itemsize + extra + st.num_stages * st.block_q * 12 + 2048


def fused_dq_served(cfg: Config, st: kernels.Statics, hp: int, *arrays) -> bool:
  """Whether ``cfg.bwd_fused_dq`` can be honoured: padded head dim 64 (consumers alternate steps)
  or 128 / 256 (each takes H/2 columns: whole 64-column swizzle rows), the tiles fit in shared
  memory, and no operand varies over a shard_map axis (the accumulator is a fresh mutable
  buffer)."""
  if not (cfg.bwd_fused_dq or cfg.bwd_dq_writer or cfg.bwd_dq_lag) or hp not in (64, 128, 256):
    return False
  if cfg.bwd_dq_writer and hp not in (64, 128):
    return False
  if any(vma(x) for x in arrays):
    return False
  return backward_smem_bytes(st=st, head_dim=hp, fused_dq=True) <= SMEM_LIMIT_BYTES


def _backward_statics(q, k, q_seg, kv_lengths, *, causal, scale, window, softcap, cfg: Config,
                      interpret):
  """Statics of the dQ and dK/dV kernels (tiles, padded lengths, masks).

  T is padded to the dQ CTA's 2 * bwd_block_q rows and to the dK/dV step's bwd_dkdv_block_q,
  S to a multiple of both the dK/dV CTA's 2 * bwd_block_kv keys and the dQ step's
  bwd_dq_block_kv. The dQ ring takes bwd_num_stages stages, fewer where they would not fit in
  shared memory next to Q and dO.
  """
  t, s = q.shape[1], k.shape[1]
  bq, bkv, dq_bkv = cfg.bwd_block_q, cfg.bwd_block_kv, cfg.bwd_dq_block_kv
  dkdv_bq = cfg.bwd_dkdv_block_q or bq
  tq = _round_up(t, math.lcm(kernels.COMPUTE_WGS * bq, dkdv_bq))
  tk = _round_up(s, math.lcm(kernels.COMPUTE_WGS * bkv, dq_bkv))
  left, right = masks.canonical_window(causal=causal, window=window)
  common = dict(scale=scale, softcap=softcap,
                spec=masks.MaskSpec(left=left, right=right, offset=s - t),
                has_kv_len=kv_lengths is not None or tk != s, has_segments=q_seg is not None,
                groups=q.shape[2] // k.shape[2], registers_pv=not interpret,
                named_free=cfg.named_free and not interpret,
                exit_read_only=cfg.exit_read_only and not interpret,
                turns=cfg.bwd_turns and not interpret,
                defer_wait=cfg.bwd_defer_wait and not interpret,
                consumer_registers=cfg.bwd_registers,
                pt_smem=cfg.bwd_pt_smem and not interpret, dq_writer=cfg.bwd_dq_writer,
                dq_lag=cfg.bwd_dq_lag,
                qdo_regs=cfg.bwd_dq_regs and not interpret,
                dq_serial=cfg.bwd_dq_serial and not interpret,
                dq_delta_acc=cfg.bwd_dq_delta_acc and not interpret,
                kv_regs="" if interpret else cfg.bwd_dkdv_regs,
                early_stats="" if interpret else cfg.bwd_early_stats,
                masked_halves=cfg.bwd_masked_halves, free_first=cfg.bwd_free_first)
  hp = padded_head_dim(q.shape[-1])
  stages = cfg.bwd_num_stages
  # The dQ ring gets as many stages as fit next to Q and dO, trying a V ring one slot shallower
  # than K's before giving up a K slot. At H = 256 (Q and dO of both consumers: 128 KB) two K
  # slots and one V slot fit (224 KB of tiles, with the 2 KB reduction scratch given back):
  # K_{j+1} is then loaded during step j - 1's dQ wgmma and V_{j+1} during step j's, where
  # a single K/V slot (call 1 of session 16) made every step wait for its whole 64 KB load.
  # (32-key steps with two stages would fit too, but Mosaic's layout inference rejects the dQ
  # kernel's 32-key tiles in JAX 0.11.2.)
  rings = [(s, v) for s in range(stages, 0, -1) for v in (s, s - 1) if v >= 1]
  dq_common = dict(common, consumer_registers=cfg.bwd_dq_registers or cfg.bwd_registers)
  for k_stages, v_stages in rings:
    st_dq = kernels.Statics(block_q=bq, block_kv=dq_bkv, num_kv_blocks=tk // dq_bkv,
                            num_stages=k_stages, v_stages=0 if v_stages == k_stages else v_stages,
                            **dq_common)
    if dq_smem_bytes(st=st_dq, head_dim=hp) <= SMEM_LIMIT_BYTES:
      break
  # ``bwd_delta_in_dq``: only where O's buffer fits next to the rings just chosen.
  with_delta = dataclasses.replace(st_dq, delta_in_dq=True)
  if cfg.bwd_delta_in_dq and dq_smem_bytes(st=with_delta, head_dim=hp) <= SMEM_LIMIT_BYTES:
    st_dq = with_delta
  st_dkdv = kernels.Statics(block_q=dkdv_bq, block_kv=bkv, num_kv_blocks=tq // dkdv_bq,
                            num_stages=cfg.bwd_num_stages, **common)
  return st_dq, st_dkdv


def dq_smem_bytes(*, st: kernels.Statics, head_dim: int, itemsize: int = 2,
                  persistent: bool = False) -> int:
  """Shared memory of a dQ CTA: Q and dO per consumer (two sets each, ``persistent``) plus the
  K and V rings (and the 2 KB reduction scratch Pallas reserves, which the kernel gives back
  when its rings differ: ``dq_compiler_params``)."""
  sets = 2 if persistent else 1
  tiles = (2 * sets * kernels.COMPUTE_WGS * st.block_q * head_dim
           + (st.num_stages + st.v_ring) * st.block_kv * head_dim)
  if not st.registers_pv:
    tiles += kernels.COMPUTE_WGS * st.block_q * st.block_kv
  if st.delta_in_dq:
    tiles += sets * kernels.COMPUTE_WGS * st.block_q * head_dim        # O, for D
  # Barriers, the tile metadata and alignment: ~650 bytes measured (Mosaic's own count at
  # H = 256, 231560 bytes with split rings); the segment-id buffers take 1 KB each once aligned.
  extra = (0 if st.v_stages else 2048) + 1024 + (2048 if st.has_segments else 0)
  return tiles * itemsize + sets * kernels.COMPUTE_WGS * st.block_q * 12 + extra


def dq_compiler_params(st: kernels.Statics) -> dict:
  """Extra ``CompilerParams`` of the dQ kernel: its only cross-thread traffic is through the
  rings (P, dS and the row vectors stay in each thread's registers), so where the split rings
  need the room, the 2 KB Pallas reserves for cross-warp reductions is given back; the other
  configurations keep the default (their kernels stay as measured)."""
  return dict(reduction_scratch_bytes=0) if st.v_stages else {}


def _delta(do, out, dlse, block: int, interpret):
  """D = rowsum(dO * O) - dlse [B, N, T] by a Pallas kernel: a fixed reduction order, so vmap
  and batch shape never change the bits (see triton.kernels.delta_kernel). Triton's blocks
  must be powers of two: head dim 192 is zero-padded to 256 here (zeros add nothing)."""
  b, t, n, h = out.shape
  if h & (h - 1):
    width = 1 << (h - 1).bit_length()
    do, out = (jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, width - h))) for x in (do, out))
    h = width
  tile = pl.BlockSpec((None, block, None, h), lambda i, bb, nn: (bb, i, nn, 0))
  row = pl.BlockSpec((None, None, block), lambda i, bb, nn: (bb, nn, i))
  return pl.pallas_call(
      triton_kernels.delta_kernel, grid=(t // block, b, n), in_specs=[tile, tile, row],
      out_specs=row, out_shape=out_struct((b, n, t), jnp.float32, out),
      compiler_params=plgpu_triton.CompilerParams(num_warps=4, num_stages=1),
      interpret=bool(interpret), name="flash_attention_delta")(do, out, dlse)


def _backward(q, k, v, out, lse, do, dlse, q_seg, kv_seg, kv_lengths, st_dq: kernels.Statics,
              st_dkdv: kernels.Statics, *, hp: int, interpret, fused_dq: bool = False,
              split: bool = False, seq_major: bool = False, persistent: bool = False,
              self_fed: bool = False, stream: bool = False, fold_batch: bool = False,
              joint: bool = False):
  """dQ, dK, dV with the Mosaic GPU kernels of ``backward.py``: the dQ kernel and the dK/dV
  kernel, or (``fused_dq``) the dK/dV kernel alone, adding dS K into a zeroed float32
  accumulator (compiled: a mutable ref the kernel reduces into with TMA; interpret mode: one
  partial per K/V tile, summed here)."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  bq, bkv, dq_bkv = st_dkdv.block_q, st_dkdv.block_kv, st_dq.block_kv
  tq, tk = st_dkdv.num_kv_blocks * bq, st_dq.num_kv_blocks * dq_bkv
  dq_rows = kernels.COMPUTE_WGS * st_dq.block_q     # a dQ CTA's rows (Config.bwd_dkdv_block_q)

  tails = tma_tails(interpret=interpret, h=h, hp=hp, t=t, s=s)

  def pad(x, length):
    if tails:
      return x
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, hp - h)))

  def rows_to(x, length):        # (already hp wide) padded along T only
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))

  qp, kp, vp, outp, dop = pad(q, tq), pad(k, tk), pad(v, tk), pad(out, tq), pad(do.astype(q.dtype), tq)
  dlse = jnp.zeros_like(lse) if dlse is None else dlse
  lsep = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, tq - t)), constant_values=-jnp.inf)
  dlsep = jnp.pad(dlse.astype(jnp.float32), ((0, 0), (0, 0), (0, tq - t)))
  # D = rowsum(dO * O) - dlse: a pre-pass kernel, or (``delta_in_dq``) the dQ kernel, which
  # then writes the finished record for the dK/dV kernel.
  delta_in_dq = st_dq.delta_in_dq and not fused_dq
  delta = -dlsep if delta_in_dq else _delta(rows_to(dop, tq), rows_to(outp, tq), dlsep,
                                            st_dq.block_q, interpret)     # a grid of tq rows
  lse2 = jnp.where(jnp.isneginf(lsep), jnp.inf, lsep * kernels.LOG2E)   # empty rows: P = 0
  rows = jnp.stack([lse2, delta], axis=2)                                # [B, N, 2, T]
  base = [qp, kp, vp, dop, rows]
  segs = []
  if st_dq.has_segments:
    segs = [jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, tq - t)), constant_values=-1),
            jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, tk - s)), constant_values=-2)]
  has_meta = st_dq.any_mask
  meta_dq = meta_dkdv = None
  if has_meta:
    kv_len = (jnp.full((b,), s, jnp.int32) if kv_lengths is None
              else jnp.clip(kv_lengths.astype(jnp.int32), 0, s))
    common = dict(spec=st_dq.spec, seq_q=t, seq_k=s, batch=b, kv_lengths=kv_len,
                  q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    r_dq = masks.kv_block_ranges(block_q=dq_rows, block_k=dq_bkv, **common)
    r_dq = jnp.pad(r_dq, ((0, 0), (0, tq // dq_rows - r_dq.shape[1]), (0, 0)))
    kv_tile = bkv if split else kernels.COMPUTE_WGS * bkv      # keys of a dK/dV CTA
    r_kv = masks.q_block_ranges(
        masks.kv_block_ranges(block_q=bq, block_k=kv_tile, **common),
        num_k_blocks=tk // kv_tile)
    meta_dq, meta_dkdv = (_with_kv_len(r, kv_len) for r in (r_dq, r_kv))
  axes = frozenset().union(*(vma(x) for x in base + segs))

  def call(name, kernel, scratch, grid, names, out_type, meta, extra_inputs=(), params=None,
           rows_in=None, threads=kernels.COMPUTE_WGS + 1, kv_in=None):
    inputs = (base if rows_in is None else base[:4] + [rows_in])
    inputs = (inputs if kv_in is None else inputs[:1] + list(kv_in) + inputs[3:]) + (
        [meta] if meta is not None else []) + segs
    if axes:
      inputs = match_vma(inputs, axes)
    outs = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=grid, grid_names=names,
        num_threads=threads, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, **(params or {})),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=f"flash_attention_{name}")(*inputs, *extra_inputs)   # names in profiles
    return match_vma(list(outs), axes) if axes else list(outs)

  kv_tiles = tk // (bkv if split else kernels.COMPUTE_WGS * bkv)
  dkdv_out = [jax.ShapeDtypeStruct((b, kp.shape[1], kh, hp), k.dtype),     # tk, or S (tails)
              jax.ShapeDtypeStruct((b, kp.shape[1], kh, hp), v.dtype)]
  persist = persistent and not (fused_dq or split or has_meta or st_dkdv.defer_wait) and (
      backward_smem_bytes(st=st_dkdv, head_dim=hp, persistent=True) <= SMEM_LIMIT_BYTES)
  # Config.bwd_self_fed: the grid dK/dV kernel without a producer warpgroup (its consumer 0
  # fills the ring; not the persistent, fused-dQ or split forms). Its slot releases are
  # mbarriers: ``named_free``'s hardware barriers count a producer warpgroup in.
  self_fed = self_fed and not (persist or fused_dq or split)
  if self_fed and st_dkdv.named_free:
    st_dkdv = dataclasses.replace(st_dkdv, named_free=False)
  dkdv_kw = dict(st=st_dkdv, has_meta=has_meta, num_q_blocks=tq // bq)
  if self_fed:
    dkdv_kw.update(self_fed=True)
  dkdv_scratch = backward.dkdv_scratch(st=st_dkdv, head_dim=hp, dtype=q.dtype, has_meta=has_meta,
                                       fused_dq=fused_dq, persistent=persist)
  dkdv_grid = tuple(_grid(kh, kv_tiles, b, seq="kv_seq", seq_major=seq_major).values())
  if persist:
    num_ctas = min(_num_sms(interpret), kh * kv_tiles * b)
    dkdv_kw.update(num_ctas=num_ctas, grid_tiles=(kh, kv_tiles, b))
    dkdv_grid = ((num_ctas,), ("cta",))
  if split:
    dkdv_kernel = functools.partial(backward_split.dkdv_split_kernel, **dkdv_kw)
    dkdv_scratch = backward_split.split_scratch(st=st_dkdv, head_dim=hp, dtype=q.dtype,
                                                has_meta=has_meta)
  else:
    dkdv_kernel = functools.partial(backward.dkdv_kernel, **dkdv_kw)
  # Config.bwd_joint (backward_joint.py): both kernels' grid forms in one launch, unmasked.
  joint = (joint and delta_in_dq and not (fused_dq or split or has_meta or st_dq.has_segments
                                          or self_fed or stream or fold_batch
                                          or seq_major or persistent or st_dq.defer_wait))
  if joint:
    q_tiles = tq // dq_rows
    kernel = functools.partial(
        backward_joint.joint_kernel, st_dq=st_dq, st_dkdv=st_dkdv, heads=n, kv_heads=kh,
        q_tiles=q_tiles, kv_tiles=kv_tiles, batch=b, num_q_blocks=tq // bq,
        dq_scratch=backward_dq.dq_scratch(st=st_dq, head_dim=hp, dtype=q.dtype, has_meta=False),
        dkdv_scratch=dkdv_scratch, interpret=bool(interpret))
    dq, _, dk, dv = call(
        "bwd", kernel, (),
        (n + kh, max(q_tiles, kv_tiles), b), ("heads", "seq", "batch"),
        (jax.ShapeDtypeStruct((b, qp.shape[1], n, hp), q.dtype),
         jax.ShapeDtypeStruct(rows.shape, jnp.float32), *dkdv_out), None,
        extra_inputs=match_vma([outp], axes) if axes else [outp],
        params=dq_compiler_params(st_dq))
  elif not fused_dq:
    dq_grid = tuple(_grid(n, tq // dq_rows, b, seq="q_seq",
                          seq_major=seq_major).values())
    dq_kw = dict(st=st_dq, has_meta=has_meta)
    dq_persist = (persistent and not (has_meta or st_dq.defer_wait)
                  and st_dq.v_ring == st_dq.num_stages
                  and dq_smem_bytes(st=st_dq, head_dim=hp, persistent=True) <= SMEM_LIMIT_BYTES)
    if dq_persist:
      tiles = (n, tq // dq_rows, b)
      dq_kw.update(num_ctas=min(_num_sms(interpret), math.prod(tiles)), grid_tiles=tiles)
      dq_grid = ((dq_kw["num_ctas"],), ("cta",))
    dq_out = [jax.ShapeDtypeStruct((b, qp.shape[1], n, hp), q.dtype)]
    o_in = []
    if delta_in_dq:
      dq_out.append(jax.ShapeDtypeStruct(rows.shape, jnp.float32))       # the finished record
      o_in = match_vma([outp], axes) if axes else [outp]
    # Config.bwd_stream_tail (stream_tail.py), here for the dQ kernel: the grid runs the first
    # R * SMs (head, Q tile, batch) tiles; a second launch the rest as Stream-K parts over the
    # K/V blocks, merged below.
    q_tiles = (n, tq // dq_rows, b)
    dq_tail = stream_tail.Tail(math.prod(q_tiles), min(_num_sms(interpret), math.prod(q_tiles)),
                               st_dq.num_kv_blocks)
    dq_stream = (stream and dq_tail.rest > 0 and not (has_meta or dq_persist or seq_major
                                                      or st_dq.defer_wait)
                 and st_dq.v_ring == st_dq.num_stages and qp.shape[1] % dq_rows == 0)
    if dq_stream:
      dq_kw.update(main_tiles=dq_tail.rounds * dq_tail.num_ctas, grid_tiles=q_tiles)
    dq_scratch = backward_dq.dq_scratch(st=st_dq, head_dim=hp, dtype=q.dtype,
                                        has_meta=has_meta, persistent=dq_persist)
    dq, *rows_done = call(
        "dq", functools.partial(backward_dq.dq_kernel, **dq_kw), dq_scratch,
        *dq_grid, tuple(dq_out), meta_dq, extra_inputs=o_in, params=dq_compiler_params(st_dq))
    if dq_stream:
      part = jax.ShapeDtypeStruct((dq_tail.num_ctas, 2, dq_rows, hp), jnp.float32)
      dqp, *rows_tail = call(
          "dq_tail", functools.partial(backward_dq.dq_kernel, st=st_dq, has_meta=False,
                                       grid_tiles=q_tiles, tail=dq_tail),
          dq_scratch, (dq_tail.num_ctas,), ("cta",), (part, *dq_out[1:]), None,
          extra_inputs=o_in, params=dq_compiler_params(st_dq))
      coords = lambda f: (f // (n * q_tiles[1]), (f // q_tiles[1]) % n, f % q_tiles[1])
      dq = stream_tail.merge_sum(dq, dqp, tail=dq_tail, coords=coords, tile_rows=dq_rows)
      if rows_done:                   # the tail tiles' L2 / D records came from the tail launch
        rows_done = [stream_tail.merge_rows(rows_done[0], rows_tail[0], tail=dq_tail,
                                            coords=coords, tile_rows=dq_rows)]
    rows_in = rows_done[0] if rows_done else None
    # The same for the dK/dV kernel, its tail launch the persistent form with the parts.
    tile_keys = kernels.COMPUTE_WGS * bkv
    tail = stream_tail.Tail(kh * kv_tiles * b, min(_num_sms(interpret), kh * kv_tiles * b),
                            tq // bq)
    dkdv_stream = (stream and tail.rest > 0 and not (split or has_meta or persist or self_fed
                                                     or seq_major or st_dkdv.defer_wait)
                   and kp.shape[1] % tile_keys == 0
                   and backward_smem_bytes(st=st_dkdv, head_dim=hp, persistent=True)
                   <= SMEM_LIMIT_BYTES)
    if dkdv_stream:
      dkdv_kernel = functools.partial(dkdv_kernel, main_tiles=tail.rounds * tail.num_ctas,
                                      grid_tiles=(kh, kv_tiles, b))
    # Config.bwd_fold_batch: K, V, dK, dV as one [1, B * S] sequence, the batch in the tile axis
    fold = (fold_batch and b > 1 and kp.shape[1] % tile_keys == 0
            and not (split or has_meta or persist or self_fed or seq_major or dkdv_stream))
    kv_in, rows_kv = None, kp.shape[1]
    if fold:
      kv_in = [x.reshape(1, b * rows_kv, kh, hp) for x in (kp, vp)]
      dkdv_out = [jax.ShapeDtypeStruct((1, b * rows_kv, kh, hp), x.dtype) for x in (k, v)]
      dkdv_grid = tuple(_grid(kh, kv_tiles * b, 1, seq="kv_seq", seq_major=False).values())
      dkdv_kernel = functools.partial(dkdv_kernel, fold_tiles=kv_tiles)
    dk, dv = call("dkdv", dkdv_kernel, dkdv_scratch, *dkdv_grid, tuple(dkdv_out), meta_dkdv,
                  rows_in=rows_in, threads=kernels.COMPUTE_WGS + (0 if self_fed else 1),
                  kv_in=kv_in)
    if fold:
      dk, dv = (x.reshape(b, rows_kv, kh, hp) for x in (dk, dv))
    if dkdv_stream:
      part = jax.ShapeDtypeStruct((tail.num_ctas, 2, tile_keys, hp), jnp.float32)
      dkp, dvp = call(
          "dkdv_tail", functools.partial(backward.dkdv_kernel, st=st_dkdv, has_meta=False,
                                         num_q_blocks=tq // bq, num_ctas=tail.num_ctas,
                                         grid_tiles=(kh, kv_tiles, b), tail=tail),
          backward.dkdv_scratch(st=st_dkdv, head_dim=hp, dtype=q.dtype, has_meta=False,
                                persistent=True),
          (tail.num_ctas,), ("cta",), (part, part), None, rows_in=rows_in)
      coords = lambda f: (f // (kh * kv_tiles), (f // kv_tiles) % kh, f % kv_tiles)
      dk = stream_tail.merge_sum(dk, dkp, tail=tail, coords=coords, tile_rows=tile_keys)
      dv = stream_tail.merge_sum(dv, dvp, tail=tail, coords=coords, tile_rows=tile_keys)
  elif interpret:
    dk, dv, parts = call("dkdv",
                         functools.partial(backward.dkdv_kernel, dq_sink="partials", **dkdv_kw),
                         dkdv_scratch, *dkdv_grid,
                         (*dkdv_out, jax.ShapeDtypeStruct((kv_tiles, b, tq, n, hp), jnp.float32)),
                         meta_dkdv)
    # Tiles that never see a Q block leave their slice unwritten: mask by the visited ranges.
    visited = visited_parts(meta_dkdv, kv_tiles=kv_tiles, b=b, tq=tq, bq=bq)
    dq = (jnp.sum(jnp.where(visited, parts, 0.0), axis=0) * st_dkdv.scale).astype(q.dtype)
  else:
    acc = jax.new_ref(jnp.zeros((b, tq, n, hp), jnp.float32))
    dk, dv = call("dkdv", functools.partial(backward.dkdv_kernel, dq_sink="reduce", **dkdv_kw),
                  dkdv_scratch, *dkdv_grid, tuple(dkdv_out), meta_dkdv, extra_inputs=(acc,))
    dq = (acc[...] * st_dkdv.scale).astype(q.dtype)
  return dq[:, :t, :, :h], dk[:, :s, :, :h], dv[:, :s, :, :h]


def _with_kv_len(ranges, kv_len):
  """[B, n, 4] ranges -> [B, n, META_LEN] records (lo, lo_full, hi_full, hi, kv_len, 0, 0, 0)."""
  lead = ranges.shape[:2]
  return jnp.concatenate([ranges, jnp.broadcast_to(kv_len[:, None, None], lead + (1,)),
                          jnp.zeros(lead + (kernels.META_LEN - 5,), jnp.int32)], -1)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _forward(q, k, v, q_seg, kv_seg, kv_lengths, *, causal, scale, window, softcap, cfg: Config,
             hp: int, interpret, fp8_scales=None, out_dtype=None, fp8_k_block=False,
             fp8_v_in_key_order=False):
  """Pads to the CTA tile (consumers * block_q rows, block_kv keys, hp lanes), runs the kernel,
  unpads. ``fp8_scales`` = (q scales [B, N, T], k scales [B, K, S], v scales [B, K, H])
  float32: q, k are float8_e4m3fn codes and v is V^T's codes [B, K, H, S]
  (``pallas_attn.mosaic.fp8``); the kernel multiplies O by V's scales, and the output is in
  ``out_dtype`` (16-bit). ``fp8_k_block``: the k scales are equal within each
  ``cfg.block_kv`` keys (the kernel reads one a block). ``fp8_v_in_key_order``: v's keys are
  already in the kernel's order, padded to 16 (``fp8_layout.kernel_v_layout``)."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  fp8 = fp8_scales is not None
  out_dtype = q.dtype if out_dtype is None else out_dtype
  if fp8:
    # P goes through SMEM unless ``Config.fp8_p_registers`` (registers_pv below); the
    # intra-warpgroup overlap needs P in registers; the forms written for 16-bit operands
    # (register Q, split rings) stay off.
    cfg = dataclasses.replace(cfg, overlap=cfg.overlap and cfg.fp8_p_registers, v_stages=0,
                              q_regs_cols=0)
  cta_q = cfg.consumers * cfg.block_q
  tq, tk = _round_up(t, cta_q), _round_up(s, cfg.block_kv)
  left, right = masks.canonical_window(causal=causal, window=window)
  spec = masks.MaskSpec(left=left, right=right, offset=s - t)
  has_kv_len = kv_lengths is not None or tk != s
  # Position-only masks (or only S's padding to the block): the kernel computes each tile's
  # block range from its index (kv_len = S, static) instead of loading a per-tile record.
  computed = (cfg.computed_ranges and (not spec.is_trivial or tk != s) and kv_lengths is None
              and q_seg is None)
  st = kernels.Statics(
      scale=scale, softcap=softcap, spec=spec, has_kv_len=has_kv_len,
      has_segments=q_seg is not None, groups=n // kh, block_q=cfg.block_q,
      block_kv=cfg.block_kv, num_stages=cfg.num_stages, num_kv_blocks=tk // cfg.block_kv,
      v_stages=0 if cfg.v_stages == cfg.num_stages else cfg.v_stages,
      registers_pv=not interpret and (not fp8 or cfg.fp8_p_registers), fp8=fp8,
      fp8_k_block=fp8 and bool(fp8_k_block),
      overlap=cfg.overlap and not interpret and cfg.consumers == 2,
      fold_scale=cfg.fold_scale, named_barriers=cfg.named_barriers and not interpret,
      early_k_wait=cfg.early_k_wait, computed_ranges=computed, seq_q=t, seq_k=s,
      pin_softmax=cfg.pin_softmax,
      named_free=cfg.named_free and not interpret and not cfg.overlap,
      exit_read_only=cfg.exit_read_only and not interpret,
      consumers=cfg.consumers, poly_cols=min(cfg.exp2_poly_cols, cfg.block_kv),
      sum_in_pv=cfg.sum_in_pv, lazy_rescale=cfg.lazy_rescale,
      q_regs_cols=operands.register_q_cols(cfg, hp=hp, interpret=interpret,
                                  masked=not spec.is_trivial or has_kv_len or q_seg is not None))
  has_meta = st.any_mask and not computed
  varying = frozenset().union(*(vma(x) for x in (q, k, v)))
  # Compiled, the persistent loop with 256-key blocks never returns on the H200 (H = 64, full
  # and causal, 4x4096x32x64 and 4x1024x32x64; it compiles, then hangs; 128-key blocks and the
  # grid with 256 run: benchmarks/NOTES.md, session 8), so the grid runs instead. Not located:
  # interpret mode (mbarrier turns, P staged through SMEM) runs that form correctly once its
  # SMEM limit is lifted (session 12), so the cause is in a compiled-only part. Session 13: the
  # unmasked form with the turns on mbarriers (``named_barriers=False``) runs compiled and is
  # the fastest H = 64 forward measured (4x4096x32x64: 1.1514 ms, cuDNN 1.1384), so the hang is
  # in the named-barrier turns of the persistent loop. Only that measured form is let through.
  stalls = cfg.block_kv in STALLING_BLOCK_KV and (st.named_barriers or not spec.is_trivial)
  # The persistent launch is written for two consumers (its tile hand-over); three run the grid.
  if (cfg.persistent and cfg.consumers == 2 and not has_meta and q_seg is None and not st.overlap
      and not stalls):
    num_tiles = b * n * (tq // cta_q)
    # The tile counter is a fresh mutable ref, which cannot join shard_map's varying operands.
    dynamic = cfg.dynamic_schedule and not spec.is_trivial and not varying
    pst = dataclasses.replace(st, persistent=True, num_tiles=num_tiles,
                              num_ctas=min(num_tiles, _num_sms(interpret)), dynamic=dynamic,
                              atomic_counter=dynamic and not interpret)
    # A masked call that asked for the counter but cannot have it (inside shard_map) keeps one
    # CTA per tile: the static deal measured 18% slower than that grid (causal T = 1024).
    counter_missing = cfg.dynamic_schedule and not spec.is_trivial and not dynamic
    fits = lambda x: kernels.smem_bytes(st=x, head_dim=hp, itemsize=q.dtype.itemsize) <= (
        SMEM_LIMIT_BYTES)
    if not fits(pst):
      # A whole [block_q, H] O buffer per consumer does not fit next to Q and the ring (H = 256):
      # store O 64 columns at a time through two slots instead (tokamax's sm90 epilogue).
      pst = dataclasses.replace(pst, o_chunked=True)
    if not counter_missing and fits(pst):
      st = pst
      # Stream-K for the last partial wave (stream_tail.py): unmasked, O in one buffer, rows
      # a whole number of tiles (the merge scatters whole tiles), a partial last wave.
      tail = stream_tail.Tail(num_tiles, st.num_ctas, st.num_kv_blocks)
      if (cfg.stream_tail and not st.any_mask and not st.o_chunked and not fp8
          and tq == t and tail.rest):
        st = dataclasses.replace(st, stream_tail=True)
  # The row max / sum reduce within a warp (the WGMMA layout's rows live in one quad), so the
  # 2 KB Pallas reserves for cross-warp reductions are free to give back where they are needed:
  # FA3's 80-key ring at head dim 256 is 128 bytes over without them, as are the persistent
  # launch at 256 with its O slots and 3 K + 2 V slots (``Config.v_stages``). The other kernels
  # keep the default so that they stay as measured; so does ``lazy_rescale``, whose
  # warpgroup-wide max crosses warps. Where its scratch does not fit, the lazy form is dropped
  # (the plain online softmax: the same result up to float32 rounding, no config error).
  needs_room = bool(cfg.block_kv % 64 or st.o_chunked or st.v_stages)
  smem = kernels.smem_bytes(st=st, head_dim=hp, itemsize=q.dtype.itemsize)
  if needs_room and st.lazy_rescale and smem + 2048 > SMEM_LIMIT_BYTES:
    st = dataclasses.replace(st, lazy_rescale=0.0)
  give_back = needs_room and not st.lazy_rescale
  smem += 2048 if needs_room and not give_back else 0
  if smem > SMEM_LIMIT_BYTES:
    raise NotImplementedError(f"mosaic config needs ~{smem // 1024} KB of shared memory at head "
                              f"dim {hp} (limit {SMEM_LIMIT_BYTES // 1024} KB)")

  tails = not fp8 and tma_tails(interpret=interpret, h=h, hp=hp, t=t, s=s)

  def pad(x, length):
    if tails:
      return x
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, hp - h)))

  inputs = [pad(q, tq), pad(k, tk)]
  if fp8:                                           # V^T [B, K, H, S]
    # Config.fp8_p_registers: V's keys in the order P's registers hold them.
    inputs.append(kernel_v_operand(v, in_key_order=fp8_v_in_key_order,
                                   key_order=st.registers_pv, head_dim=hp, num_keys=tk))
  else:
    inputs.append(pad(v, tk))
  if has_meta:
    kv_len = (jnp.full((b,), s, jnp.int32) if kv_lengths is None
              else jnp.clip(kv_lengths.astype(jnp.int32), 0, s))
    ranges = masks.kv_block_ranges(spec=spec, seq_q=t, seq_k=s, block_q=cta_q,
                                   block_k=cfg.block_kv, batch=b, kv_lengths=kv_len,
                                   q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    ranges = jnp.pad(ranges, ((0, 0), (0, tq // cta_q - ranges.shape[1]), (0, 0)))
    inputs.append(_with_kv_len(ranges, kv_len))
  if st.has_segments:
    inputs.append(jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, tq - t)), constant_values=-1))
    inputs.append(jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, tk - s)), constant_values=-2))
  if fp8:
    q_scale, k_scale, v_scale = fp8_scales
    # Padded rows get scale 1, not 0: the kernel folds the row scale into the softmax's
    # factor, where 0 would turn a masked row's -inf into NaN.
    inputs.append(jnp.pad(q_scale.astype(jnp.float32), ((0, 0), (0, 0), (0, tq - t)),
                          constant_values=1.0))
    inputs.append(jnp.pad(k_scale.astype(jnp.float32), ((0, 0), (0, 0), (0, tk - s))))
    inputs.append(jnp.pad(v_scale.astype(jnp.float32), ((0, 0), (0, 0), (0, hp - h)),
                          constant_values=1.0))

  # Inside shard_map(check_vma=True) the outputs must vary over q's mesh axes, and every operand
  # over the same ones (as in the Triton backend).
  axes = frozenset().union(*(vma(x) for x in inputs))
  if axes:
    inputs = match_vma(inputs, axes)
  if st.dynamic:
    inputs.append(jax.new_ref(jnp.zeros((1,), jnp.int32)))   # the tile counter (schedule.py)
  smem_types, bar_types = kernels.scratch_types(st=st, head_dim=hp, dtype=q.dtype,
                                                has_meta=has_meta, out_dtype=out_dtype)
  out_type = (jax.ShapeDtypeStruct((b, t if tails else tq, n, hp), out_dtype),
              jax.ShapeDtypeStruct((b, n, tq), jnp.float32))         # lse: T * 4 B rows
  if st.stream_tail:
    tail = stream_tail.Tail(st.num_tiles, st.num_ctas, st.num_kv_blocks)
    out_type += stream_tail.workspace_types(tail, tile_rows=cta_q, head_dim=hp, dtype=out_dtype)
  out, lse, *parts = plgpu.kernel(
      functools.partial(kernels.fwd_kernel, st=st, has_meta=has_meta),
      out_type=out_type,
      scratch_types=(smem_types, bar_types),
      **(dict(grid=(st.num_ctas,), grid_names=("sm",)) if st.persistent else
         _grid(n, tq // cta_q, b, seq="q_seq", seq_major=cfg.seq_major)),
      num_threads=st.consumers + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          approx_math=True, unsafe_no_auto_barriers=cfg.no_auto_barriers and not interpret,
          **(dict(reduction_scratch_bytes=0) if give_back else {})),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
      kernel_name="flash_attention_fwd",
  )(*inputs)
  if axes:
    # plgpu.kernel traces its body with the vma check off and returns non-varying types: mark the
    # outputs as varying like the inputs they are computed from.
    out, lse, *parts = match_vma([out, lse, *parts], axes)
  if st.stream_tail:
    out, lse = stream_merge.merge_parts(out, lse, *parts, method=cfg.stream_tail_merge,
                                        in_shard_map=bool(axes), tail=tail, heads=n,
                                        tile_rows=cta_q, interpret=bool(interpret))
  return out[:, :t, :, :h], lse[:, :, :t]

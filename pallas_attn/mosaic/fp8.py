"""FP8 forward on the Mosaic GPU backend: the FlashAttention-3 forward kernel on e4m3 codes.

Called by ``pallas_attn.fp8.flash_attention_fp8`` with inputs it has quantized. The kernel is
``kernels.fwd_kernel`` with ``Statics.fp8``: S = Q8 K8^T on the tensor cores' FP8 path (twice
the bf16 rate on Hopper), scaled per query row and key (``s_q s_k``) before the mask and the
online softmax; P is rounded to e4m3 and O += P8 V8 runs on the FP8 path too. FP8 wgmma reads
K-major operands only, so V comes in transposed ([B, K, H, S]: the contraction of P V, over
the keys, is then the fastest axis). An e4m3 A operand in registers needs the 8-bit wgmma
register layout, which Mosaic GPU does not convert the accumulator's layout to;
``Config.fp8_p_registers`` (the default) regroups P's registers instead and permutes V's keys
to match; with it off, P goes through shared memory. V's per-channel scales multiply O in the
kernel's epilogue (one multiply per output element, in float32 before the 16-bit store).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_attn.mosaic import ops
from pallas_attn.mosaic.config import Config, default_config, padded_head_dim


# Three consumer warpgroups (192 query rows a CTA) from this many keys at head dim 128 (bf16
# takes them from 16384 unmasked keys only, where they gained 1%: FP8's step is shorter, so
# a third consumer's softmax hides more of it). H100, session 26
# (benchmarks/results/fp8/2026-12-05_s26_three_consumers_h100.json, the kernel alone, one
# process): 1x16384x16x128 full 2.579 -> 2.288 ms, causal 1.395 -> 1.327; 2x8192 full
# 1.327 -> 1.227, causal 0.764 -> 0.756. At 4096 keys it was 4% faster unmasked and slower
# causal (session 25), so shorter rows keep two; at H = 256 ptxas runs out of registers.
THREE_CONSUMERS_FROM = 8192


def fp8_default_config(*, head_dim: int, seq_k: int, masked: bool) -> Config:
  """``default_config`` with the FP8 kernel's own measured choices (``THREE_CONSUMERS_FROM``).

  Example:
    >>> fp8_default_config(head_dim=128, seq_k=16384, masked=False).consumers
    3
  """
  cfg = default_config(head_dim=head_dim, seq_k=seq_k, masked=masked)
  if padded_head_dim(head_dim) == 128 and seq_k >= THREE_CONSUMERS_FROM:
    cfg = dataclasses.replace(cfg, consumers=3)
  return cfg


def attention(q8, q_scale, k8, k_scale, v8, v_scale, *, out_dtype, causal, scale, window,
              softcap, q_segment_ids, kv_segment_ids, kv_lengths, return_lse, config, interpret,
              k_scale_block: int = 1, v_in_key_order: bool = False):
  """FP8 forward: ``q8 [B, T, N, H]``, ``k8, v8 [B, S, K, H]`` float8_e4m3fn codes with
  ``q_scale [B, N, T]``, ``k_scale [B, K, S]`` (per token) and ``v_scale [B, K, H]`` (per
  channel) float32, so that q = q8 * q_scale etc. Returns out in ``out_dtype`` (and lse).
  ``k_scale_block``: k_scale is constant over each run of that many keys from key 0; where
  that is a multiple of the kernel's key block, the kernel reads one scale a block and S
  takes its scales as one factor per row (no multiply per logit). ``v_in_key_order``: v8 is
  V^T already in the kernel's layout (``fp8_layout.kernel_v_layout``: [B, K, H, S16]), as a
  ``QuantizedKV`` keeps it; no transposition per call.

  Raises NotImplementedError (dispatch then falls back) off Hopper without interpret mode, for
  head dims over 256, a foreign config, or a tile set over shared memory.
  """
  hp = padded_head_dim(q8.shape[-1])
  if not interpret and not ops._on_hopper():                      # pylint: disable=protected-access
    raise NotImplementedError("mosaic FP8 attention needs a Hopper GPU (sm90) or interpret=True")
  h, s = q8.shape[-1], k8.shape[1]
  if config is None:
    cfg = fp8_default_config(head_dim=h, seq_k=s, masked=causal or window is not None)
  elif isinstance(config, Config):
    cfg = config
  else:
    raise NotImplementedError(f"config of type {type(config).__name__} is not a mosaic Config")
  vt = v8 if v_in_key_order else jnp.transpose(v8, (0, 2, 3, 1))   # [B, K, H, S]
  out, lse = ops._forward(                                          # pylint: disable=protected-access
      q8, k8, vt, q_segment_ids, kv_segment_ids, kv_lengths, causal=causal,
      scale=h ** -0.5 if scale is None else scale, window=window, softcap=softcap, cfg=cfg,
      hp=hp, interpret=interpret, fp8_scales=(q_scale, k_scale, v_scale),
      out_dtype=out_dtype if out_dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16,
      fp8_k_block=k_scale_block % cfg.block_kv == 0, fp8_v_in_key_order=v_in_key_order)
  out = out.astype(out_dtype)
  return (out, lse) if return_lse else out

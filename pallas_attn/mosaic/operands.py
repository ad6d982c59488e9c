"""Register wgmma operands for the Mosaic kernels (``Config.q_regs_cols``, ``bwd_dq_regs``,
``fp8_p_registers``)."""
from __future__ import annotations

import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.mosaic.config import Config


def q_operands(q_smem, reg_cols: int):
  """S = Q K^T's A operands as ``[(operand, columns)]``: Q's first ``reg_cols`` columns loaded
  into registers (wgmma layout), the rest left in shared memory; S = sum over the parts of
  Q[:, cols] K[:, cols]^T.

  Why: with both operands in SMEM an m64 n64 k16 wgmma reads 4 KB per 32 tensor-core cycles, the
  SM's whole shared-memory bandwidth (128 B/cycle), and the K/V TMA writes share it. Q is the
  same for every K/V block of a tile, so holding it in registers (H / 2 registers a thread at
  64 rows per warpgroup) removes a third to a half of the step's SMEM reads; at H = 256 only
  part of Q fits next to O's 128 registers, hence a column split (multiples of 64: one swizzle
  row). H200 (session 14): +4% at H = 64, nothing at H = 128 / 256. Compiled, the unmasked
  loop gave wrong outputs with as many keys per block as the head dim (``register_q_cols``
  below keeps Q in SMEM there).
  """
  h = q_smem.shape[-1]
  reg_cols = min(reg_cols, h)
  if reg_cols == 0:
    return [(q_smem, slice(None))]
  if reg_cols == h:
    return [(q_smem[...], slice(None))]
  head, tail = pl.ds(0, reg_cols), pl.ds(reg_cols, h - reg_cols)
  return [(q_smem.at[:, head][...], head), (q_smem.at[:, tail], tail)]


def p_as_8bit_operand(p8):
  """P [rows, keys] in e4m3 (the f32 accumulator's WGMMA layout, cast) as the 8-bit wgmma A
  operand layout, with no data movement: in each 16-key group the accumulator layout gives a
  thread keys {2q, 2q+1} and {8 + 2q, 9 + 2q} (two 2-byte registers per row), the 8-bit layout
  keys 4q .. 4q + 3 (one 4-byte register). Concatenating the two registers reads the group's
  keys in the order ``fp8_layout.fp8_key_order``, so P V is right when V's keys were permuted so
  (``ops._forward`` does it). Compiled only (the interpreter has no register wgmma operands)."""
  shape = p8.shape

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct(shape, p8.dtype,
                                                        layout=plgpu.Layout.WGMMA_8BIT))
  def regroup(_, p):
    regs = p.registers                                  # [.., 8-key tile (dim 1), .., 8-row half]
    out = np.empty(mgpu_fa.WGMMA_LAYOUT_8BIT.registers_shape(shape), dtype=object)
    for idx in np.ndindex(out.shape):
      pair = [regs[(idx[0], 2 * idx[1] + i, *idx[2:])] for i in range(2)]
      out[idx] = mgpu_utils.vector_concat(pair)
    return mgpu_fa.FragmentedArray(_registers=out, _layout=mgpu_fa.WGMMA_LAYOUT_8BIT,
                                   _is_signed=None)
  return regroup(p8)


def pv_swizzle(block_kv: int, itemsize: int) -> int:
  """Swizzle (bytes) of the V ring and of P: the widest of 128 / 64 / 32 whose row of elements
  divides ``block_kv``. P V's contraction runs over the keys, and a wgmma issues its K steps in
  groups one swizzle row wide (``swizzle // itemsize`` elements), so 128 B (64 bf16 keys) needs
  block_kv % 64 == 0; FA3's 80-key block at head dim 256 needs 32 B rows (16 keys)."""
  for swizzle in (128, 64, 32):
    if block_kv % (swizzle // itemsize) == 0:
      return swizzle
  raise ValueError(f"block_kv={block_kv} is not a multiple of {32 // itemsize}")


def register_q_cols(cfg: Config, *, hp: int, interpret: bool, masked: bool) -> int:
  """Columns of Q the forward holds in registers (``Config.q_regs_cols``), 0 where it is not
  served: interpret mode (no register wgmma operands), ``overlap`` (its own loop), and the
  unmasked loop with as many keys per block as the head dim. Compiled on the H200 that last
  form gave wrong outputs: H = 128 with 128-key blocks (all of Q or its first 64 columns in
  registers; every launch form: grid, persistent, mbarrier turns) and H = 64 with 64-key
  blocks; while the masked loops with the same tiles, and unmasked H = 128 with 64-key blocks,
  H = 64 with 128 / 256 and H = 256 (128 columns) with 64 were right (benchmarks/NOTES.md,
  session 14). The cause is not located, so that form keeps Q in shared memory."""
  if interpret or cfg.overlap or (not masked and cfg.block_kv == hp):
    return 0
  return min(cfg.q_regs_cols, hp)

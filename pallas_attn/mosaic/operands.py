"""Register wgmma operands for the Mosaic kernels (``Config.q_regs_cols``, ``bwd_dq_regs``)."""
from __future__ import annotations

from jax.experimental import pallas as pl


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
  loop gave wrong outputs with as many keys per block as the head dim (``ops.register_q_cols``
  keeps Q in SMEM there).
  """
  h = q_smem.shape[-1]
  reg_cols = min(reg_cols, h)
  if reg_cols == 0:
    return [(q_smem, slice(None))]
  if reg_cols == h:
    return [(q_smem[...], slice(None))]
  head, tail = pl.ds(0, reg_cols), pl.ds(reg_cols, h - reg_cols)
  return [(q_smem.at[:, head][...], head), (q_smem.at[:, tail], tail)]

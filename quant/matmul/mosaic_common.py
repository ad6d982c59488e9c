"""What the Mosaic GPU W4A16 kernels share (``mosaic.py``'s grid kernel and ``mosaic_stream.py``'s
stream-K kernel): the static description of one launch (``Statics``) and the dequantization of
one nibble plane of a step's code tile into a wgmma operand.

Maths (see ``mosaic.py``): the plane's ``q - z`` is formed as ``(B + q) - (B + z)`` with B a
16-bit magic number whose mantissa takes q by an OR (bf16: B = 128, f16: B = 1024), so the
subtraction is exact and no int -> float conversion runs.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

from quant.matmul import layout, mma_sync
from quant.matmul.config import MOSAIC_ACC_COLUMNS

# 16-bit pattern of B with B + q exact for q < 16 (OR q into the mantissa), by operand dtype.
_MAGIC = {jnp.dtype(jnp.bfloat16): (0x4300, 128.0), jnp.dtype(jnp.float16): (0x6400, 1024.0)}
PLANES = layout.PLANES
BN = layout.TILE_N
ACC_COLUMNS = MOSAIC_ACC_COLUMNS   # default budget of live group accumulators (grid kernel)
PIPELINE_REGISTERS = 96   # per-thread budget of the pipelined loop's float32 tiles


def pipeline_fits(*, groups_per_step: int, m_pad: int) -> bool:
  """Whether ``MosaicConfig.pipeline`` is honoured: its float32 [64, m_pad] tiles (two sets of
  group accumulators, the previous values of both and the total; m_pad / 2 registers a thread
  each) stay within ``PIPELINE_REGISTERS`` registers a thread."""
  return (4 * groups_per_step + 1) * m_pad // 2 <= PIPELINE_REGISTERS


@dataclasses.dataclass(frozen=True)
class Statics:
  """Everything static about one kernel launch (hashable)."""
  m_pad: int            # activation rows (wgmma N), multiple of 8
  steps: int            # block_k steps per split
  block_k: int          # K rows per step (PLANES planes)
  seg: int              # K rows sharing one scale inside a split (group, or the split)
  stages: int
  wgs: int              # consumer warpgroups per CTA (block_n / 64)
  sym: bool
  zero: float           # symmetric zero point 2**(bits - 1)
  dtype: jnp.dtype      # activation / wgmma operand dtype
  magic_bits: int       # 16-bit pattern of B (bf16 0x4300 = 128, f16 0x6400 = 1024)
  magic: float          # B
  registers_a: bool = False   # dequantized planes feed wgmma from registers (compiled only)
  paired: bool = False        # dequantize two codes per 32-bit op with inline Mosaic GPU code
                              # (compiled only: the interpreter cannot run inline_mgpu)
  fold_zero: bool = False     # subtract B + z with a second wgmma (needs registers_a)
  pipeline: bool = False      # step t's wgmmas run while step t + 1 is dequantized (registers_a)
  direct_x: bool = False      # x read as [M, K] by one TMA per plane (rows >= M, columns >= K
                              # zero-filled by the TMA unit): no XLA pad / plane transpose
  late_zero: bool = False     # wgmma takes B + q; (B + z) X_g is subtracted from each group's
                              # float32 partial afterwards (``MosaicConfig.late_zero``)
  direct_out: bool = False    # y [M, N] in x's dtype stored by the kernel (split_k = 1, no
                              # bias): no XLA slice / transpose / cast after it
  mma_sync: bool = False      # planes times x by warp-level mma.sync (m_pad 8, 16; mma_sync.py)
  acc_columns: int = ACC_COLUMNS   # float32 columns of group accumulators live in one scope
  out_registers: bool = False  # float32 partials stored from registers to GMEM (8-byte stores):
                               # no output tile in SMEM (``MosaicConfig.out_registers``)
  x_slots: int = 0            # x's planes in a ring of their own (mosaic_xring.py); 0: x
                              # travels with its step in the step ring
  scaled_acc: bool = False    # one accumulator holds the running total in units of the
                              # current group's scale (``MosaicConfig.scaled_acc``)
  carry_codes: bool = False   # with parts > 1: the code tile crosses to SMEM at a layout
                              # step's first part only, the others reuse its registers
  parts: int = 1              # ring steps a layout step (``MosaicConfig.step_parts``): each
                              # holds the whole code tile, 1/parts of the x and the scales

  @property
  def step_rows(self) -> int:
    """K rows of one ring step: the layout's ``block_k``, or 1/parts of it."""
    return self.block_k // self.parts

  @property
  def step_planes(self) -> int:
    """Planes (of ``span2`` K rows) of x in one ring step."""
    return PLANES // self.parts

  @property
  def span2(self) -> int:
    """K columns of one plane (int16 elements of a step's code tile per row)."""
    return self.block_k // PLANES

  @property
  def long_groups(self) -> bool:
    """A scale covers one or more whole steps (else each step holds several groups). With step
    parts a group of exactly one ring step takes the short-group path, so that the long one
    always walks whole layout steps (``parts`` ring steps each) per group."""
    if self.parts > 1:
      return self.seg > self.step_rows
    return self.seg >= self.block_k

  @property
  def groups_per_step(self) -> int:
    return 1 if self.long_groups else self.step_rows // self.seg

  @property
  def groups_per_scope(self) -> int:
    """Group accumulators live at once (sharing one wgmma wait): at most ``acc_columns``
    float32 columns (``acc_columns / 2`` registers a thread)."""
    return max(1, min(self.groups_per_step, self.acc_columns // self.m_pad))

  @property
  def scope_planes(self) -> int:
    """The most planes one wgmma scope reads (``mosaic_xring``'s refill lag)."""
    return self.groups_per_scope * (self.step_planes // self.groups_per_step)

  @property
  def pipeline_fits(self) -> bool:
    """See ``pipeline_fits``."""
    return pipeline_fits(groups_per_step=self.groups_per_step, m_pad=self.m_pad)

  @property
  def steps_per_group(self) -> int:
    return self.seg // self.step_rows if self.long_groups else 1


def _tiled(span2: int) -> tuple:
  """SMEM transforms of a 16-bit array whose minor dimension is ``span2`` elements: tiles of at
  most 64 elements (128 bytes, the widest swizzle; a 128-element plane is two tiles)."""
  return (plgpu.TilingTransform((8, min(span2, 64))), plgpu.SwizzleTransform(min(2 * span2, 128)))


def _paired_codes(codes, p: int, st: Statics):
  """``B + q`` of plane ``p`` from the int16 code tile ``[64, span2]`` (WGMMA layout), compiled.

  In the WGMMA layout each 32-bit register of a 16-bit ``[64, span2]`` array holds columns
  ``2u`` (low half) and ``2u + 1`` (high half) of one row, both for the int16 codes and for the
  bf16/f16 operand, so one 32-bit ``((r >> 4p) & 0x000F000F) | (B_bits * 0x10001)`` makes the
  two operands of that register at once. That is one shift and one lop3 (``_and_or``)
  per two weights, where the int32-word layout needed a shift, an and/or and an int32 -> int16
  pack per weight (~3 integer ops per weight): now 1 integer op per weight plus one packed
  bf16x2 subtract of ``B + z`` per two weights (~1.5 ops per weight). Pallas cannot express the
  32-bit view of a 16-bit register pair, hence the few lines of Mosaic GPU.
  """
  shape = (BN, st.span2)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct(shape, st.dtype,
                                                        layout=plgpu.Layout.WGMMA))
  def dequant(_, tile):
    i32 = ir.IntegerType.get_signless(32)
    pair_ty = ir.VectorType.get((2,), mgpu.utils.dtype_to_ir_type(st.dtype))
    magic = st.magic_bits * 0x10001                          # B in both halves
    shift = mgpu.utils.c(4 * p, i32)
    regs = np.empty_like(tile.registers)
    for idx, reg in np.ndenumerate(tile.registers):         # reg: vector<2xi16>
      word = mgpu.utils.bitcast(reg, i32)
      if p:
        word = arith.shrui(word, shift)
      word = _and_or(word, 0x000F000F, magic)
      regs[idx] = mgpu.utils.bitcast(word, pair_ty)
    return mgpu.FragmentedArray(_registers=regs, _layout=tile.layout, _is_signed=None)

  return dequant(codes)


def mma_sync_group(codes, zero, x_slot, g: int, st: Statics):
  """Group ``g``'s float32 partial [64, m_pad] of a step by ``mma_sync.plane_product`` (x_slot:
  the step's x planes in fragment order; ``zero`` None with ``late_zero``)."""
  per_group = PLANES // st.groups_per_step
  acc = plgpu.layout_cast(jnp.zeros((BN, st.m_pad), jnp.float32), plgpu.Layout.WGMMA)
  for p in range(g * per_group, (g + 1) * per_group):
    vals = _codes(codes, p, st) if zero is None else _codes(codes, p, st) - zero
    acc = mma_sync.plane_product(vals, x_slot.at[p], acc, emulate=not st.paired)
  return acc


def _and_or(word, mask: int, magic: int):
  """``(word & mask) | magic`` (32-bit) as one ``lop3`` (LUT 0xEA = (a & b) | c). Written as PTX
  because from ``arith.andi`` + ``arith.ori`` ptxas emitted two LOP3s per register: 2 of the
  3.75 instructions per two weights in Nsight Compute's count (benchmarks/NOTES.md, session 9)."""
  i32 = ir.IntegerType.get_signless(32)
  return llvm.inline_asm(i32, [word], f"lop3.b32 $0, $1, {mask:#010x}, {magic:#010x}, 0xEA;",
                         "=r,r")


def _codes(codes, p: int, st: Statics):
  """``B + q`` of plane ``p`` in the operand dtype: ``_paired_codes`` compiled; the same bits
  with plain lax ops in interpret mode (16-bit, logical shift)."""
  if st.paired:
    return _paired_codes(codes, p, st)
  bits = (lax.shift_right_logical(codes, jnp.int16(4 * p)) & jnp.int16(0xF)) | jnp.int16(
      st.magic_bits)
  return lax.bitcast_convert_type(bits, st.dtype)


def scaled_group(acc, unit, s, zero, codes, x_slot, planes, nibbles, nibble0: int,
                 st: Statics):
  """``st.scaled_acc``: one group of a ring step into the one accumulator (both kernels).

  ``acc`` [64, m_pad] float32 holds the running total in units of ``unit`` (a per-feature row:
  the scale of the last group with a nonzero scale). It is moved to units of this group's
  scale ``s`` (``acc * unit / s``, as FlashAttention rescales its output when the row maximum
  moves), then the group's wgmmas add its raw partial ``sum (q - z) x`` to it, so ``acc * s``
  is the total afterwards. A zero scale keeps the unit, and its group adds nothing
  (``layout.prepare_mosaic`` stores q = z where a real group's scale is 0; padded groups meet
  zero-padded x). ``nibbles``: the group's planes in the code tile; x's plane in the ring slot
  ``x_slot`` is ``nibble - nibble0``. ``planes``: the two SMEM plane buffers of
  ``registers_a=False``. Returns ``(acc, unit)``.
  """
  u = jnp.where(s == 0, unit, s)
  acc = acc * lax.broadcast_in_dim(unit / u, (BN, st.m_pad), [0])
  x_of = lambda nib: x_slot.at[nib - nibble0].transpose((1, 0))
  if st.registers_a:
    def run(acc_ref):
      for nib in nibbles:
        plgpu.wgmma(acc_ref, _codes(codes, nib, st) - zero, x_of(nib))
    return pl.run_state(run)(plgpu.ACC.init(acc)), u
  # Planes through SMEM (interpret mode, registers_a=False): JAX 0.11.2's interpreter has no
  # run_state accumulators (nor register operands), so the group's raw partial lands in a
  # fresh accumulator that is added in registers, as the attention kernels' interpret form.
  def run(acc_ref):
    for i, nib in enumerate(nibbles):
      if i >= 2:
        plgpu.wgmma_wait(1)              # the wgmma that read this buffer is done
      planes[i % 2] = _codes(codes, nib, st) - zero
      plgpu.commit_smem()
      plgpu.wgmma(acc_ref, planes.at[i % 2], x_of(nib))
    return acc_ref[...]
  return acc + pl.run_scoped(run, plgpu.ACC((BN, st.m_pad), jnp.float32)), u

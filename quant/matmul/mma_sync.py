"""The W4A16 decode step's products with warp-level ``mma.sync m16n8k16`` (``MosaicConfig.mma_sync``).

At M <= 16 the wgmma form multiplies each dequantized plane ``[64, span2]`` (A, registers) by
x's plane ``[m_pad, span2]`` (B, shared memory; m_pad 8 or 16) as ``m64 nN k16`` instructions,
N = 8 the narrowest a wgmma has. Marlin's decode kernels use Ampere's warp-level
``mma.sync.m16n8k16`` instead, whose N = 8 is native. This module is that form, written as
inline PTX (``plgpu.inline_mgpu``). The Mosaic GPU interpreter runs no PTX: interpret mode
computes the same product with jnp from the same fragment-ordered x buffer
(``plane_product(..., emulate=True)``), so everything but the PTX itself (x's permutation, the
padded ring, the kernels' plumbing) is checked on CPU. On the H200 (session 18) it is the
default for x's 8 rows on 512-row stream-K steps, where it measured 6-8% faster; with 64-column
planes and at 16 rows it measured slower (``MosaicConfig``'s docstring).

Fragments (PTX ISA, ``mma.m16n8k16`` with .bf16 / .f16, row.col), g = lane / 4, t = lane % 4:
  A (16 x 16, per warp): a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t + 8..),
     a3 = (g + 8, 2t + 8..). A 16-bit ``[64, span2]`` array in Pallas's WGMMA layout has
     registers of shape ``(1, span2 / 8, 1, 1, 2, 1, 1, 1, 1)``: register ``[0, c, 0, 0, r]``
     holds row g + 8r of the warp's 16 rows, columns 8c + 2t and 8c + 2t + 1. So k16 block j's
     A fragment is registers (c, r) = (2j, 0), (2j, 1), (2j + 1, 0), (2j + 1, 1): the plane the
     dequant already produces, unchanged.
  B (16 x 8): b0 = x[n = g, k = 2t..2t+1], b1 = x[g, 2t + 8..2t + 9] in each k16 block.
  C / D (16 x 8, float32): (g, 2t..2t+1) and (g + 8, 2t..): the WGMMA layout of a float32
     ``[64, 8]`` tile (registers ``[.., r, ..]`` of vector<2xf32>, r = row half). At m_pad 16
     the ``[64, 16]`` accumulator is two such n8 tiles (column blocks), each its own chain of
     mma.sync with B from x's rows 8 nt + g.

x's planes are stored in fragment order (``permute_planes``, when XLA prepares them): thread t's
32 values of a 128-column plane (b0, b1 of the 8 k16 blocks) lie in 4 chunks of 16 bytes, chunk
v at byte 64 v + 16 t of the row, and rows are ``pitch`` = span2 + 32 elements apart (64 bytes
of padding per row), so the 8 threads of a quarter-warp's 16-byte loads hit distinct banks. The
same K permutation on x and no change on the weight: a sum over K does not depend on the
order of its terms' positions, only on their pairing, which the permutation keeps.
"""
from __future__ import annotations

import numpy as np

import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm

PAD = 32             # bf16 elements of padding per x row (64 bytes: see the module docstring)
SPANS = (64, 128)    # plane widths served (block_k 256 and 512): whole 16-byte chunks per thread
ROWS = (8, 16)       # x rows (m_pad) served: one or two n8 tiles of mma.sync


def pitch(span2: int) -> int:
  """Elements from one stored x row to the next."""
  return span2 + PAD


def source_columns(span2: int) -> np.ndarray:
  """For each stored position of a plane's row (``span2`` of them, before the padding), the plane
  column it holds: chunk v (16 bytes) of thread t at elements ``32 v + 8 t ..``, each chunk two
  k16 blocks j = 2v, 2v + 1 of (b0, b1) = columns (16j + 2t, +1, 16j + 2t + 8, +9)."""
  if span2 not in SPANS:
    raise ValueError(f"span2 must be one of {SPANS}, got {span2}")
  cols = np.empty(span2, np.int32)
  for v in range(span2 // 32):
    for t in range(4):
      for w in range(8):
        j, u = 2 * v + w // 4, w % 4
        cols[32 * v + 8 * t + w] = 16 * j + 2 * t + (0, 1, 8, 9)[u]
  return cols


def permute_planes(xt: jnp.ndarray) -> jnp.ndarray:
  """x's planes ``[C, m_pad, span2]`` -> ``[C, m_pad, pitch]`` in fragment order, zero-padded."""
  span2 = xt.shape[-1]
  if span2 not in SPANS:
    raise ValueError(f"span2 must be one of {SPANS}, got {span2}")
  lead = xt.shape[:-1]
  return jnp.pad(fragment_order(xt), [(0, 0)] * len(lead) + [(0, PAD)])


def fragment_order(x: jnp.ndarray, *, inverse: bool = False) -> jnp.ndarray:
  """``source_columns`` on the last axis as a reshape + transpose: column
  32 v + 16 jj + 8 h + 2 t + l is stored at 32 v + 8 t + 4 jj + 2 h + l (``inverse``: back).
  Not a gather: XLA ran that as a kernel of its own (+2 us a call at M = 1, 8192 x 8192,
  session 18), and a Mosaic GPU kernel (the interpret-mode product) cannot close over its
  index array; the transpose fuses into the planes' transpose."""
  lead, span2 = x.shape[:-1], x.shape[-1]
  if inverse:                                           # (v, t, jj, h, l) -> (v, jj, h, t, l)
    return jnp.moveaxis(x.reshape(*lead, span2 // 32, 4, 2, 2, 2), -4, -2).reshape(x.shape)
  return jnp.moveaxis(x.reshape(*lead, span2 // 32, 2, 2, 4, 2), -2, -4).reshape(x.shape)


def thread_chunk_offsets(span2: int, g: int, t: int) -> list[int]:
  """Element offsets (from the plane's start) of thread (g, t)'s 16-byte chunks: the addresses
  ``plane_product`` loads, for tests and for reading the kernel."""
  return [g * pitch(span2) + 32 * v + 8 * t for v in range(span2 // 32)]


def mma_m16n8k16(a: list, b: list, d: list, *, kind: str = "bf16") -> list:
  """One ``mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32`` (inside an
  ``inline_mgpu`` body): A fragment ``a`` (4 x i32), B fragment ``b`` (2 x i32), float32
  accumulator ``d`` (4 x f32) in, the new accumulator (4 x f32) out."""
  f32 = ir.F32Type.get()
  quad = ir.Type.parse("!llvm.struct<(f32, f32, f32, f32)>")
  asm = (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 {{$0, $1, $2, $3}}, "
         "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
  constraints = ",".join(["=f"] * 4 + ["r"] * 6 + ["f"] * 4)
  res = llvm.inline_asm(quad, [*a, *b, *d], asm, constraints)
  return [llvm.extractvalue(f32, res, [i]) for i in range(4)]


def accumulator_values(tile) -> list:
  """The 4 float32 values (d0..d3: row g, columns 2t, 2t + 1; row g + 8, the same) a thread
  holds of a float32 ``[64, 8]`` WGMMA-layout tile (two vector<2xf32> registers)."""
  i32 = ir.IntegerType.get_signless(32)
  pos = [mgpu.utils.c(i, i32) for i in range(2)]
  return [llvm.extractelement(tile.registers[i], p) for i in np.ndindex(tile.registers.shape)
          for p in pos]


def with_accumulator_values(tile, d: list):
  """``tile`` (a float32 ``[64, 8]`` WGMMA-layout FragmentedArray) holding the values ``d``."""
  i32 = ir.IntegerType.get_signless(32)
  pos = [mgpu.utils.c(i, i32) for i in range(2)]
  out = tile.registers.copy()
  for h, i in enumerate(np.ndindex(tile.registers.shape)):
    vec = llvm.insertelement(tile.registers[i], d[2 * h], pos[0])
    out[i] = llvm.insertelement(vec, d[2 * h + 1], pos[1])
  return mgpu.FragmentedArray(_registers=out, _layout=tile.layout, _is_signed=None)


def plane_product(vals, x_plane, acc, *, emulate: bool = False):
  """``acc + vals @ x^T`` for one plane: vals ``[64, span2]`` (WGMMA layout, the dequantized
  weight rows of this warpgroup), x_plane an SMEM ref ``[8, pitch]`` (fragment order), acc a
  float32 ``[64, 8]`` WGMMA tile. Each warp runs its 16 rows as ``span2 / 16`` chained
  ``mma.sync.m16n8k16`` (float32 accumulate) per 8 rows of x (x_plane ``[16, pitch]`` and acc
  ``[64, 16]`` at m_pad 16: two independent chains). ``emulate`` (interpret mode, which runs
  no PTX): the same product with jnp from the same fragment-ordered buffer, so that the x
  permutation, the padded ring and the kernel's plumbing are checked on CPU; only the PTX is
  not."""
  span2, rows = vals.shape[1], x_plane.shape[0]
  if span2 not in SPANS:
    raise NotImplementedError(f"mma_sync serves planes of {SPANS} columns, got {span2}")
  if rows not in ROWS:
    raise NotImplementedError(f"mma_sync serves {ROWS} rows of x, got {rows}")
  if emulate:
    x = fragment_order(x_plane[...][:, :span2].astype(jnp.float32), inverse=True)
    return acc + jnp.dot(vals.astype(jnp.float32), x.T, preferred_element_type=jnp.float32)
  kind = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "f16"}[jnp.dtype(vals.dtype)]

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), plgpu.Layout.WGMMA),
      return_type=plgpu.ShapeDtypeStruct((64, rows), jnp.float32, layout=plgpu.Layout.WGMMA))
  def product(_, a, x_ref, c):
    i32 = ir.IntegerType.get_signless(32)
    v4 = ir.VectorType.get((4,), i32)
    lane = arith.remui(mgpu.utils.thread_idx(), mgpu.utils.c(32, i32))
    g = arith.divui(lane, mgpu.utils.c(4, i32))
    t = arith.remui(lane, mgpu.utils.c(4, i32))
    # Byte offset of chunk 0: (g * pitch + 8 t) elements of 2 bytes.
    first = arith.addi(arith.muli(g, mgpu.utils.c(2 * pitch(span2), i32)),
                       arith.muli(t, mgpu.utils.c(16, i32)))
    base = mgpu.utils.memref_ptr(x_ref)
    a_regs = a.registers.reshape(span2 // 8, 2)          # (column block c, row half r)
    a_frags = [[mgpu.utils.bitcast(a_regs[2 * j + h, r], i32) for h in range(2) for r in range(2)]
               for j in range(span2 // 16)]
    d_all = accumulator_values(c)                        # 4 values per n8 tile, tile-major
    for nt in range(rows // 8):
      words = []
      for v in range(span2 // 32):
        off = arith.addi(first, mgpu.utils.c(2 * (8 * nt * pitch(span2) + 32 * v), i32))
        ptr = mgpu.utils.getelementptr(base, [off], ir.IntegerType.get_signless(8))
        chunk = llvm.load(v4, ptr, alignment=16)
        words += [llvm.extractelement(chunk, mgpu.utils.c(i, i32)) for i in range(4)]
      d = d_all[4 * nt:4 * nt + 4]
      for j in range(span2 // 16):
        d = mma_m16n8k16(a_frags[j], [words[2 * j], words[2 * j + 1]], d, kind=kind)
      d_all[4 * nt:4 * nt + 4] = d
    return with_accumulator_values(c, d_all)

  return product(vals, x_plane, acc)

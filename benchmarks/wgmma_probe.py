"""How fast are the W4A16 decode kernel's skinny wgmmas? Tensor-core throughput at small N.

The decode kernel computes y^T = W^T x^T with the dequantized weight tile as wgmma's A operand
from registers (64 features) and x's plane as B from shared memory: ``m64 nN k128`` per plane,
N = m_pad = 8 at M <= 8, four planes per step into four accumulators, then one wait. At
1 x 8192 x 28672 that is 229,376 k16 wgmma instructions (3.76 GFLOP with the padded N), 1,738 per
SM. If a k16 instruction with N = 8 costs the tensor cores as much time as the dense peak
predicts (8,192 FMAs: ~8 cycles), they need ~7 us of the kernel's ~37.5; if small N runs far
below peak (a per-instruction floor), the tensor cores rather than the dequant or the loads may
be what the kernel's last ~6 us are made of. This probe measures it with no memory traffic at
all: each CTA repeats ``steps`` times the kernel's step shape (4 planes, ``m64 nN k128`` each,
A from registers or from SMEM, one wait per step, the partials summed as the kernel scales
them) and reports TFLOP/s on the padded N, for N = 8 ... 256 and 132 / 264 CTAs; and the same
work at N = 8 in Ampere's warp-level ``mma.sync m16n8k16`` (constant operands; the same
inline-PTX helpers as ``quant/matmul/mma_sync.py``), the instruction Marlin's decode kernels
use.

  PYTHONPATH=$PWD python3 benchmarks/wgmma_probe.py --out $OUT [--steps 4096]

Prediction (written before the first run, session 17): N = 8 with A from registers well below
its share of the dense peak (under ~200 TFLOP/s against ~660 at N = 256), i.e. the tensor-core
time of the M = 1 decode call alone ~20 us or more; if so, a Marlin-style ``mma.sync m16n8k16``
(N = 8 native, per warp) is the instruction to try at M <= 8.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import timing  # noqa: E402  pylint: disable=wrong-import-position
from quant.matmul import mma_sync  # noqa: E402  pylint: disable=wrong-import-position

PLANES = 4        # wgmmas per step (one per nibble plane in the decode kernel)
SPAN = 128        # K rows of one plane (block_k 512 / 4)
ROWS = 64         # wgmma's M: 64 features per warpgroup
_TILED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def step_flops(n: int) -> int:
  return 2 * ROWS * n * SPAN * PLANES


def wgmma_loop(x, w, *, n: int, ctas: int, steps: int, a_in_registers: bool,
               interpret: bool = False):
  """Each CTA: ``steps`` x (4 wgmmas m64 nN k128 into 4 accumulators, one wait, partials
  summed into a float32 total); x [n, 128] (B, in SMEM) and w [64, 128] (A) bf16. Every
  output row is ``steps * 4 * w @ x.T``. (The Mosaic GPU interpreter has no register operands:
  ``interpret`` runs the SMEM form.)"""

  def body(x_ref, w_ref, o_ref, x_smem, w_smem, bar):
    cta = jax.lax.axis_index("c")
    plgpu.copy_gmem_to_smem(x_ref, x_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(w_ref, w_smem, bar.at[1])
    plgpu.barrier_wait(bar.at[0])
    plgpu.barrier_wait(bar.at[1])
    a = (plgpu.load(w_smem, (), layout=plgpu.Layout.WGMMA) if a_in_registers and not interpret
         else w_smem)
    b = x_smem.T

    def mma(*accs):
      for acc in accs:
        plgpu.wgmma(acc, a, b)
      plgpu.wgmma_wait(0)
      return [acc[...] for acc in accs]

    def step(_, total):
      parts = pl.run_scoped(mma, *[plgpu.ACC((ROWS, n), jnp.float32) for _ in range(PLANES)])
      for part in parts:
        total = total + part
      return total

    zeros = plgpu.layout_cast(jnp.zeros((ROWS, n), jnp.float32), plgpu.Layout.WGMMA)
    total = jax.lax.fori_loop(0, steps, step, zeros)
    o_ref[pl.ds(cta * ROWS, ROWS)] = total

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((ctas * ROWS, n), jnp.float32), grid=(ctas,),
      grid_names=("c",),
      scratch_types=(plgpu.SMEM((n, SPAN), jnp.bfloat16, transforms=_TILED),
                     plgpu.SMEM((ROWS, SPAN), jnp.bfloat16, transforms=_TILED),
                     plgpu.Barrier(num_barriers=2)),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
      kernel_name=f"wgmma_probe_n{n}")(x, w)


_BF16_ONE, _BF16_HALF = 0x3F80, 0x3F00      # bf16 bit patterns of 1.0 and 0.5


def _mma_sync_step(acc):
  """Per warp, 4 planes x 8 ``mma.sync.m16n8k16`` (bf16 in, float32 accumulate) into the
  planes' accumulators, on constant operands A = 1.0 and B = 0.5: the decode step's tensor-core
  work at N = 8 in Ampere's warp-level instruction (Marlin's). The WGMMA layout of a float32
  [64, 8] tile is mma.sync's accumulator fragment per warp (rows g and g + 8 of the warp's 16,
  columns 2t, 2t + 1), so ``acc`` [4, 64, 8] (one tile per plane) holds each plane's D."""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,) * PLANES,
                     return_type=tuple(plgpu.ShapeDtypeStruct((ROWS, 8), jnp.float32,
                                                              layout=plgpu.Layout.WGMMA)
                                       for _ in range(PLANES)))
  def step(_, *tiles):
    i32 = ir.IntegerType.get_signless(32)
    a = mgpu.utils.c(_BF16_ONE * 0x10001, i32)
    b = mgpu.utils.c(_BF16_HALF * 0x10001, i32)
    outs = []
    for tile in tiles:
      d = mma_sync.accumulator_values(tile)
      for _ in range(SPAN // 16):                    # a plane: k128 = 8 chained k16 steps
        d = mma_sync.mma_m16n8k16([a] * 4, [b] * 2, d)
      outs.append(mma_sync.with_accumulator_values(tile, d))
    return tuple(outs)

  return step(*acc)


def mma_sync_loop(*, ctas: int, steps: int):
  """Each CTA (one warpgroup): ``steps`` x ``_mma_sync_step``, then the four planes' float32
  tiles summed; every output element is ``steps * 4 * 8 * 16 * 1.0 * 0.5 = 256 steps``."""

  def body(o_ref):
    cta = jax.lax.axis_index("c")
    zero = plgpu.layout_cast(jnp.zeros((ROWS, 8), jnp.float32), plgpu.Layout.WGMMA)
    accs = jax.lax.fori_loop(0, steps, lambda _, a: _mma_sync_step(a), (zero,) * PLANES)
    o_ref[pl.ds(cta * ROWS, ROWS)] = sum(accs[1:], accs[0])

  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((ctas * ROWS, 8), jnp.float32),
                      grid=(ctas,), grid_names=("c",), kernel_name="mma_sync_probe")()


def variants(steps: int):
  """(name, fn(x, w), n, ctas, expected output value) for every probe configuration."""
  out = []
  wgmma_value = steps * PLANES * 0.5               # w = 1/128, x = 0.5: 0.5 per plane
  for n in (8, 16, 32, 64, 128, 256):
    for ctas in (132, 264):
      for regs in (True, False):
        if n == 256 and ctas == 264:
          continue
        name = f"n{n}_c{ctas}_{'reg' if regs else 'smem'}"
        out.append((name, functools.partial(wgmma_loop, n=n, ctas=ctas, steps=steps,
                                            a_in_registers=regs), n, ctas, wgmma_value))
  for ctas in (132, 264):
    out.append((f"mmasync_n8_c{ctas}",
                lambda x, w, ctas=ctas: mma_sync_loop(ctas=ctas, steps=steps), 8, ctas,
                steps * PLANES * SPAN * 0.5))
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--steps", type=int, default=4096)
  ap.add_argument("--only", default="", help="comma-separated name prefixes")
  ap.add_argument("--budget-s", type=float, default=150)
  args = ap.parse_args()
  start, rows = time.time(), []
  w = jnp.full((ROWS, SPAN), 1.0 / SPAN, jnp.bfloat16)
  for name, fn, n, ctas, value in variants(args.steps):
    if args.only and not any(name.startswith(p) for p in args.only.split(",")):
      continue
    if time.time() - start > args.budget_s:
      rows.append(dict(name=name, error="budget"))
      continue
    x = jnp.full((n, SPAN), 0.5, jnp.bfloat16)
    try:
      f = jax.jit(fn)
      got = jax.block_until_ready(f(x, w))
      ok = bool(jnp.allclose(got, value, rtol=1e-3))
      t = timing.measure(f, (x, w), iterations=10)
      flops = step_flops(n) * args.steps * ctas
      k16 = ctas * args.steps * PLANES * SPAN // 16          # k16 wgmma instructions
      # Tensor-core time per k16 instruction per SM at ~1.98 GHz (132 SMs share the work).
      row = dict(name=name, n=n, ctas=ctas, ms=t.ms, tflops=flops / t.ms / 1e9, correct=ok,
                 method=t.method, cycles_per_k16_per_sm=t.ms * 1e-3 * 1.98e9 / (k16 / 132))
    except Exception as e:  # pylint: disable=broad-except
      row = dict(name=name, error=f"{type(e).__name__}: {str(e)[:300]}")
    rows.append(row)
    print(row, flush=True)
  # What the M = 1 decode call (8192 x 28672, N padded to 8) would spend on its wgmmas at the
  # measured N = 8 rate, register A, two CTAs per SM (the kernel's form).
  decode_flops = 2 * 8192 * 28672 * 8
  for r in rows:
    if r.get("name") in ("n8_c264_reg", "mmasync_n8_c264") and "ms" in r:
      print(f"M=1 8192x28672 tensor-core time at the {r['name']} rate: "
            f"{decode_flops / r['tflops'] / 1e6:.1f} us", flush=True)
  timing.write_json(os.path.join(args.out, "wgmma_probe.json"),
                    dict(meta=timing.metadata(), steps=args.steps, rows=rows))


if __name__ == "__main__":
  main()

"""How fast can a Mosaic GPU kernel stream HBM? The W4A16 decode bar's question (issue #5).

At M = 1 and 16 the W4A16 bar (3.7x XLA's bf16 matmul) asks for the int4 bytes at XLA's own HBM
rate (~4.4 TB/s). The shipped decode kernel's memory pipeline alone (TMA ring, no compute) runs
at ~3.87 TB/s whatever its ring depth, CTA width or grid form (NOTES.md, sessions 7-9). This
probe times two bare streams over the same bytes, with no W4A16 logic at all:

  tma     ``plgpu.emit_pipeline``: one warpgroup per CTA, a ring of ``stages`` TMA boxes of
          [rows, 256] int32 into SMEM, an empty body (the copies and their barriers only)
  direct  no SMEM: each thread loads 16-byte vectors straight from HBM into registers
          (``WG_STRIDED`` layout, consecutive threads on consecutive 16 bytes) and xors them
          into an accumulator; ``dist`` steps are in flight (loaded into loop-carried registers
          ``dist`` iterations before use), i.e. the software prefetch a GEMV kernel uses

  extras  the tma ring plus the W4A16 decode kernel's other per-step copies (scale / zero rows,
          x's planes from L2), one kind at a time

against XLA in the same process: ``jnp.bitwise_xor.reduce`` over the same array, and the bf16
[1, 8192] x [8192, 28672] matmul whose rate defines the bar. Each kernel reads one of four
copies per call in turn (536 MB, 10x the L2), so no call finds its bytes in L2.

  PYTHONPATH=$PWD python3 benchmarks/stream_probe.py --out $OUT
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402  pylint: disable=wrong-import-position

WORDS = 1 << 25                    # int32 words per copy: 134 MB, about the W4A16 weight's bytes
COPIES = 4


def direct_stream(x, *, ctas: int, rows: int, dist: int):
  """xor of ``x`` [R, C] int32 over rows, read straight into registers; [ctas * rows, C] out."""
  r, c = x.shape
  steps = r // (rows * ctas)
  lay = plgpu.Layout.WG_STRIDED((rows, c), vec_size=4)

  def body(x_ref, o_ref):
    cta = lax.axis_index("c")

    def load(t):
      t = jnp.minimum(t, steps - 1)                 # the last dist loads re-read a step
      r0 = pl.multiple_of((t * ctas + cta) * rows, rows)
      return plgpu.load(x_ref.at[pl.ds(r0, rows)], (), layout=lay)

    init = (jnp.zeros((rows, c), jnp.int32),) + tuple(load(i) for i in range(dist))

    def step(t, carry):
      acc, cur, *rest = carry
      return (acc ^ cur, *rest, load(t + dist))

    acc = lax.fori_loop(0, steps, step, init)[0]
    o_ref[pl.ds(cta * rows, rows)] = acc

  out = jax.ShapeDtypeStruct((ctas * rows, c), jnp.int32)
  return plgpu.kernel(body, out_type=out, grid=(ctas,), grid_names=("c",))(x)


def tma_stream(x, *, ctas: int, rows: int, stages: int, private: bool = False):
  """The same bytes through a TMA ring of ``stages`` [rows, C] boxes with an empty body. Boxes
  are dealt round-robin (at any moment the CTAs read one contiguous stretch), or with
  ``private`` each CTA streams its own contiguous region (the W4A16 kernel's order: each CTA
  its own features, far apart from the others')."""
  r, c = x.shape
  steps = r // (rows * ctas)
  where = (lambda t, cta: cta * steps + t) if private else (lambda t, cta: t * ctas + cta)

  def body(x_ref, o_ref):
    cta = lax.axis_index("c")
    plgpu.emit_pipeline(lambda _, x_smem: None, grid=(steps,),
                        in_specs=[plgpu.BlockSpec((rows, c), lambda t: (where(t, cta), 0))],
                        max_concurrent_steps=stages)(x_ref)
    o_ref[pl.ds(cta * 128, 128)] = jnp.zeros((128,), jnp.int32)  # a side effect per CTA

  out = jax.ShapeDtypeStruct((ctas * 128,), jnp.int32)
  return plgpu.kernel(body, out_type=out, grid=(ctas,), grid_names=("c",))(x)


def tma_extras_stream(x, scales, zeros, xs, *, ctas: int, rows: int, stages: int,
                      with_x: bool, with_sz: bool):
  """``tma_stream`` (round-robin, [rows, C] int32 boxes) plus the W4A16 decode kernel's other
  copies of a step: with ``with_sz`` a [4, 64] bf16 box (512 bytes: 4 groups of 64 features)
  of ``scales`` and one of ``zeros`` ([4 U, 64], U the number of code boxes); with ``with_x``
  an 8 KB [4, 8, 128] bf16 box of ``xs`` ([64, 8, 128], 128 KB: stays in L2, like x's planes,
  which every CTA reads). Which of them costs the ~10% between this ring and the kernel's
  memory pipeline?"""
  r, c = x.shape
  steps = r // (rows * ctas)
  specs = [plgpu.BlockSpec((rows, c), lambda t, cta: (t * ctas + cta, 0))]
  refs = [x]
  if with_sz:
    for a in (scales, zeros):
      specs.append(plgpu.BlockSpec((4, 64), lambda t, cta: (t * ctas + cta, 0)))
      refs.append(a)
  if with_x:
    specs.append(plgpu.BlockSpec((4, 8, 128), lambda t, cta: (lax.rem(t, 16), 0, 0)))
    refs.append(xs)

  def body(*refs_and_out):
    *ins, o_ref = refs_and_out
    cta = lax.axis_index("c")
    bound = [plgpu.BlockSpec(sp.block_shape, functools.partial(
        lambda t, f: f(t, cta), f=sp.index_map)) for sp in specs]
    plgpu.emit_pipeline(lambda _, *smem: None, grid=(steps,), in_specs=bound,
                        max_concurrent_steps=stages)(*ins)
    o_ref[pl.ds(cta * 128, 128)] = jnp.zeros((128,), jnp.int32)

  out = jax.ShapeDtypeStruct((ctas * 128,), jnp.int32)
  return plgpu.kernel(body, out_type=out, grid=(ctas,), grid_names=("c",))(*refs)


def extras_variants(scales, zeros, xs):
  """The decode kernel's per-step copies on top of the bare ring (``tma_extras_stream``)."""
  out = []
  for ctas in (132, 264):
    steps = WORDS // 256 // (16 * ctas)
    codes = steps * 16 * ctas * 256 * 4
    for name, with_x, with_sz in (("bare", False, False), ("x", True, False),
                                  ("sz", False, True), ("x_sz", True, True)):
      extra = 2 * steps * ctas * 512 if with_sz else 0
      fn = functools.partial(tma_extras_stream, scales=scales, zeros=zeros, xs=xs, ctas=ctas,
                             rows=16, stages=4, with_x=with_x, with_sz=with_sz)
      out.append((f"extras_{name}_c{ctas}_r16x256_s4", lambda x, fn=fn: fn(x), 256,
                  codes + extra))
  return out


def variants():
  """(name, fn, row width C, bytes read per call)."""
  out = []
  for ctas in (132, 264, 528):
    for rows, dist in ((4, 1), (4, 2), (4, 3), (8, 1), (8, 2), (2, 4)):
      if ctas == 528 and rows == 8:
        continue
      steps = WORDS // 1024 // (rows * ctas)
      out.append((f"direct_c{ctas}_r{rows}x1024_d{dist}",
                  functools.partial(direct_stream, ctas=ctas, rows=rows, dist=dist), 1024,
                  steps * rows * ctas * 1024 * 4))
  for ctas in (132, 264):
    for rows, stages in ((16, 4), (32, 2), (32, 4), (64, 2), (64, 3), (16, 8)):
      if ctas == 264 and rows * stages * 1024 > 110 * 1024:
        continue
      steps = WORDS // 256 // (rows * ctas)
      out.append((f"tma_c{ctas}_r{rows}x256_s{stages}",
                  functools.partial(tma_stream, ctas=ctas, rows=rows, stages=stages), 256,
                  steps * rows * ctas * 256 * 4))
  for ctas, rows, stages in ((132, 16, 4), (264, 16, 4), (132, 64, 3)):
    steps = WORDS // 256 // (rows * ctas)
    out.append((f"tma_private_c{ctas}_r{rows}x256_s{stages}",
                functools.partial(tma_stream, ctas=ctas, rows=rows, stages=stages, private=True),
                256, steps * rows * ctas * 256 * 4))
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--only", default="", help="comma-separated name prefixes")
  ap.add_argument("--budget-s", type=float, default=240)
  args = ap.parse_args()
  start = time.time()
  rows = []
  key = jax.random.key(0)
  base = {c: [jax.random.randint(jax.random.fold_in(key, i), (WORDS // c, c), -2**31, 2**31 - 1,
                                 jnp.int32) for i in range(COPIES)] for c in (256, 1024)}

  def timed(name, one, xs, nbytes, check=None):
    fn = jax.jit(lambda *xs: [one(x) for x in xs])
    try:
      outs = jax.block_until_ready(fn(*xs))
      ok = None if check is None else bool(check(outs))
      t = timing.measure(fn, xs, iterations=10)
      ms = t.ms / len(xs)
      row = dict(name=name, ms=ms, tb_s=nbytes / ms / 1e9, method=t.method, correct=ok)
    except Exception as e:  # pylint: disable=broad-except
      row = dict(name=name, error=f"{type(e).__name__}: {str(e)[:300]}")
    rows.append(row)
    print(row, flush=True)

  # Peers: XLA's reduction over the same bytes, and the bf16 GEMV that sets the W4A16 bar.
  xla_xor = lambda x: lax.reduce(x, jnp.int32(0), lax.bitwise_xor, (0,))
  timed("xla_xor_reduce", xla_xor, base[1024], WORDS * 4)
  if args.only:
    w = []
  else:
    w = [jax.random.normal(jax.random.fold_in(key, 9 + i), (8192, 28672), jnp.bfloat16)
         for i in range(2)]
  xv = jnp.ones((1, 8192), jnp.bfloat16)
  if w:
    timed("xla_bf16_gemv_8192x28672", lambda wi: xv @ wi, w, 8192 * 28672 * 2)
  del w
  boxes = WORDS // 256 // 16
  scales = jnp.ones((4 * boxes, 64), jnp.bfloat16)
  zeros = jnp.ones((4 * boxes, 64), jnp.bfloat16)
  xs = jnp.ones((64, 8, 128), jnp.bfloat16)
  for name, one, c, nbytes in variants() + extras_variants(scales, zeros, xs):
    if args.only and not any(name.startswith(p) for p in args.only.split(",")):
      continue
    if time.time() - start > args.budget_s:
      rows.append(dict(name=name, error="budget"))
      continue
    check = None
    if name.startswith("direct"):
      # The kernel's per-CTA partial xors, reduced: XLA's xor over the rows the kernel covers.
      covered = nbytes // 4 // c
      check = lambda outs, covered=covered: all(
          bool((xla_xor(o) == xla_xor(x[:covered])).all()) for o, x in zip(outs, base[c]))
    timed(name, one, base[c], nbytes, check)
  timing.write_json(os.path.join(args.out, "stream_probe.json"),
                    dict(meta=timing.metadata(), words=WORDS, copies=COPIES, rows=rows))


if __name__ == "__main__":
  main()

"""Where does the Mosaic W4A16 decode kernel spend its time? Leave-one-stage-out timings.

METHOD.md's way of placing time inside a kernel without hardware counters: time variants that
leave one stage out and take differences. Each variant below re-traces
``quant.matmul.mosaic`` with one piece replaced (by patching the names the kernel body looks
up at trace time; the library is not changed), so its output is WRONG on purpose and is not
checked -- only the base variant's error is:

  base      the shipped kernel (default config)
  nodq      no dequantization: the int16 codes are bitcast straight to the operand dtype
            (shift/and/or gone; the bf16x2 subtract of B + z stays)
  half_mma  planes 1 and 3 of every step skipped (their wgmmas, and their dequant, which is
            then dead code): half the tensor-core and ALU work, the same bytes
  no_mma    no wgmma at all (and so no code loads or dequant): the TMA ring, barriers and
            scale loads only -- the memory pipeline's own ceiling
  no_mma_s2 / no_mma_s6 / no_mma_n128 / base_s2 / base_s6 / base_n128: ring depth and CTA width
  direct / direct_s2: a candidate (``MosaicConfig.direct_io``), error checked like base
  stream132 / stream264 / stream396: the stream-K form (``MosaicConfig.stream_ctas``), checked;
  no_mma_stream264: its memory pipeline alone
  two_ops   the dequant's and/or as two MLIR ops (what ran before session 9), checked
  late / late_stream264 / late_stream132: ``MosaicConfig.late_zero`` (no packed subtract),
            checked
  bk256 / bk256_s6 / bk256_n128: weights laid out for 256-row steps (fewer live registers,
            more CTAs per SM), checked
  tile / no_mma_tile / tile_direct / no_mma_tile_direct / tile_stream264 / no_mma_direct: the
            weight in tile-major storage (``prepare_mosaic(..., tile_major=True)``: each TMA box
            one contiguous run of memory instead of 64 rows of block_k/2 bytes Kp/2 apart), and
            x read as [M, K] by the TMA unit (rows >= M zero-filled: 1/8 of x's L2 traffic at
            M = 1), alone and together, with and without the compute
  mmasync / mmasync_*: warp-level mma.sync at x's 8 rows (``MosaicConfig.mma_sync``), checked
  split_half: the K split halved; base_again: base timed last (the first of a row runs slow)
  oreg / wide_oreg / n256_oreg / n256_s2_oreg / s4_oreg / bk256_n128_oreg / oreg_split2x /
            s2_oreg_split2x: partials stored from registers (``MosaicConfig.out_registers``)
            and the wider or deeper CTAs, or two CTAs per SM, that the freed SMEM allows
  scope1 / acc128 / acc256: groups sharing one wgmma wait (``MosaicConfig.acc_columns``)
  pipe: stream-K with one group's wgmmas in flight (``MosaicConfig.pipeline``), checked

Also the per-kernel breakdown of one call (CUPTI, ``aggregate=False``): the int4 kernel and the
XLA kernels around it (x's pad/plane transpose, the split-K sum/slice/transpose/cast).

  PYTHONPATH=$PWD python3 benchmarks/w4a16_probe.py --out $OUT [--budget-s 150]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_HERE), _HERE):
  if _p not in sys.path:
    sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental.mosaic import gpu as mgpu  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402
from jaxlib.mlir import ir  # noqa: E402
from jaxlib.mlir.dialects import arith  # noqa: E402

import quant  # noqa: E402
import timing  # noqa: E402
from quant.matmul import layout  # noqa: E402
from quant.matmul import mosaic as w4  # noqa: E402
from quant.matmul import mosaic_stream as w4_stream  # noqa: E402
from quant.matmul import mosaic_common as w4_common  # noqa: E402  (the plane dequant)
from quant.matmul.config import default_mosaic_config, fit_mosaic_config  # noqa: E402

SHAPES = ((1, 8192, 28672), (1, 8192, 8192), (16, 8192, 28672))
L2_BYTES = 60e6
HBM_TBPS = 4.4


class _Plgpu:
  """``plgpu`` with ``wgmma`` (and optionally ``copy_gmem_to_smem``) replaced; everything else
  passes through."""

  def __init__(self, wgmma, copy=None):
    self.wgmma = wgmma
    if copy is not None:
      self.copy_gmem_to_smem = copy

  def __getattr__(self, name):
    return getattr(plgpu, name)


def _copies_without(*kinds):
  """``copy_gmem_to_smem`` that drops the decode kernel's copies of the given kinds ("x": x's
  planes, a floating [.., span2] box; "sz": scale / zero rows, a floating [.., 64] box), each
  replaced by a plain arrival on its barrier so that the slot's arrival count still holds.
  The int16 code boxes always go. Session 16: which per-step copy costs the ~10% between a
  bare TMA ring (4.3-4.4 TB/s, stream_probe.py) and this kernel's memory pipeline (3.87)?"""
  def copy(src, dst, barrier=None, **kw):
    dtype, last = dst.dtype, dst.shape[-1]
    kind = None if dtype == jnp.int16 else ("sz" if last == 64 else "x")
    if kind in kinds and barrier is not None:
      plgpu.barrier_arrive(barrier)
      return None
    return plgpu.copy_gmem_to_smem(src, dst, barrier, **kw)
  return copy


def _skip_odd_planes():
  calls = [0]

  def wgmma(acc, a, b, **kw):
    i = calls[0]
    calls[0] += 1
    if i % 2 == 0:
      plgpu.wgmma(acc, a, b, **kw)
  return _Plgpu(wgmma)


def _two_ops(word, mask: int, magic: int):
  """The dequant's and/or as two MLIR ops (before session 9: ptxas made two LOP3s of them)."""
  i32 = ir.IntegerType.get_signless(32)
  return arith.ori(arith.andi(word, mgpu.utils.c(mask, i32)), mgpu.utils.c(magic, i32))


PATCHES = {
    "base": {},
    "nodq": dict(_codes=lambda codes, p, st: lax.bitcast_convert_type(codes, st.dtype)),
    "half_mma": dict(plgpu=_skip_odd_planes),
    "no_mma": dict(plgpu=lambda: _Plgpu(lambda *a, **k: None)),
    "no_mma_nox": dict(plgpu=lambda: _Plgpu(lambda *a, **k: None, _copies_without("x"))),
    "no_mma_nosz": dict(plgpu=lambda: _Plgpu(lambda *a, **k: None, _copies_without("sz"))),
    "no_mma_codes": dict(plgpu=lambda: _Plgpu(lambda *a, **k: None,
                                              _copies_without("x", "sz"))),
    "two_ops": dict(_and_or=_two_ops),
}
VARIANTS = (  # name, patch, config overrides (or a function of the default config to them)
    ("base", "base", {}), ("nodq", "nodq", {}), ("half_mma", "half_mma", {}),
    ("no_mma", "no_mma", {}), ("no_mma_s2", "no_mma", dict(num_stages=2)),
    ("no_mma_s6", "no_mma", dict(num_stages=6)), ("no_mma_n128", "no_mma", dict(block_n=128)),
    ("base_s2", "base", dict(num_stages=2)), ("base_s6", "base", dict(num_stages=6)),
    ("base_n128", "base", dict(block_n=128)),
    ("direct", "base", dict(direct_io=True)),         # a candidate, not a probe: checked
    ("direct_s2", "base", dict(direct_io=True, num_stages=2)),
    # Stream-K (MosaicConfig.stream_ctas): 1, 2 and 3 CTAs per SM; and its memory pipeline alone.
    ("stream132", "base", dict(stream_ctas=132)), ("stream264", "base", dict(stream_ctas=264)),
    ("stream396", "base", dict(stream_ctas=396)),
    ("no_mma_stream264", "no_mma", dict(stream_ctas=264)),
    # Tile-major weight storage (one contiguous run per TMA box) and x's L2 traffic.
    ("tile", "base", dict(tile_major=True)), ("no_mma_tile", "no_mma", dict(tile_major=True)),
    ("no_mma_direct", "no_mma", dict(direct_io=True)),
    ("no_mma_tile_direct", "no_mma", dict(tile_major=True, direct_io=True)),
    ("tile_direct", "base", dict(tile_major=True, direct_io=True)),
    ("tile_stream264", "base", dict(tile_major=True, stream_ctas=264)),
    # Session 9 (Nsight Compute's instruction mix): the and/or as one lop3 (now in base) against
    # the two LOP3s ptxas made before; late_zero (no packed subtract), alone and with stream-K.
    ("two_ops", "two_ops", {}), ("late", "base", dict(late_zero=True)),
    ("late_stream264", "base", dict(late_zero=True, stream_ctas=264)),
    ("late_stream132", "base", dict(late_zero=True, stream_ctas=132)),
    # With one lop3, are more CTAs per SM worth it? 256-row steps halve the live planes
    # (200 -> ~120 registers a thread: 3-4 CTAs per SM instead of 2).
    ("bk256", "base", dict(layout_block_k=256, num_stages=4)),
    ("bk256_s6", "base", dict(layout_block_k=256, num_stages=6)),
    ("bk256_n128", "base", dict(layout_block_k=256, num_stages=4, block_n=128)),
    # Session 16: the memory pipeline without x's copies, without the scale / zero copies, and
    # with the code boxes alone (the bare-ring comparison of stream_probe.py's extras).
    ("no_mma_nox", "no_mma_nox", {}), ("no_mma_nosz", "no_mma_nosz", {}),
    ("no_mma_codes", "no_mma_codes", {}),
    # Session 17: the planes times x by warp-level mma.sync m16n8k16 (M <= 8 only; a candidate,
    # checked like base), on the default form of each shape and on the grid form.
    ("mmasync", "base", dict(mma_sync=True)),
    ("mmasync_grid", "base", dict(mma_sync=True, stream_ctas=0)),
    # Session 18: at 8192 x 8192 and 28672 x 8192 (grid form, 256-row steps, split-K 4) the form
    # was 15-20% slower; is it the 64-column planes or the grid form?
    ("mmasync_bk512", "base", dict(mma_sync=True, layout_block_k=512)),
    ("mmasync_bk512_s264", "base", dict(mma_sync=True, layout_block_k=512, stream_ctas=264,
                                          split_k=1)),
    ("base_bk512_s264", "base", dict(layout_block_k=512, stream_ctas=264, split_k=1)),
    ("mmasync_s264", "base", dict(mma_sync=True, stream_ctas=264, split_k=1)),
    # Session 18, M = 64 on the split-K grid: half the split (one wave of one-CTA-per-SM CTAs),
    # and base timed again last (the first variant of a row runs ~5% slow).
    ("split_half", "base", lambda cfg: dict(split_k=max(1, cfg.split_k // 2))),
    # Session 19: partials stored from registers (MosaicConfig.out_registers), which frees the
    # output tile's SMEM for wider CTAs (x's planes read from L2 once per 128 / 256 features).
    ("oreg", "base", dict(out_registers=True)),
    ("wide_oreg", "base", dict(block_n=128, num_stages=2, out_registers=True)),
    ("n256_oreg", "base", lambda cfg: dict(block_n=256, num_stages=3, out_registers=True,
                                           split_k=2 * cfg.split_k if cfg.split_k > 1 else 1)),
    ("n256_s2_oreg", "base", dict(block_n=256, num_stages=2, out_registers=True)),
    ("s4_oreg", "base", dict(num_stages=4, out_registers=True)),
    ("bk256_n128_oreg", "base", dict(layout_block_k=256, num_stages=4, block_n=128,
                                     out_registers=True)),
    # Without the output tile, 256-row steps at 32-64 rows fit two CTAs per SM (four
    # warpgroups dequantizing): the K split doubled to fill them.
    ("oreg_split2x", "base", lambda cfg: dict(out_registers=True, split_k=2 * cfg.split_k)),
    ("s2_oreg_split2x", "base", lambda cfg: dict(num_stages=2, out_registers=True,
                                                 split_k=2 * cfg.split_k)),
    # Session 19: groups sharing one wgmma scope (MosaicConfig.acc_columns; the stream-K kernel
    # had one scope per group until then: scope1 is that form).
    ("scope1", "base", dict(acc_columns=8)), ("acc128", "base", dict(acc_columns=128)),
    ("acc256", "base", dict(acc_columns=256)),
    # Session 19: stream-K with one group's wgmmas in flight (MosaicConfig.pipeline there).
    ("pipe", "base", dict(pipeline=True)),
    # Session 20: x's planes in a ring of their own (MosaicConfig.x_slots): the default's ring
    # at 128 rows on 512-row steps (stream-K there), its depth, the grid instead of stream-K,
    # and at 40-64 rows (where the step ring fits too) the x ring against it.
    ("xring4", "base", dict(x_slots=4)), ("xring6", "base", dict(x_slots=6)),
    ("xring4_grid", "base", dict(x_slots=4, stream_ctas=0)),
    # Session 21: the x ring measured 1.6x slower than the step ring at 128 rows; 8192 x 28672
    # at 128 rows on 256-row steps instead (the step ring fits: 171 KB, stream-K 132), and the
    # grid form of it.
    ("bk256_wide", "base", dict(layout_block_k=256)),
    ("bk256_wide_grid", "base", dict(layout_block_k=256, stream_ctas=0)),
    # Session 21: x read as [M, K] by the TMA (MosaicConfig.direct_x; XLA's plane transpose of
    # x took 2.6-5.8 us of the 128-row calls), partials as before.
    ("direct_x", "base", dict(direct_x=True)),
    # Session 21: x's own ring on 512-row steps whatever the default config's layout (timed
    # with the step's codes read per plane, a change since reverted: no gain, NOTES call 3).
    ("xring4_bk512", "base", dict(layout_block_k=512, x_slots=4)),
    ("xring4_bk512_grid", "base", dict(layout_block_k=512, x_slots=4, stream_ctas=0)),
    # Session 22: parts of steps (MosaicConfig.step_parts; grid here, stream-K further down): a
    # slot holds half (a quarter of) a step's x, so two stages of 128 (256) rows fit
    # 128-feature CTAs; and the one accumulator (MosaicConfig.scaled_acc) that lets a call take
    # 256 rows.
    ("half512", "base", dict(layout_block_k=512, step_parts=2, stream_ctas=0, split_k=1,
                             block_n=128, num_stages=2, out_registers=True)),
    ("half512_split2", "base", dict(layout_block_k=512, step_parts=2, stream_ctas=0,
                                    split_k=2, block_n=128, num_stages=2, out_registers=True)),
    ("half512_scaled", "base", dict(layout_block_k=512, step_parts=2, stream_ctas=0, split_k=1,
                                    block_n=128, num_stages=2, out_registers=True,
                                    scaled_acc=True)),
    ("q512_scaled", "base", dict(layout_block_k=512, step_parts=4, stream_ctas=0, split_k=1,
                                 block_n=128, num_stages=2, out_registers=True,
                                 scaled_acc=True)),
    ("q512_scaled_split2", "base", dict(layout_block_k=512, step_parts=4, stream_ctas=0,
                                        split_k=2, block_n=128, num_stages=2,
                                        out_registers=True, scaled_acc=True)),
    ("scaled", "base", dict(scaled_acc=True)),
    # at 64 rows: four warpgroups (256 features) sharing x over two stages of half steps,
    # within 128 registers a thread only with the one accumulator (plan item 4)
    ("wg4_p2s_k1", "base", dict(layout_block_k=512, step_parts=2, scaled_acc=True, block_n=256,
                                num_stages=2, stream_ctas=0, split_k=1, out_registers=True)),
    ("wg4_p2s_k2", "base", dict(layout_block_k=512, step_parts=2, scaled_acc=True, block_n=256,
                                num_stages=2, stream_ctas=0, split_k=2, out_registers=True)),
    ("wg4_p2s_k4", "base", dict(layout_block_k=512, step_parts=2, scaled_acc=True, block_n=256,
                                num_stages=2, stream_ctas=0, split_k=4, out_registers=True)),
    ("wg4_p2s_stream", "base", dict(layout_block_k=512, step_parts=2, scaled_acc=True,
                                    block_n=256, num_stages=2, stream_ctas=132, split_k=1,
                                    out_registers=True)),
    ("p2_scaled", "base", dict(step_parts=2, scaled_acc=True)),
    # the public path with no config (the default's chunks), e.g. at M = 256; and with the
    # heuristic's one-call config (default_mosaic_config(one_call=True), opt-in)
    ("api", "base", dict(api=True)),
    ("one_call", "base", dict(one_call=True)),
    ("one_call_carry", "base", dict(one_call=True, carry_codes=True)),   # codes at part 0 only
    ("one_call_stream", "base", dict(one_call=True, stream_ctas=132, split_k=1)),  # 1 CTA / SM
    ("base_again", "base", {}),
)


def _apply(patch: str):
  """Installs one patch into the kernel modules (grid and stream-K); returns the originals."""
  saved = {}
  for name, value in PATCHES[patch].items():
    new = value() if name == "plgpu" else value
    for mod in (w4, w4_stream, w4_common):
      if hasattr(mod, name):
        saved[(mod, name)] = getattr(mod, name)
        setattr(mod, name, new)
  return saved


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--budget-s", type=float, default=150.0)
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--quick", action="store_true", help="CPU: interpret mode, tiny shapes")
  ap.add_argument("--variants", default="", help="comma list of variant names (default: all)")
  ap.add_argument("--shapes", default="", help="comma list of MxKxN (default: SHAPES)")
  args = ap.parse_args()
  shapes = ((1, 512, 128),) if args.quick else SHAPES
  if args.shapes:
    shapes = tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))
  interp = dict(interpret=True) if args.quick else {}
  os.makedirs(args.out, exist_ok=True)
  start = time.time()
  results = dict(meta=timing.metadata(), rows=[])
  path = os.path.join(args.out, "w4a16_probe.json")
  for m, k, n in shapes:
    copies = 2 if args.quick else max(2, math.ceil(3 * L2_BYTES / (k * n / 2)))
    keys = jax.random.split(jax.random.key(k + n), copies)
    qws = [quant.rtn(jax.random.normal(kk, (k, n), jnp.float32), bits=4, group_size=128,
                     sym=False) for kk in keys]
    mws = [layout.prepare_mosaic(q) for q in qws]
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
    dense = [quant.dequantize(q, dtype=jnp.bfloat16) for q in qws]
    row = dict(m=m, k=k, n=n, copies=copies, floor_ms=k * n / 2 / (HBM_TBPS * 1e12) * 1e3)
    xla = jax.jit(lambda x, ws: [x @ w for w in ws])
    row["xla_bf16_ms"] = timing.measure(xla, (x, dense), iterations=args.iters).ms / copies
    del dense
    ref = jnp.matmul(x.astype(jnp.float32), quant.dequantize(qws[0], dtype=jnp.float32))
    mc = min(m, 128)              # (above 128 rows the configs are those of 128-row chunks)
    try:
      base_cfg = dataclasses.replace(default_mosaic_config(m=mc, k=k, n=n, group_size=128),
                                     block_k=mws[0].block_k)
    except NotImplementedError:   # e.g. 512-row steps at 128 rows: variants on 256-row steps
      base_cfg = default_mosaic_config(m=mc, k=k, n=n, group_size=128, block_k=256)
    if args.quick:       # one warpgroup under the interpreter (see quant.matmul.mosaic)
      base_cfg = dataclasses.replace(base_cfg, block_n=64)
    row["config"] = dataclasses.asdict(base_cfg)
    row["variants"] = {}
    chosen = set(filter(None, args.variants.split(","))) or {v[0] for v in VARIANTS}
    for name, patch, over in VARIANTS:
      if name not in chosen:
        continue
      if time.time() - start > args.budget_s or (args.quick and "n128" in name):
        row["variants"][name] = dict(error="skipped: budget")
        continue
      over = over(base_cfg) if callable(over) else dict(over)    # (a rule over the default)
      weights = mws
      tile_major, layout_bk = over.pop("tile_major", False), over.pop("layout_block_k", None)
      if tile_major or layout_bk:
        bk = layout_bk or mws[0].block_k
        weights = [layout.prepare_mosaic(q, block_k=bk, tile_major=tile_major) for q in qws]
        over["block_k"] = bk
      api, one_call = over.pop("api", False), over.pop("one_call", False)
      cfg = None if api else dataclasses.replace(base_cfg, **over)
      if one_call:   # (the rest of ``over`` on top of the heuristic's one-call config)
        cfg = dataclasses.replace(default_mosaic_config(
            m=min(m, 256), k=k, n=n, group_size=128, block_k=mws[0].block_k, one_call=True),
            **over)
      saved = _apply(patch)
      entry = {}
      try:
        entry["config"] = "default" if api else dataclasses.asdict(
            fit_mosaic_config(cfg, m=min(m, 256) if one_call else mc, k=k, group_size=128,
                              n=n))
        jax.clear_caches()
        one = jax.jit(lambda x, w: w4.int4_matmul(x, w, config=cfg, **interp))
        fn = jax.jit(lambda x, ws: [w4.int4_matmul(x, w, config=cfg, **interp) for w in ws])
        y = one(x, weights[0]).astype(jnp.float32)
        entry["rel_err"] = float(jnp.mean(jnp.abs(y - ref)) / jnp.mean(jnp.abs(ref)))
        entry["ms"] = timing.measure(fn, (x, weights), iterations=args.iters).ms / copies
        entry["vs_bf16"] = row["xla_bf16_ms"] / entry["ms"]
        if name in ("base", "direct", "stream264", "late", "mmasync", "mmasync_bk512_s264") and not args.quick:
          entry["breakdown_one_call"] = timing.kernel_breakdown(one, (x, weights[0]))
      except Exception as e:  # pylint: disable=broad-except
        entry["error"] = f"{type(e).__name__}: {e}"[:1500]
        traceback.print_exc()
      finally:
        del weights
        for (mod, key), value in saved.items():
          setattr(mod, key, value)
        jax.clear_caches()
      row["variants"][name] = entry
      print(f"{m}x{k}x{n} {name:12s} {entry.get('ms', float('nan')):.4f} ms "
            f"err={entry.get('rel_err', float('nan')):.2e} {entry.get('error', '')[:200]}",
            flush=True)
    results["rows"].append(row)
    timing.write_json(path, results)
  for row in results["rows"]:
    print(f"{row['m']}x{row['k']}x{row['n']}: bf16 {row['xla_bf16_ms']:.4f} floor "
          f"{row['floor_ms']:.4f}  " + "  ".join(
              f"{k}={v['ms']:.4f}" for k, v in row["variants"].items() if "ms" in v))
    for name in ("base", "direct", "stream264"):
      if "breakdown_one_call" in row["variants"].get(name, {}):
        print(f"   one call ({name}):", row["variants"][name]["breakdown_one_call"])
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

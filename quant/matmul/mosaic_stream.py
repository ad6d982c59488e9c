"""Stream-K form of the Mosaic GPU W4A16 decode kernel (``MosaicConfig.stream_ctas > 0``).

The grid kernel of ``mosaic.py`` gives each CTA one ``block_n``-feature tile and one K split:
at 8192 x 28672 and M = 1 that is 448 CTAs of 16 steps, two resident per SM, so 1.7 waves, a
pipeline fill per CTA and SMs idle in the last wave. The H200 probe of session 7 measured
that memory pipeline alone (no dequant, no wgmma) at 0.77x of the HBM floor.

Here a fixed number of CTAs (``stream_ctas``; 2 per SM keeps the grid kernel's occupancy)
share the ``tiles x steps`` work units (unit = one ``block_k`` step of one feature tile,
numbered tile-major) equally: CTA ``c`` walks units ``[c U / C, (c + 1) U / C)`` through one
TMA ring that runs straight across tile boundaries, so every SM streams the same number of
bytes and fills its pipeline once. At the end of each tile (or of its share) a CTA writes the
float32 partial of that *segment* of K to ``parts[p, tile rows]``; XLA adds the parts.

Part index. A tile's first segment starts at step 0; every later one starts at a CTA
boundary, and CTA boundaries are at least ``L = U // C`` units apart, so
``p(s) = 0 if s == 0 else 1 + (s - 1) // L`` (``s`` = the segment's first step) differs
between the segments of one tile. Which ``(p, tile)`` pairs are written is static
(``StreamPlan.written``), so the unwritten ones are masked out before the sum (no zero-filled
buffer, no atomics; the sum order is fixed, so results are deterministic).

Each step is scaled as it completes (``total += s_g * partial_g``), whatever the group size
(the grid kernel's long groups scale once per group instead), so per-channel, short and long
groups all work. Not combined with ``fold_zero`` or ``direct_io`` (ignored). ``pipeline``
(compiled) keeps one group's wgmmas in flight (``_group_pipeline``), with an even number of
groups per step. ``step_parts``, ``carry_codes`` and ``scaled_acc`` work as in the grid
kernel: a unit is then ``step_parts`` ring steps, run in one loop iteration (the nibbles each
reads stay static), and with ``scaled_acc`` a segment stores ``acc * unit`` and restarts the
accumulator (the unit carries on).

Measured (H200, session 8, benchmarks/NOTES.md): 46.6 -> 44.0 us kernel time at 1x8192x28672
with 264 CTAs, 5.6% faster at M = 16 with 132, 15% slower at 8192 x 8192; with no compute at
all it streams no faster than the grid (34.7 vs 34.9 us), so the pipeline's limit is inside a
CTA's step, not the grid's tail. Opt-in.

Example:
  >>> mw = layout.prepare_mosaic(qw)                                # once, at load time
  >>> cfg = MosaicConfig(block_n=64, block_k=mw.block_k, num_stages=4, stream_ctas=264)
  >>> y = quant.matmul.mosaic.int4_matmul(x, mw, config=cfg)        # x: [M, K], M <= 128
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from quant.matmul import layout
from quant.matmul.mosaic_common import BN, PLANES, Statics, _codes, mma_sync_group, scaled_group
from quant.matmul.mosaic_xring import XRing
from quant.matmul.mosaic_io import scale_rows, split_refs, weight_boxes, zero_offset


@dataclasses.dataclass(frozen=True)
class StreamPlan:
  """The static split of ``tiles x steps`` units over ``ctas`` CTAs (hashable)."""
  tiles: int     # block_n-feature tiles
  steps: int     # block_k steps of one tile (all of K)
  ctas: int

  def __post_init__(self):
    if min(self.tiles, self.steps) < 1 or not 1 <= self.ctas <= self.units:
      raise ValueError(f"StreamPlan needs tiles, steps >= 1 and 1 <= ctas <= tiles * steps, got "
                       f"{self}")

  @property
  def units(self) -> int:
    return self.tiles * self.steps

  @property
  def per_cta(self) -> int:
    """L: every CTA walks L or L + 1 units."""
    return self.units // self.ctas

  def part(self, start: int) -> int:
    return 0 if start == 0 else 1 + (start - 1) // self.per_cta

  def segments(self):
    """(cta, tile, first step, end step, part) of every segment, in CTA order."""
    for c in range(self.ctas):
      u, end = c * self.units // self.ctas, (c + 1) * self.units // self.ctas
      while u < end:
        tile, s = divmod(u, self.steps)
        e = min(end, (tile + 1) * self.steps)
        yield c, tile, s, e - tile * self.steps, self.part(s)
        u = e

  @property
  def parts(self) -> int:
    return 1 + max(p for *_, p in self.segments())

  def written(self) -> np.ndarray:
    """bool [parts, tiles]: which partial slots the kernel writes."""
    out = np.zeros((self.parts, self.tiles), bool)
    for _, tile, _, _, p in self.segments():
      out[p, tile] = True
    return out


def stream_kernel(xt_ref, qt_ref, s_ref, z_ref, xs_ref, o_ref, scratch, *, st: Statics,
                  plan: StreamPlan):
  """One persistent CTA (grid axis "cta"): its share of the units, one ring across tiles.

  Refs and scratch as ``mosaic.w4a16_kernel`` (x in planes ``[Kp/span2, m_pad, span2]``), but
  the output is ``parts [P, Np, m_pad]`` float32 (see the module docstring).
  """
  (w_ring, x_ring, s_ring, z_ring, planes2, o_smem2, ready, free, xs_ring, x_ready,
   x_free) = scratch
  span2, stages, gps, wgs = st.span2, st.stages, st.groups_per_step, st.wgs
  wg, cta = lax.axis_index("wg"), lax.axis_index("cta")
  planes = None if planes2 is None else planes2.at[wg]
  o_smem = None if o_smem2 is None else o_smem2.at[wg]
  units, steps, ctas = plan.units, plan.steps, plan.ctas
  u0 = lax.div(cta * units, ctas)
  count = lax.div((cta + 1) * units, ctas) - u0      # L or L + 1 units
  first_tile, first_step = lax.div(u0, steps), lax.rem(u0, steps)
  rows_per_scale = st.steps_per_group                # ring steps per scale row (long groups)
  row_vec = plgpu.Layout.WGMMA.reduce(1)
  # Ring steps: st.parts per unit (``MosaicConfig.step_parts``); r = t * parts + h.
  parts = st.parts
  ring_count = count * parts
  carried = {}                                       # carry_codes: the unit's code tile

  def unit(t):
    """(tile, step within the tile) of local unit t."""
    return lax.div(u0 + t, steps), lax.rem(u0 + t, steps)

  # x's planes: in the step ring, or in their own (st.x_slots; mosaic_xring.py), whose planes
  # follow the units across tile boundaries like the step ring does.
  # (x's own ring is refused with step parts, so its steps are the units)
  xr = XRing(st, xt_ref, x_ring, x_ready, x_free, step_of=lambda t: unit(t)[1], steps=count,
             wg=wg)

  def issue(r):
    """TMA of ring step r (part ``r % parts`` of local unit ``r // parts``)."""
    t, h = lax.div(r, parts), lax.rem(r, parts)
    tile, gt = unit(t)
    gr = gt * parts + h                              # the ring step's place in the tile's K
    slot = lax.rem(r, stages)
    bar = ready.at[slot]
    xr.step_copy(gr, slot, bar)
    g0 = 0 if scale_rows(s_ref) == 1 else (
        gr // rows_per_scale if st.long_groups else gr * gps)
    if st.late_zero:
      plgpu.copy_gmem_to_smem(xs_ref.at[pl.ds(gr * gps, gps)],
                              xs_ring.at[slot, pl.ds(0, gps)], bar)
    for w in range(wgs):
      codes, s_rows, z_rows = weight_boxes(qt_ref, s_ref, z_ref,
                                           feature0=tile * (BN * wgs) + w * BN, step=gt, g0=g0,
                                           gps=gps, span2=span2)
      copy_codes = functools.partial(plgpu.copy_gmem_to_smem, codes, w_ring.at[slot, w], bar)
      if st.carry_codes:                   # (as in mosaic.w4a16_kernel: first part only)
        pl.when(h == 0)(copy_codes)
      else:
        copy_codes()
      plgpu.copy_gmem_to_smem(s_rows, s_ring.at[slot, w], bar)
      if not st.sym:
        plgpu.copy_gmem_to_smem(z_rows, z_ring.at[slot, w], bar)
    if st.carry_codes:
      @pl.when(h != 0)
      def _():
        for _ in range(wgs):
          plgpu.barrier_arrive(bar)

  def prefetch(t):
    """Warpgroup 0 at ring step t: TMA of ring step t + stages - 1 into the slot t - 1 used."""
    @pl.when(jnp.logical_and(wg == 0, t + stages - 1 < ring_count))
    def _():
      if wgs > 1:
        @pl.when(t > 0)
        def _():
          plgpu.barrier_wait(free.at[lax.rem(t - 1, stages)])
      issue(t + stages - 1)

  def zero_of(slot, g):
    if st.sym:
      # A Python float (exact in bf16 / f16; weak-typed, so the planes keep their dtype):
      # a jnp constant here became a literal that the run_state accumulator's loop
      # could not lower (scaled_acc with symmetric groups, session 38).
      return float(st.magic + st.zero)
    z = plgpu.load(z_ring.at[slot, wg, g], (), layout=row_vec).astype(jnp.float32)
    return lax.broadcast_in_dim((z + st.magic).astype(st.dtype), (BN, span2), [0])

  def scaled_step(t, total, part: int = 0):
    """total + sum_g s_g * (codes - z_g) x of ring step t (``part``, static, of its unit); a
    step's groups share a wgmma scope (one wait) while their accumulators fit
    ``st.acc_columns`` (by default one group a scope here: ``MosaicConfig.acc_columns``). With
    ``st.scaled_acc`` ``total`` is ``(acc, unit)`` (``mosaic_common.scaled_group``)."""
    prefetch(t)
    slot = lax.rem(t, stages)
    plgpu.barrier_wait(ready.at[slot])
    if st.carry_codes and part > 0:
      codes = carried["codes"]
    else:
      codes = plgpu.load(w_ring.at[slot, wg], (), layout=plgpu.Layout.WGMMA)
      carried["codes"] = codes
    per_group = st.step_planes // gps
    nibble0 = part * st.step_planes                # the code tile's nibble of local plane 0
    if st.scaled_acc:
      acc, scale_unit = total
      for g in range(gps):
        s = plgpu.load(s_ring.at[slot, wg, g], (), layout=row_vec).astype(jnp.float32)
        acc, scale_unit = scaled_group(acc, scale_unit, s, zero_of(slot, g), codes,
                                       x_ring.at[slot], planes,
                                       [nibble0 + g * per_group + j for j in range(per_group)],
                                       nibble0, st)
      if wgs > 1:
        plgpu.barrier_arrive(free.at[slot])
      return acc, scale_unit

    def mma(*acc_refs, groups, zeros):
      for i, (g, zero) in enumerate(zip(groups, zeros)):
        for j in range(per_group):
          p = g * per_group + j
          x_t = xr.plane(t, slot, p).transpose((1, 0))   # (own x ring: waits for the plane)
          # (B + q) - (B + z) = q - z, exact; or B + q, its offset taken off below (late_zero)
          q = _codes(codes, nibble0 + p, st)
          vals = q if st.late_zero else q - zero
          if st.registers_a:
            plgpu.wgmma(acc_refs[i], vals, x_t)
            continue
          if i * per_group + j >= 2:
            plgpu.wgmma_wait(1)                    # plane p - 2's buffer has been read
          planes[p % 2] = vals
          plgpu.commit_smem()
          plgpu.wgmma(acc_refs[i], planes.at[p % 2], x_t)
      plgpu.wgmma_wait(0)
      xr.release(t, tuple(g * per_group + j for g in groups for j in range(per_group)),
                 lag=st.scope_planes)
      return [acc[...] for acc in acc_refs]

    def add(total, g, part):
      if st.late_zero:
        part = part - zero_offset(z_ring, xs_ring, slot, wg, g, st)
      s = plgpu.load(s_ring.at[slot, wg, g], (), layout=row_vec).astype(jnp.float32)
      return total + lax.broadcast_in_dim(s, (BN, st.m_pad), [0]) * part

    zero = lambda g: None if st.late_zero else zero_of(slot, g)
    if st.mma_sync:                                # no wgmma: registers in, registers out
      for g in range(gps):
        total = add(total, g, mma_sync_group(codes, zero(g), x_ring.at[slot], g, st))
    for g0 in ([] if st.mma_sync else range(0, gps, st.groups_per_scope)):
      groups = tuple(range(g0, min(gps, g0 + st.groups_per_scope)))
      accs = [plgpu.ACC((BN, st.m_pad), jnp.float32) for _ in groups]
      parts = pl.run_scoped(functools.partial(mma, groups=groups,
                                              zeros=[zero(g) for g in groups]), *accs)
      for g, part in zip(groups, parts):           # scaled as each scope completes
        total = add(total, g, part)
    if wgs > 1:
      plgpu.barrier_arrive(free.at[slot])
    return total

  @pl.when(wg == 0)
  def _prologue():
    for r in range(stages - 1):
      pl.when(r < ring_count)(functools.partial(issue, r))
    xr.prologue()                                  # (own x ring: its first x_slots planes)

  zeros = plgpu.layout_cast(jnp.zeros((BN, st.m_pad), jnp.float32), plgpu.Layout.WGMMA)
  ones = plgpu.layout_cast(jnp.ones((BN,), jnp.float32), row_vec)     # scaled_acc's first unit

  def close(t, total):
    """After unit t: a segment that ends there is stored, and the sum restarts."""
    if st.scaled_acc:                              # (acc, unit): both restart at a segment end
      acc, scale_unit = total
      value = acc * lax.broadcast_in_dim(scale_unit, (BN, st.m_pad), [0])
      tile_ends = jnp.logical_or(unit(t)[1] == steps - 1, t == count - 1)
      restart = plgpu.layout_cast(jnp.broadcast_to(tile_ends, (BN,)), row_vec)
      # (the next tile's features have scales of their own: a unit from this one could make
      # the first ratio overflow)
      return close_value(t, value, acc), jnp.where(restart, ones, scale_unit)
    return close_value(t, total, total)

  def close_value(t, total, running):
    """Stores ``total`` where unit t ends a segment; returns ``running``, restarted there."""
    tile, gt = unit(t)
    ends = jnp.logical_or(gt == steps - 1, t == count - 1)

    @pl.when(ends)
    def _store():
      start = jnp.where(tile == first_tile, first_step, 0)
      part = jnp.where(start == 0, 0, 1 + lax.div(start - 1, plan.per_cta))
      dst = o_ref.at[part, pl.ds(tile * (BN * wgs) + wg * BN, BN)]
      if o_smem is None:                   # st.out_registers: 8-byte stores straight to GMEM
        dst[...] = total
        return
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last store has left o_smem
      o_smem[...] = total
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, dst)
    # Restart the sum for the next segment. (Mosaic's select does not broadcast a scalar
    # predicate implicitly; a multiply by 0 would carry a NaN / inf of one tile into the next.)
    restart = plgpu.layout_cast(jnp.broadcast_to(ends, total.shape), plgpu.Layout.WGMMA)
    return jnp.where(restart, zeros, running)

  if st.pipeline:
    _group_pipeline(st=st, count=count, close=close, prefetch=prefetch, zero_of=zero_of,
                    w_ring=w_ring, x_ring=x_ring, s_ring=s_ring, ready=ready, free=free, wg=wg,
                    zeros=zeros)
  else:
    def unit_body(t, total):
      for h in range(parts):                       # (static: the nibbles a part reads)
        total = scaled_step(t * parts + h, total, part=h)
      return close(t, total)

    lax.fori_loop(0, count, unit_body, (zeros, ones) if st.scaled_acc else zeros)
  if wgs > 1:
    @pl.when(wg == 0)
    def _drain():                                  # observe the last free phases
      @pl.loop(jnp.maximum(ring_count - stages, 0), ring_count)
      def _(t):
        plgpu.barrier_wait(free.at[lax.rem(t, stages)])
      xr.drain()
  plgpu.wait_smem_to_gmem(0)


def _group_pipeline(*, st: Statics, count, close, prefetch, zero_of, w_ring, x_ring, s_ring,
                    ready, free, wg, zeros) -> None:
  """The stream loop with one group's wgmmas always in flight (``st.pipeline``; compiled, wgmma
  from registers, an even number of groups per step).

  Events e = (unit t, group g) in order; each is issued (plane dequantized, wgmmas committed
  into accumulator ``g % 2``) before the previous one is retired (waited for, read, reset to
  zero, scaled into the total), so the dequant of a plane and the scaling of a partial run
  while the tensor cores work on the other accumulator, instead of after a wait per group
  (Nsight Compute at 64 rows, session 19: 22% of the warp stalls on those waits). A ring slot
  is released once the last group of its unit is retired; the first group of unit t + 1 is
  issued before that, so its data is waited for one group earlier than in the plain loop.
  """
  gps = st.groups_per_step
  per_group = PLANES // gps
  row_vec = plgpu.Layout.WGMMA.reduce(1)
  slot_of = lambda t: lax.rem(t, st.stages)

  def codes_of(t):
    plgpu.barrier_wait(ready.at[slot_of(t)])
    return plgpu.load(w_ring.at[slot_of(t), wg], (), layout=plgpu.Layout.WGMMA)

  def body(*accs):
    def issue(t, codes, g):
      slot, zero = slot_of(t), zero_of(slot_of(t), g)
      for j in range(per_group):
        p = g * per_group + j
        plgpu.wgmma(accs[g % 2], _codes(codes, p, st) - zero,
                    x_ring.at[slot, p].transpose((1, 0)))

    def retire(t, g, total, wait_n: int):
      part = plgpu.wgmma_accumulator_load(accs[g % 2], wait_n=wait_n)
      accs[g % 2][...] = zeros                   # the next group it takes starts from zero
      s = plgpu.load(s_ring.at[slot_of(t), wg, g], (), layout=row_vec).astype(jnp.float32)
      return total + lax.broadcast_in_dim(s, (BN, st.m_pad), [0]) * part

    def unit_events(t, total, codes, last: bool):
      """Groups of unit t: issue the next event, retire this one. Returns (total, codes of the
      next unit)."""
      nxt = codes
      for g in range(gps):
        if g + 1 < gps:
          issue(t, codes, g + 1)
        elif not last:
          nxt = codes_of(t + 1)
          issue(t + 1, nxt, 0)
        total = retire(t, g, total, wait_n=0 if (last and g + 1 == gps) else per_group)
      if st.wgs > 1:
        plgpu.barrier_arrive(free.at[slot_of(t)])
      return close(t, total), nxt

    prefetch(0)
    codes0 = codes_of(0)
    issue(0, codes0, 0)

    def step(t, carry):
      total, codes = unit_events(t, *carry, last=False)
      prefetch(t + 1)                          # into unit t's slot, now released
      return total, codes

    carry = lax.fori_loop(0, count - 1, step, (zeros, codes0))
    unit_events(count - 1, *carry, last=True)

  pl.run_scoped(body, *[plgpu.ACC((BN, st.m_pad), jnp.float32) for _ in range(2)])


def launch(inputs: tuple, *, st: Statics, plan: StreamPlan, scratch, interpret: bool):
  """``plgpu.kernel`` of ``stream_kernel`` on ``mosaic.kernel_inputs``: the float32 parts
  ``[P, Np, m_pad]`` summed over the written slots -> ``[Np, m_pad]``."""
  np_ = layout.code_dims(inputs[1])[0]

  def body(*refs, scratch):
    stream_kernel(*split_refs(refs, st), scratch, st=st, plan=plan)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((plan.parts, np_, st.m_pad), jnp.float32),
      scratch_types=dict(scratch=scratch),
      grid=(plan.ctas,),
      grid_names=("cta",),
      num_threads=st.wgs,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
      kernel_name="w4a16_mosaic_stream",
  )
  parts = kernel(*inputs)
  mask = np.repeat(plan.written(), BN * st.wgs, axis=1)[:, :, None]     # [P, Np, 1], static
  return jnp.sum(jnp.where(mask, parts, 0.0), axis=0)

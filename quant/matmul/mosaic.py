"""Fused W4A16 matmul on the Pallas Mosaic GPU backend (Hopper wgmma): ``y = x @ dequantize(qw)``.

Decode-shaped calls (M <= 64) are bound by streaming the int4 weight, so the kernel computes the
transposed product ``y^T = W^T x^T``: the dequantized weight tile (64 output features) is wgmma's
M side, which must be 64 rows per warpgroup, and the few activation rows are wgmma's N side,
padded only to a multiple of 8. Computing ``x W`` directly would pad M = 1 up to 64. One call
takes up to 256 rows with group-wise scales (the default since session 24): the ring walks
halves or quarters of a layout step (``MosaicConfig.step_parts``) so that two stages of x fit,
and the running total stays in the wgmma accumulator in units of the current group's scale
(``MosaicConfig.scaled_acc``), which frees the registers for wgmma N = 256; above 128 rows
the code tile crosses to SMEM once per layout step (``carry_codes``). A prefill chunk then
reads the weight once per 256 rows (H100, session 24: 256 x 8192 x 28672 in 0.205 ms
against 0.306 in four 64-row calls). Larger calls on a prepared weight run in equal chunks
(``chunk_rows``); per-channel scales keep the earlier rule (up to 128 rows, 64 on 512-row
steps; x's own ring of planes, ``MosaicConfig.x_slots``, ``mosaic_xring.py``, serves them in
one call but measured slower).

Maths. Per group ``g`` of K rows with per-feature scale ``s_g[n]`` and zero ``z_g[n]``::

    y[m, n] = sum_g s_g[n] * sum_{k in g} (q[k, n] - z_g[n]) * x[m, k]

``q - z`` is a small integer (|q - z| < 16), exact in bf16/f16, so each group's inner sum is a
wgmma of exact operands with float32 accumulation; the scale is applied to that float32 partial
(a per-row broadcast, since n is wgmma's M side) and nothing is rounded to 16 bits except x
itself and the final output (the same precision as the Triton backend).

Data flow of one CTA (grid ``(N/block_n, split_k)``; ``block_n / 64`` warpgroups, each owning
64 output features and sharing the x slice), step ``t`` of its K slice:

* TMA (``copy_gmem_to_smem`` issued by warpgroup 0, one ``ready`` barrier per ring slot, one
  arrival per copy) brings a swizzled ``[64, block_k/4]`` int16 tile of packed codes per
  warpgroup, the ``[4, m_pad, block_k/4]`` slice of x and the scale / zero rows of step
  ``t + num_stages - 1`` into a ring of ``num_stages`` SMEM slots;
* the warpgroup loads the code tile to registers once (wgmma's operand layout), and for each
  nibble ``p`` (a "plane" of ``block_k/4`` contiguous K columns, thanks to
  ``layout.MosaicWeight``'s planar packing) forms ``q - z`` as ``(B + q) - (B + z)``: a shift,
  a mask and an OR into the mantissa of the 16-bit magic number B, then one 16-bit subtract (no
  int -> float conversion). Compiled, the three bit operations run on whole 32-bit registers,
  each holding two int16 elements = two operands of the wgmma register A fragment
  (``mosaic_common._paired_codes``); the plane feeds ``wgmma(acc, plane, x_plane^T)`` from
  registers (or, with ``registers_a=False`` and in interpret mode, through one of two swizzled
  SMEM planes);
* one ``plgpu.ACC`` accumulator per group (or per step when a group spans several steps, then
  summed in registers), scaled once it is complete.

Every wgmma of a step is waited before the step ends; with one warpgroup the slot refilled at
step ``t + 1`` (the one step ``t - 1`` used) is then free, with several a ``free`` barrier per
slot (one arrival per warpgroup) guards the refill. Partial sums ``[split_k, N, M]``
come out in float32; XLA adds the splits and the bias, transposes and casts (for M <= 64 that is
< 2% of the weight's bytes; at 128 rows with two K splits, 8 MB at N = 8192). Act-order
weights are served by gathering x's columns into the stored row order (``x[..., perm]``); the
kernel never sees ``g_idx``.

Not served (NotImplementedError, so ``quant.int4_matmul`` falls back): float32 x, M > 128 (256
with ``scaled_acc``), codes wider than 4 bits, groups the planes cannot tile (a plane of
block_k/4 rows must lie in one group and block_k and the group must divide one another, e.g.
groups of 8 or 96), a config
whose ring does not fit in SMEM, a non-Hopper device without ``interpret=True``, or a compiled
call (``interpret=False``) on a plain ``QuantizedWeight``: repacking it into the planar layout
on every call is a full extra pass over the weight, more than the kernel saves, so dispatch
falls back to the Triton kernel (which reads our packing as is) unless the caller prepared the
weight once with ``layout.prepare_mosaic``.

Example:
  >>> qw = quant.rtn(w, bits=4, group_size=128)                    # w: [K, N]
  >>> mw = layout.prepare_mosaic(qw)                               # once, at load time
  >>> y = int4_matmul(x, mw, bias=None, config=None, interpret=False)    # x: [M, K], any M
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

from quant import formats
from quant.matmul import layout, mma_sync, mosaic_io
from quant.matmul.mosaic_io import (check_supported, kernel_inputs, on_hopper, scale_rows,
                                    split_refs, weight_boxes, x_sums, xs_rows, zero_offset)
from quant.matmul.config import (MosaicConfig, chunk_rows, default_mosaic_config, mosaic_m_pad,
                                 MOSAIC_MAX_M, MOSAIC_WIDE_M,
                                 resolve_mosaic_config as resolve_config)
# The launch statics and the plane dequant, shared with mosaic_stream.py (names kept here too).
from quant.matmul.mosaic_common import (  # noqa: F401  (_and_or, pipeline_fits: for callers)
    ACC_COLUMNS, BN, PLANES, Statics, _MAGIC, _and_or, _codes, _tiled, mma_sync_group,
    pipeline_fits, scaled_group)
from quant.matmul.mosaic_xring import XRing


def w4a16_kernel(xt_ref, qt_ref, s_ref, z_ref, xs_ref, o_ref, scratch, *, st: Statics):
  """One CTA: rows ``[bn i, bn (i + 1))`` of ``y^T`` from split ``k`` of K (grid ``(i, k)``).

  ``st.wgs`` warpgroups (threads "wg") each own 64 of the CTA's ``bn = 64 wgs`` rows and share
  the x slice, so x is read from L2 once per ``bn`` rows instead of once per 64. Warpgroup 0
  issues every TMA; with several warpgroups a slot is refilled only after all of them arrived
  on its ``free`` barrier.

  Refs (GMEM): xt ``[Kp/span2, m_pad, span2]`` (x in planes; with ``st.direct_x`` x itself,
  ``[M, K]``), qt int16 ``[Np, Kp/4]`` (planar codes, ``layout.MosaicWeight``), s ``[Gp, Np]``,
  z ``[Gp, Np]`` bf16 or None (tile-major storage: qt ``[Np/64, Kp/block_k, 64, span2]``, s and
  z ``[Np/64, Gp, 64]``; ``mosaic_io.weight_boxes`` reads either), xs float32 ``[Kp/piece, m_pad]`` (``st.late_zero`` only: x's
  column sums over each group's piece of a step, see ``x_sums``), o float32 ``[split_k, Np,
  m_pad]`` (with ``st.direct_out``: y itself, ``[M, N]`` in x's dtype). Scratch: the TMA ring
  (codes, x, scales, zeros, x sums), two dequantized planes (``registers_a=False`` only) and an
  output tile per warpgroup (none with ``st.out_registers``), and the ``ready`` / ``free``
  barriers of each ring slot.
  """
  (w_ring, x_ring, s_ring, z_ring, planes2, o_smem2, ready, free, xs_ring, x_ready,
   x_free) = scratch
  span2, stages, gps, wgs = st.span2, st.stages, st.groups_per_step, st.wgs
  wg = lax.axis_index("wg")
  planes = None if planes2 is None else planes2.at[wg]
  o_smem = None if o_smem2 is None else o_smem2.at[wg]
  n0 = lax.axis_index("n") * (BN * wgs)
  t_base = lax.axis_index("k") * st.steps          # first global step of this split
  rows_per_scale = st.steps_per_group             # ring steps per scale row (long groups)
  # x's planes: in the step ring, or in their own (st.x_slots; mosaic_xring.py)
  xr = XRing(st, xt_ref, x_ring, x_ready, x_free, step_of=lambda t: t_base + t, steps=st.steps,
             wg=wg)
  wgmma_layout = plgpu.Layout.WGMMA
  row_vec = plgpu.Layout.WGMMA.reduce(1)           # one value per row of a [64, *] tile
  carried = {}                                     # carry_codes: the layout step's code tile

  def issue(t):
    """TMA of local step ``t`` into slot ``t % stages`` (one barrier arrival per copy)."""
    slot = lax.rem(t, stages)
    gt = t_base + t
    bar = ready.at[slot]
    # x's planes (with st.direct_x boxes [m_pad, span2] of x [M, K]: the TMA unit fills rows
    # >= M and columns >= K with zeros; the matching codes and scales are zero-padded too).
    xr.step_copy(gt, slot, bar)
    # Scale rows of this step: gps groups (short groups) or the one group it belongs to.
    g0 = gt // rows_per_scale if st.long_groups else gt * gps
    if scale_rows(s_ref) == 1:
      g0 = 0                                       # per-channel: one row for all of K
    if st.late_zero:
      plgpu.copy_gmem_to_smem(xs_ref.at[pl.ds(gt * gps, gps)],
                              xs_ring.at[slot, pl.ds(0, gps)], bar)
    # Step parts: every part of a layout step reads its whole code tile, or with carry_codes
    # only its first part, the others arriving on the barrier in place of that copy (after
    # the copies, so the phase cannot complete before their bytes are expected).
    first_part = lax.rem(gt, st.parts) == 0 if st.carry_codes else None
    for w in range(wgs):
      codes, s_rows, z_rows = weight_boxes(qt_ref, s_ref, z_ref, feature0=n0 + w * BN,
                                           step=gt // st.parts, g0=g0, gps=gps, span2=span2)
      copy_codes = functools.partial(plgpu.copy_gmem_to_smem, codes, w_ring.at[slot, w], bar)
      if st.carry_codes:
        pl.when(first_part)(copy_codes)
      else:
        copy_codes()
      plgpu.copy_gmem_to_smem(s_rows, s_ring.at[slot, w], bar)
      if not st.sym:
        plgpu.copy_gmem_to_smem(z_rows, z_ring.at[slot, w], bar)
    if st.carry_codes:
      @pl.when(jnp.logical_not(first_part))
      def _():
        for _ in range(wgs):
          plgpu.barrier_arrive(bar)

  def zero_at(slot, g):
    """B + z of group ``g`` of ring slot ``slot`` in the operand dtype (exact: B + z < 2B), B
    the magic number of ``_MAGIC``; a [64, span2] tile, or a scalar when symmetric."""
    if st.sym:
      # A Python float (exact in bf16 / f16; weak-typed, so the planes keep their dtype):
      # a jnp constant here became a literal that the run_state accumulator's loop
      # could not lower (scaled_acc with symmetric groups, session 38).
      return float(st.magic + st.zero)
    zvec = plgpu.load(z_ring.at[slot, wg, g], (), layout=row_vec).astype(jnp.float32)
    return lax.broadcast_in_dim((zvec + st.magic).astype(st.dtype), (BN, span2), [0])

  def scale_row(slot, g):
    return plgpu.load(s_ring.at[slot, wg, g], (), layout=row_vec).astype(jnp.float32)

  def scale_at(slot, g):
    return lax.broadcast_in_dim(scale_row(slot, g), (BN, st.m_pad), [0])

  def prefetch(t):
    """Warpgroup 0, at step ``t``: TMA of step ``t + stages - 1`` into the slot step ``t - 1``
    used, once every warpgroup is done with it."""
    @pl.when(jnp.logical_and(wg == 0, t + stages - 1 < st.steps))
    def _():
      if wgs > 1:
        @pl.when(t > 0)                            # t = 0: the slot is still empty
        def _():
          plgpu.barrier_wait(free.at[lax.rem(t - 1, stages)])
      issue(t + stages - 1)

  def step_partials(t, total=None, part: int = 0):
    """Waits for step ``t``'s data. With ``total``: returns ``total + sum_g s_g * partial_g``,
    each scope's partials scaled and added as soon as the scope completes (at most one scope's
    float32 tiles live: two 64-register partials at 128 rows would crowd the registers).
    Without: returns the step's float32 partials and scales, one per group (long groups, whose
    steps are summed before the group's one scale). With ``st.scaled_acc`` ``total`` is the
    pair ``(acc, unit)`` of ``mosaic_common.scaled_group`` and so is the result. ``part``
    (static): which part of its layout step ring step ``t`` is (``st.parts``), so which
    nibbles of the code tile it reads."""
    # With one warpgroup the slot's wgmmas were waited at the end of step t - 1.
    prefetch(t)

    slot = lax.rem(t, stages)
    plgpu.barrier_wait(ready.at[slot])
    # int16 [64, span2] in wgmma's operand layout: one 32-bit register = columns 2u and 2u + 1.
    # The ring is swizzled like an operand, so this load is free of bank conflicts. With
    # carry_codes the later parts of a layout step reuse its first part's registers (the loop
    # runs a layout step's parts in one iteration: ``parts_of_step``).
    if st.carry_codes and part > 0:
      codes = carried["codes"]
    else:
      codes = plgpu.load(w_ring.at[slot, wg], (), layout=wgmma_layout)
      carried["codes"] = codes
    planes_per_group = st.step_planes // gps
    nibble0 = part * st.step_planes               # the code tile's nibble of local plane 0

    zero_of = functools.partial(zero_at, slot)

    def mma(*acc_refs, groups, zeros):
      """All planes of ``groups``, group i into ``acc_refs[i]``; one wait for the lot."""
      for i, (g, zero) in enumerate(zip(groups, zeros)):
        if st.fold_zero:
          # -(B + z) as a wgmma A operand (exact in 16 bits), shared by the group's planes.
          neg_zero = plgpu.layout_cast(jnp.zeros((BN, span2), st.dtype) - zero, wgmma_layout)
        for j in range(planes_per_group):
          p = g * planes_per_group + j
          x_t = xr.plane(t, slot, p).transpose((1, 0))   # (own x ring: waits for the plane)
          if st.fold_zero:
            # (B + q) x + (-(B + z)) x = (q - z) x, the subtraction done by the tensor cores.
            plgpu.wgmma(acc_refs[i], _codes(codes, nibble0 + p, st), x_t)
            plgpu.wgmma(acc_refs[i], neg_zero, x_t)
            continue
          # (B + q) - (B + z) = q - z exactly, with no int -> float conversion (cvt runs at a
          # fraction of the ALU rate): OR-ing q into B's mantissa bits forms B + q. With
          # late_zero the wgmma takes B + q and the group's (B + z) X_g comes off afterwards.
          q = _codes(codes, nibble0 + p, st)
          vals = q if st.late_zero else q - zero
          if st.registers_a:
            # The plane is already in wgmma's register-operand layout (``codes`` was loaded as
            # WGMMA): no SMEM round trip, which would cost 4 bytes of SMEM traffic per weight
            # (store + wgmma read) against 0.5 for the packed codes. No wait per plane either:
            # the planes are separate registers, so all of a step's wgmmas can be in flight.
            plgpu.wgmma(acc_refs[i], vals, x_t)
            continue
          if i * planes_per_group + j >= 2:
            plgpu.wgmma_wait(1)        # the wgmma that read this buffer (plane p - 2) is done
          buf = p % 2
          planes[buf] = vals
          plgpu.commit_smem()          # register stores -> visible to the async wgmma
          plgpu.wgmma(acc_refs[i], planes.at[buf], x_t)
      plgpu.wgmma_wait(0)              # planes and this slot may be overwritten after this
      xr.release(t, tuple(g * planes_per_group + j for g in groups
                          for j in range(planes_per_group)), lag=st.scope_planes)
      return [acc[...] for acc in acc_refs]

    if st.scaled_acc:
      acc, unit = total
      for g in range(gps):
        acc, unit = scaled_group(acc, unit, scale_row(slot, g), zero_of(g), codes,
                                 x_ring.at[slot], planes,
                                 [nibble0 + g * planes_per_group + j
                                  for j in range(planes_per_group)], nibble0, st)
      if wgs > 1:
        plgpu.barrier_arrive(free.at[slot])      # this warpgroup is done with the slot
      return acc, unit

    # Groups share one scope (one wgmma_wait(0)) while their accumulators stay small: a wait per
    # group would expose the wgmma latency once per group instead of once per scope.
    partials, scales = [], []

    def done(g, part):
      """Group g's partial is complete: its zero offset off (late_zero), then kept or added."""
      nonlocal total
      if st.late_zero:
        part = part - zero_offset(z_ring, xs_ring, slot, wg, g, st)
      if total is None:
        partials.append(part)
        scales.append(scale_at(slot, g))
      else:
        total = total + scale_at(slot, g) * part

    if st.mma_sync:                              # no wgmma: registers in, registers out
      for g in range(gps):
        done(g, mma_sync_group(codes, None if st.late_zero else zero_of(g), x_ring.at[slot],
                               g, st))
    for g0 in ([] if st.mma_sync else range(0, gps, st.groups_per_scope)):  # (wgmma form)
      groups = tuple(range(g0, min(gps, g0 + st.groups_per_scope)))
      accs = [plgpu.ACC((BN, st.m_pad), jnp.float32) for _ in groups]
      zeros = [None if st.late_zero else zero_of(g) for g in groups]
      for g, part in zip(groups, pl.run_scoped(functools.partial(mma, groups=groups,
                                                                 zeros=zeros), *accs)):
        done(g, part)
    if wgs > 1:
      plgpu.barrier_arrive(free.at[slot])        # this warpgroup is done with the slot
    return (partials, scales) if total is None else total

  zeros_tile = lambda: plgpu.layout_cast(jnp.zeros((BN, st.m_pad), jnp.float32), wgmma_layout)

  def issue_planes(t, accs):
    """Pipelined form: waits for step ``t``'s data and issues its wgmmas (one commit group per
    plane, group g of the step into ``accs[g]``) without waiting for them."""
    slot = lax.rem(t, stages)
    plgpu.barrier_wait(ready.at[slot])
    codes = plgpu.load(w_ring.at[slot, wg], (), layout=wgmma_layout)
    per_group = PLANES // gps
    for g in range(gps):
      zero = zero_at(slot, g)
      for j in range(per_group):
        p = g * per_group + j
        plgpu.wgmma(accs[g], _codes(codes, p, st) - zero, x_ring.at[slot, p].transpose((1, 0)))

  def retire(t, accs, prev, total, wait_n: int):
    """Pipelined form: once at most ``wait_n`` wgmma groups (the next step's) are in flight,
    step ``t`` is complete: each accumulator has grown by that step's raw group partial, which
    is scaled and added to ``total``. Returns the accumulators' values and the new total."""
    slot = lax.rem(t, stages)
    raw = [plgpu.wgmma_accumulator_load(a, wait_n=wait_n) for a in accs]
    for g in range(gps):
      total = total + scale_at(slot, g) * (raw[g] - prev[g])
    if wgs > 1:
      plgpu.barrier_arrive(free.at[slot])          # this warpgroup is done with the slot
    return raw, total

  @pl.when(wg == 0)
  def _prologue():                                 # fill all but one slot
    for t in range(min(stages - 1, st.steps)):
      issue(t)
    xr.prologue()                                  # (own x ring: its first x_slots planes)

  def parts_of_step(i, carry):
    """The ``st.parts`` ring steps of layout step ``i`` in one iteration: the nibbles a ring
    step reads depend on its place in the layout step, so they stay static."""
    for h in range(st.parts):
      carry = step_partials(i * st.parts + h, carry, part=h)
    return carry

  if st.pipeline:
    total = _pipelined_total(issue_planes, retire, prefetch, zeros_tile, st)
  elif st.scaled_acc:
    # Long groups need no path of their own: their steps load the same scale row, so the unit
    # does not move (r = s / s = 1 exactly) until the group changes.
    ones = plgpu.layout_cast(jnp.ones((BN,), jnp.float32), row_vec)
    acc, unit = lax.fori_loop(0, st.steps // st.parts, parts_of_step, (zeros_tile(), ones))
    total = acc * lax.broadcast_in_dim(unit, (BN, st.m_pad), [0])
  elif st.long_groups:
    spg, parts = st.steps_per_group, st.parts    # (spg: a multiple of parts, see config.py)

    def group(gi, total):
      def inner(i, carry):
        raw, _ = carry
        for h in range(parts):                     # the parts of one layout step
          (raw_h,), (s,) = step_partials(gi * spg + i * parts + h, part=h)
          raw = raw + raw_h
        return raw, s
      raw, s = lax.fori_loop(0, spg // parts, inner, (zeros_tile(), zeros_tile()))
      return total + s * raw                     # every step of a group loads the same scale

    total = lax.fori_loop(0, st.steps // spg, group, zeros_tile())
  elif st.parts > 1:
    total = lax.fori_loop(0, st.steps // st.parts, parts_of_step, zeros_tile())
  else:
    total = lax.fori_loop(0, st.steps, step_partials, zeros_tile())

  if wgs > 1:
    # Observe the free phases the loop did not wait for (the interpreter checks every phase).
    @pl.when(wg == 0)
    def _drain():
      for t in range(max(0, st.steps - stages), st.steps):
        plgpu.barrier_wait(free.at[t % stages])
      xr.drain()

  if st.direct_out:
    # y^T tile -> y [M, N]: transposed register store into a [m_pad, 64] tile, then a TMA box
    # whose rows >= M and columns >= N the TMA unit skips.
    o_smem.T[...] = total.astype(st.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(0, st.m_pad), pl.ds(n0 + wg * BN, BN)])
  elif st.out_registers:
    o_ref.at[lax.axis_index("k"), pl.ds(n0 + wg * BN, BN)][...] = total
  else:
    o_smem[...] = total
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[lax.axis_index("k"), pl.ds(n0 + wg * BN, BN)])
  plgpu.wait_smem_to_gmem(0)


def _pipelined_total(issue_planes, retire, prefetch, zeros_tile, st: Statics):
  """K loop with one step of wgmmas in flight (compiled, ``registers_a``): step t's planes are
  dequantized and issued while step t - 1's wgmmas run, then t - 1 is retired.

  Two sets of group accumulators take even and odd steps; an accumulator is never reset, so
  step t's raw partial of group g is ``acc_g(after t) - acc_g(before t)`` (float32, error ~ one
  ulp of the running sum, which grows only like sqrt(steps) times one partial), scaled by that
  step's s_g and added to the total: y^T = sum_t sum_g s_{t,g} (acc_{t,g} - acc_{t-2,g}).
  The ring slot of step t - 1 is refilled (``prefetch(t)``) only after it is retired.
  """
  gps = st.groups_per_step
  zeros = lambda: [zeros_tile() for _ in range(gps)]

  def body(*accs):
    sets = (accs[:gps], accs[gps:])

    def advance(t, parity: int, carry):
      """Step t (t % 2 == parity) in, step t - 1 out."""
      total, prev = carry[0], list(carry[1:])
      issue_planes(t, sets[parity])
      prev[1 - parity], total = retire(t - 1, sets[1 - parity], prev[1 - parity], total,
                                       wait_n=PLANES)
      prefetch(t)
      return (total, *prev)

    prefetch(0)
    issue_planes(0, sets[0])
    carry = (zeros_tile(), zeros(), zeros())

    def pair(i, carry):
      carry = advance(2 * i + 1, 1, carry)
      return advance(2 * i + 2, 0, carry)
    carry = lax.fori_loop(0, (st.steps - 1) // 2, pair, carry)
    if (st.steps - 1) % 2:
      carry = advance(st.steps - 1, 1, carry)
    last = (st.steps - 1) % 2
    return retire(st.steps - 1, sets[last], carry[1 + last], carry[0], wait_n=0)[1]

  return pl.run_scoped(body, *[plgpu.ACC((BN, st.m_pad), jnp.float32) for _ in range(2 * gps)])


def _launch(xt, qt, scales, zeros, xsum, *, st: Statics, split_k: int, interpret: bool,
            out_shape: tuple[int, int] | None = None, plan=None):
  """``plgpu.kernel`` wrapper: grid, scratch and the float32 partials ``[split_k, Np, m_pad]``
  (``st.direct_out``: y ``out_shape = (M, N)`` in x's dtype; with a ``mosaic_stream.StreamPlan``
  the stream-K kernel on the same scratch, its parts already summed: ``[1, Np, m_pad]``)."""
  np_ = layout.code_dims(qt)[0]
  span2, stages, gps, wgs = st.span2, st.stages, st.groups_per_step, st.wgs
  x_copies = 0 if st.x_slots else st.step_planes if st.direct_x else 1
  copies = (x_copies + wgs * (2 if st.sym else 3)   # TMA copies (barrier arrivals) per step
            + (1 if st.late_zero else 0))
  out_type = (jax.ShapeDtypeStruct(out_shape, st.dtype) if st.direct_out
              else jax.ShapeDtypeStruct((split_k, np_, st.m_pad), jnp.float32))
  o_tile = (plgpu.SMEM((wgs, st.m_pad, BN), st.dtype) if st.direct_out
            else None if st.out_registers else plgpu.SMEM((wgs, BN, st.m_pad), jnp.float32))
  tiled = _tiled(span2)
  x_ring = (plgpu.SMEM((stages, PLANES, st.m_pad, mma_sync.pitch(span2)), st.dtype)
            if st.mma_sync else                                   # fragment order, padded rows
            plgpu.SMEM((st.x_slots, st.m_pad, span2), st.dtype, transforms=tiled)
            if st.x_slots else                                    # x's own ring (one plane a slot)
            plgpu.SMEM((stages, st.step_planes, st.m_pad, span2), st.dtype, transforms=tiled))
  scratch = (
      plgpu.SMEM((stages, wgs, BN, span2), jnp.int16, transforms=tiled),          # codes
      x_ring,                                                                     # x
      plgpu.SMEM((stages, wgs, gps, BN), scales.dtype),                           # scales
      None if st.sym else plgpu.SMEM((stages, wgs, gps, BN), zeros.dtype),        # zeros
      None if st.registers_a else plgpu.SMEM((wgs, 2, BN, span2), st.dtype,
                                             transforms=tiled),                   # q - z planes
      o_tile,                                                                     # output tiles
      plgpu.Barrier(num_arrivals=copies, num_barriers=stages),                    # ring ready
      plgpu.Barrier(num_arrivals=wgs, num_barriers=stages) if wgs > 1 else None,  # ring free
      plgpu.SMEM((stages, xs_rows(st), st.m_pad), jnp.float32) if st.late_zero else None,
      plgpu.Barrier(num_arrivals=1, num_barriers=st.x_slots) if st.x_slots else None,  # x ready
      (plgpu.Barrier(num_arrivals=wgs, num_barriers=st.x_slots)
       if st.x_slots and wgs > 1 else None),                                      # x free
  )
  if plan is not None:
    from quant.matmul import mosaic_stream  # pylint: disable=import-outside-toplevel
    return mosaic_stream.launch(kernel_inputs(xt, qt, scales, zeros, xsum), st=st, plan=plan,
                                scratch=scratch, interpret=interpret)[None]
  kernel = plgpu.kernel(
      functools.partial(_body_adapter, st=st),
      out_type=out_type,
      scratch_types=dict(scratch=scratch),
      grid=(np_ // (BN * wgs), split_k),
      grid_names=("n", "k"),
      num_threads=wgs,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
      kernel_name="w4a16_mosaic",
  )
  return kernel(*kernel_inputs(xt, qt, scales, zeros, xsum))


def _body_adapter(*refs, scratch, st: Statics):
  """Names ``plgpu.kernel``'s refs (inputs, output; scratch by keyword) for ``w4a16_kernel``."""
  w4a16_kernel(*split_refs(refs, st), scratch, st=st)


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------

def int4_matmul(x: Float[Array, "... K"],
                qw: formats.QuantizedWeight | layout.MosaicWeight, *,
                bias: Float[Array, "N"] | None = None, config: MosaicConfig | None = None,
                interpret: bool = False) -> Float[Array, "... N"]:
  """Mosaic GPU backend of ``quant.int4_matmul``: ``x @ dequantize(qw) (+ bias)`` in x's dtype.

  ``qw`` is a ``layout.MosaicWeight`` from ``layout.prepare_mosaic`` (checked here; its
  ``block_k`` fixes the config's) or, in interpret mode only, a ``QuantizedWeight`` (assumed
  checked by ``quant.matmul.api.check_inputs``; repacked on every call). A prepared weight
  serves any M: one call up to 256 rows where a config fits them (see ``chunk_rows``), larger
  M in equal chunks, one kernel call each. Raises NotImplementedError for
  float32 x, M > 256 on a plain QuantizedWeight, bits > 4, groups the planes cannot tile, a
  config
  that does not fit, and with ``interpret=False`` for a plain QuantizedWeight (see the module
  docstring) or a GPU that is not sm90. ``lowering_platforms=("cuda",)`` on a CPU host is
  allowed (compile checks).

  Example:
    >>> y = int4_matmul(x, qw, config=MosaicConfig(block_k=256, split_k=2), interpret=True)
    >>> y = int4_matmul(x, layout.prepare_mosaic(qw), config=None, interpret=False)
  """
  prepared = isinstance(qw, layout.MosaicWeight)
  if prepared:
    mosaic_io.check_prepared(x, qw, bias)
  else:
    formats.check_k(qw.shape[0], qw.group_size, qw.bits)
  check_supported(x, qw)
  if not prepared and not interpret:
    raise NotImplementedError("compiled mosaic int4_matmul takes a layout.MosaicWeight "
                              "(layout.prepare_mosaic(qw), once at load time): repacking a "
                              "QuantizedWeight on every call is a full extra pass over the weight")
  k, n = qw.shape
  lead = x.shape[:-1]
  x2 = x.reshape(-1, k)
  m = x2.shape[0]
  if m == 0:
    return jnp.zeros((*lead, n), x.dtype)
  rows = chunk_rows(m, qw, config) if prepared else m
  if m > rows:
    chunks = -(-m // rows)
    call = lambda xc: int4_matmul(xc, qw, bias=bias, config=config, interpret=interpret)
    if chunks <= MAX_UNROLLED_CHUNKS:
      # Unrolled: one launch per chunk and no XLA while loop. The looped form measured 9-13 us
      # above the sum of its chunks' single calls at M = 256 on the H200 (session 21); the
      # unrolled one is not yet timed there (benchmarks/NOTES.md, call 4).
      ys = [call(x2[c * rows:(c + 1) * rows]) for c in range(chunks)]
      return jnp.concatenate(ys, axis=0).reshape(*lead, n)
    xs = jnp.pad(x2, ((0, chunks * rows - m), (0, 0))).reshape(chunks, rows, k)
    y = lax.map(call, xs)
    return y.reshape(chunks * rows, n)[:m].reshape(*lead, n)
  if config is None and prepared:
    config = default_mosaic_config(m=m, k=k, n=n, group_size=qw.group_size, asym=not qw.sym,
                                   block_k=qw.block_k)
  if config is None and interpret:
    # One warpgroup under the interpreter: it runs each simulated warpgroup as a host thread
    # that blocks on the others' barriers, and on a small CPU host several of them were seen to
    # starve (a hang). Several warpgroups are still tested with an explicit block_n.
    config = dataclasses.replace(
        default_mosaic_config(m=m, k=k, n=n, group_size=qw.group_size, asym=not qw.sym),
        block_n=64)
    if prepared:
      config = dataclasses.replace(config, block_k=qw.block_k)
  cfg = resolve_config(config, m=m, k=k, n=n, group_size=qw.group_size, asym=not qw.sym)
  if prepared and cfg.block_k != qw.block_k:
    raise NotImplementedError(f"config.block_k={cfg.block_k} differs from the block_k="
                              f"{qw.block_k} the MosaicWeight was packed with")
  if not interpret and not on_hopper() and jax.default_backend() == "gpu":
    raise NotImplementedError("mosaic int4_matmul needs a Hopper GPU (sm90) or interpret=True")
  mw = qw if prepared else layout.prepare_mosaic(qw, block_k=cfg.block_k)
  if mw.perm is not None:
    x2 = jnp.take(x2, mw.perm, axis=1)        # stored row i is input feature perm[i]
  y = _fused(x2, mw.qweight, mw.scales, mw.zeros, bias,
             _Static(cfg, mw.bits, mw.group_size, k, n, bool(interpret)))
  return y.reshape(*lead, n)


MAX_UNROLLED_CHUNKS = 8      # above: a loop over the chunks (lax.map), to bound the trace


@dataclasses.dataclass(frozen=True)
class _Static:
  cfg: MosaicConfig
  bits: int
  group_size: int
  k: int
  n: int
  interpret: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fused(x, qweight, scales, zeros, bias, static: _Static):
  return _call(x, qweight, scales, zeros, bias, static=static)


def _fused_fwd(x, qweight, scales, zeros, bias, static: _Static):
  return _fused(x, qweight, scales, zeros, bias, static), (qweight, scales, zeros, bias)


def _fused_bwd(static: _Static, res, dy):
  """dx = dy @ W^T with W unpacked from the planar codes by XLA (no gradient for the weight)."""
  qweight, scales, zeros, bias = res
  wt = layout.dense_transposed(qweight, scales, zeros, block_k=static.cfg.block_k,
                               group_size=static.group_size, bits=static.bits)     # [Np, Kp]
  dx = jnp.matmul(dy.astype(jnp.float32), wt[:static.n, :static.k]).astype(dy.dtype)
  dbias = None if bias is None else jnp.sum(dy.astype(jnp.float32), axis=0).astype(bias.dtype)
  return dx, None, None, None, dbias


_fused.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.jit, static_argnames=("static",))
def _call(x, qweight, scales, zeros, bias, *, static: _Static):
  """Pads and plane-orders x, launches the kernel, adds the splits and the bias (XLA)."""
  cfg = static.cfg
  m, k = x.shape
  np_, kp = layout.code_dims(qweight)
  span2, m_pad = cfg.block_k // PLANES, mosaic_m_pad(m)
  stream = cfg.stream_ctas > 0             # stream-K (mosaic_stream.py): no K split
  ks = kp if stream else kp // cfg.split_k
  per_channel = static.group_size >= static.k
  sp = cfg.step_parts                     # (x's own ring refuses it: config.py)
  st = Statics(m_pad=m_pad, steps=ks // cfg.block_k * sp, block_k=cfg.block_k, parts=sp,
               seg=ks if per_channel else min(static.group_size, ks),
               stages=cfg.num_stages, wgs=cfg.block_n // BN, sym=zeros is None, zero=float(2 ** (static.bits - 1)),
               dtype=jnp.dtype(x.dtype), magic_bits=_MAGIC[jnp.dtype(x.dtype)][0],
               magic=_MAGIC[jnp.dtype(x.dtype)][1],
               registers_a=not static.interpret and cfg.registers_a,
               paired=not static.interpret,
               fold_zero=not static.interpret and cfg.registers_a and cfg.fold_zero,
               pipeline=(not static.interpret and cfg.registers_a and cfg.pipeline
                         and not cfg.fold_zero),
               # automatic: the grid kernel's budget; one group per scope in stream-K
               acc_columns=cfg.acc_columns or (8 if stream else ACC_COLUMNS))
  # ``direct_io`` (opt-in): the TMA unit reads x [M, K] and writes y [M, N] in place of XLA's
  # pad/transpose before the kernel and slice/transpose/cast after it (two small launches,
  # ~1.2-1.7 us each on the H200 at M = 1), but the kernel's four x boxes per step cost about
  # as much (net -1% to +4%, benchmarks/NOTES.md, session 7). Mosaic's TMA boxes want
  # each tiled GMEM dimension smaller than or a multiple of its tile (8 rows; min(span2, 64)
  # columns of x, 64 features of y); the output path also needs one K split and no bias
  # (adding the bias after a rounding to x's dtype would round twice). Otherwise XLA does it.
  rows_ok = m <= 8 or m % 8 == 0
  direct_x = ((cfg.direct_io or cfg.direct_x) and rows_ok and k % min(span2, 64) == 0
              and not stream)
  direct_out = (cfg.direct_io and rows_ok and cfg.split_k == 1 and bias is None
                and static.n % BN == 0 and not stream)
  # pipeline: one step of wgmmas in flight in the grid kernel (where its registers fit); one
  # group's in stream-K (mosaic_stream._group_pipeline: two accumulators, an even group count).
  # Above 64 rows two float32 accumulators and the total would not fit the registers.
  # x's own ring reads x by plane, which the pipelined loops and the mma.sync form (a step's
  # planes at once) do not.
  x_slots = cfg.x_slots
  pipelined = not x_slots and sp == 1 and (
      st.groups_per_step % 2 == 0 and m_pad <= MOSAIC_WIDE_M if stream else st.pipeline_fits)
  st = dataclasses.replace(st, pipeline=st.pipeline and pipelined,
                           fold_zero=st.fold_zero and not stream, direct_x=direct_x,
                           direct_out=direct_out, x_slots=x_slots)
  if x_slots and x_slots < 2 * st.scope_planes:
    raise NotImplementedError(f"x_slots={x_slots} needs at least twice the {st.scope_planes} "
                              f"planes one wgmma scope reads")
  # mma.sync: 8 or 16 rows, whole 16-byte x chunks per thread, wgmma-free forms (interpret mode
  # emulates the product from the same fragment-ordered x ring).
  st = dataclasses.replace(st, mma_sync=(
      cfg.mma_sync and cfg.registers_a and m_pad in mma_sync.ROWS and span2 in mma_sync.SPANS
      and not (direct_x or st.pipeline or st.fold_zero or st.x_slots or sp > 1)))
  # late_zero: the other two zero-point forms (pipeline, fold_zero) keep their own arithmetic.
  # scaled_acc: one accumulator through the K loop (both kernels' wgmma forms; the pipelined
  # loops and mma.sync keep their own accumulators, late_zero its per-group partials).
  st = dataclasses.replace(st, scaled_acc=(cfg.scaled_acc and not st.pipeline
                                           and not st.mma_sync and not st.x_slots))
  st = dataclasses.replace(st, fold_zero=st.fold_zero and not st.scaled_acc,
                           carry_codes=cfg.carry_codes and sp > 1)
  st = dataclasses.replace(st, late_zero=cfg.late_zero and not (st.pipeline or st.fold_zero
                                                                or st.scaled_acc))
  st = dataclasses.replace(st, out_registers=cfg.out_registers and not direct_out)
  plan = None
  if stream:
    from quant.matmul import mosaic_stream  # pylint: disable=import-outside-toplevel
    tiles, steps = np_ // cfg.block_n, kp // cfg.block_k
    plan = mosaic_stream.StreamPlan(tiles=tiles, steps=steps,
                                    ctas=min(cfg.stream_ctas, tiles * steps))
  xp = jnp.pad(x, ((0, m_pad - m), (0, kp - k)))
  if direct_x:
    xt = x
  else:
    # x in planes: xt[c, m, :] holds x's columns [c*span2, (c+1)*span2); zero padding is
    # harmless (padded weight codes and scales are 0 as well).
    xt = xp.reshape(m_pad, kp // span2, span2).transpose(1, 0, 2)
    xt = mma_sync.permute_planes(xt) if st.mma_sync else xt
  xsum = x_sums(xp, st=st) if st.late_zero else None
  parts = _launch(xt, qweight, scales, zeros, xsum, st=st, split_k=cfg.split_k,
                  interpret=static.interpret, out_shape=(m, static.n), plan=plan)
  if direct_out:
    return parts
  y = jnp.sum(parts, axis=0)[:static.n, :m].T                     # [m, n] float32
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype)

"""x's planes in a ring of their own (``MosaicConfig.x_slots``), for the grid W4A16 kernel.

By default x travels with its step: one ring slot holds a step's codes, scales and all
``PLANES`` planes of x, ``4 * m_pad * span2 * 2`` bytes of it (128 KB at 128 rows of 512-row
steps), so two stages of 512-row steps do not fit at 128 rows. With ``x_slots = S`` the planes
have their own ring of S slots of one plane each (``m_pad * span2 * 2`` bytes: 32 KB at 128 rows,
128-column planes), refilled plane by plane while the codes keep their step ring.

Protocol (warpgroup 0 issues every TMA, as for the step ring). Plane ``j = t * PLANES + p`` of
the CTA's K slice lives in slot ``j % S``; ``ready[j % S]`` gets one arrival (its TMA) and, with
several warpgroups, ``free[j % S]`` one per warpgroup once its wgmmas that read the plane are
waited. A plane's slot is refilled (with plane ``j + S``) one scope late: after the scope that
holds plane ``j + L`` completes, L the most planes one wgmma scope reads, so warpgroup 0 rarely
waits on the other warpgroups' ``free`` arrival. Plane j is then loaded once the scope holding
plane ``j - S + L`` is done, an earlier scope when ``S >= 2 L``: ``check_mosaic_shape``
requires that (g128 at 512-row steps and 65..128 rows: L = 1, so S >= 2).
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from quant.matmul.mosaic_common import PLANES, Statics


@dataclasses.dataclass(frozen=True)
class XRing:
  """x's planes for one CTA: the step ring's x (``st.x_slots == 0``) or their own ring.

  ``xt_ref``: x in planes ``[Kp/span2, m_pad, span2]`` (``st.direct_x``: x ``[M, K]``);
  ``x_ring``: SMEM ``[stages, PLANES, m_pad, span2]`` or ``[x_slots, m_pad, span2]``;
  ``ready`` / ``free``: the plane ring's barriers (None without it; ``free`` None with one
  warpgroup); ``step_of``: local step (or stream-K unit) -> the global K step it reads;
  ``steps``: local steps of this CTA (an int, or traced in stream-K); ``wg``: this warpgroup.
  """
  st: Statics
  xt_ref: object
  x_ring: object
  ready: object
  free: object
  step_of: object
  steps: object
  wg: object

  @property
  def own(self) -> bool:
    return self.st.x_slots > 0

  @property
  def count(self):
    """Planes this CTA reads."""
    return self.steps * PLANES

  def _issue(self, j):
    """TMA of local plane ``j`` into slot ``j % x_slots`` (one arrival on its ``ready``)."""
    st, slot = self.st, lax.rem(j, self.st.x_slots)
    gp = self.step_of(lax.div(j, PLANES)) * PLANES + lax.rem(j, PLANES)
    if st.direct_x:   # box [m_pad, span2] of x [M, K]: rows >= M, columns >= K zero-filled
      src = self.xt_ref.at[pl.ds(0, st.m_pad), pl.ds(gp * st.span2, st.span2)]
    else:
      src = self.xt_ref.at[gp]
    plgpu.copy_gmem_to_smem(src, self.x_ring.at[slot], self.ready.at[slot])

  def step_copy(self, gt, slot, bar) -> None:
    """The step ring's part: step ``gt``'s planes into step slot ``slot`` (own ring: none)."""
    st = self.st
    if self.own:
      return
    n = st.step_planes                            # (half steps: half a layout step's planes)
    if st.direct_x:
      for p in range(n):
        cols = pl.ds((gt * n + p) * st.span2, st.span2)
        plgpu.copy_gmem_to_smem(self.xt_ref.at[pl.ds(0, st.m_pad), cols],
                                self.x_ring.at[slot, p], bar)
    else:
      plgpu.copy_gmem_to_smem(self.xt_ref.at[pl.ds(gt * n, n)], self.x_ring.at[slot], bar)

  def prologue(self) -> None:
    """Warpgroup 0, before the loop: the first ``x_slots`` planes."""
    if not self.own:
      return
    for j in range(self.st.x_slots):              # (pl.when: a Python bool in the grid kernel)
      pl.when(j < self.count)(functools.partial(self._issue, j))

  def plane(self, t, slot, p):
    """Plane ``p`` of local step ``t`` (step ring slot ``slot``), ``[m_pad, span2]``; with its
    own ring this waits for the plane's TMA first."""
    if not self.own:
      return self.x_ring.at[slot, p]
    x_slot = lax.rem(t * PLANES + p, self.st.x_slots)
    plgpu.barrier_wait(self.ready.at[x_slot])
    return self.x_ring.at[x_slot]

  def release(self, t, planes: tuple[int, ...], lag: int) -> None:
    """After a scope's wgmmas that read ``planes`` of local step ``t`` are waited: this
    warpgroup is done with them; warpgroup 0 refills the slots of the planes ``lag`` before
    them (with the planes ``x_slots`` after those)."""
    if not self.own:
      return
    st = self.st
    for p in planes:
      if self.free is not None:
        plgpu.barrier_arrive(self.free.at[lax.rem(t * PLANES + p, st.x_slots)])
    for p in planes:
      old = t * PLANES + p - lag                   # its slot takes plane old + x_slots

      @pl.when(jnp.logical_and(self.wg == 0, jnp.logical_and(
          old >= 0, old + st.x_slots < self.count)))
      def _():
        if self.free is not None:
          plgpu.barrier_wait(self.free.at[lax.rem(old, st.x_slots)])
        self._issue(old + st.x_slots)

  def drain(self) -> None:
    """Warpgroup 0, after the loop: the ``free`` phases no refill waited for (the last
    ``x_slots`` planes'; the interpreter checks every phase)."""
    if not self.own or self.free is None:
      return
    xs = self.st.x_slots

    @pl.loop(jnp.maximum(self.count - xs, 0), self.count)
    def _(j):
      plgpu.barrier_wait(self.free.at[lax.rem(j, xs)])

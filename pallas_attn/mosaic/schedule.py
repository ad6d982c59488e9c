"""Dynamic tile scheduler for the persistent Mosaic GPU forward (FA3 Section 3.1, "tile scheduler").

A persistent launch runs one CTA per SM; each CTA loops over (batch, head, query tile) tiles. With
a causal or window mask the tiles' lengths differ up to ``n_tiles``-fold, and any static deal of
tiles to CTAs leaves SMs idle at the end (H200, session 4: round-robin 1.04-1.5x slower than the
one-CTA-per-tile grid, a "snake" deal still 1-5% slower). Here a CTA takes its next tile from a
global counter instead, the greedy longest-first rule: tiles are numbered heaviest first within
each batch (head fastest, as the grid launches them, so concurrent tiles share K/V in L2), CTA c
starts on tile c, and whenever a CTA starts a tile it claims the next unclaimed one with an
atomic fetch-add, ``next = num_ctas + atomicAdd(counter, 1)``. A CTA that drew short tiles simply
draws more of them.

Hand-over inside the CTA: the producer warpgroup claims (publication p, made when it starts its
(p-1)-th tile, so the claim's latency hides behind the K/V stream) and writes the tile index to a
two-slot SMEM ring; ``ready[p % 2]`` (one arrival) tells the consumers, who read it when they
finish their (p-1)-th tile (to prefetch the next Q) and release the slot with ``free[p % 2]``
(one arrival per consumer). An index >= num_tiles ends every warpgroup's loop.

The counter is an int32[1] zero-initialised ``jax.new_ref`` operand per call (one small memset).
The Mosaic GPU interpreter runs neither inline PTX/LLVM nor global atomics, so in interpret mode
the producer publishes the round-robin successor ``current + num_ctas`` instead: the hand-over
(slots, barriers, loop exits) is what the interpret tests check; the atomic itself only runs
compiled.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref

SLOTS = 2


def scratch_types(*, consumers: int):
  """(SMEM ring of tile indices, ready barriers, free barriers: one arrival per consumer)."""
  return (plgpu.SMEM((SLOTS,), jnp.int32),
          plgpu.Barrier(num_barriers=SLOTS),
          plgpu.Barrier(num_arrivals=consumers, num_barriers=SLOTS))


def fetch_add(counter_ref, slots_ref, slot, *, offset: int):
  """``slots_ref[slot] = offset + atomicAdd(counter_ref[0], 1)``: one thread of the calling
  warpgroup does the (relaxed) atomic and the store, then the warpgroup meets on its barrier so
  that whichever thread arrives on the ready barrier next has the store behind it.
  Compiled only (inline Mosaic GPU / LLVM)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT))
  def _grab(_, counter, slots, slot_arr):
    i32 = ir.IntegerType.get_signless(32)
    index = ir.IndexType.get()
    with mgpu_utils.single_thread(mgpu_utils.ThreadSubset.WARPGROUP):
      old = llvm.atomicrmw(llvm.AtomicBinOp.add, mgpu_utils.memref_ptr(counter),
                           mgpu_utils.c(1, i32), llvm.AtomicOrdering.monotonic)
      where = arith.index_cast(index, slot_arr.registers.item())
      memref.store(arith.addi(old, mgpu_utils.c(offset, i32)), slots, [where])
    mgpu_utils.warpgroup_barrier()
  _grab(counter_ref, slots_ref, jnp.asarray(slot, jnp.int32))


def publish(p, current, *, counter_ref, slots, ready, free, num_ctas: int, compiled: bool):
  """Producer: claim the tile after ``current`` as publication ``p`` (p >= 1) and return it."""
  slot = lax.rem(p, SLOTS)

  @pl.when(p > SLOTS)
  def _():                          # publication p - 2 used this slot: both consumers read it
    plgpu.barrier_wait(free.at[slot])
  if compiled:
    fetch_add(counter_ref, slots, slot, offset=num_ctas)
  else:
    slots[slot] = current + num_ctas
  plgpu.barrier_arrive(ready.at[slot])
  return slots[slot]


def take(p, *, slots, ready, free):
  """Consumer: the tile index of publication ``p``, then release its slot."""
  slot = lax.rem(p, SLOTS)
  plgpu.barrier_wait(ready.at[slot])
  nxt = slots[slot]
  plgpu.barrier_arrive(free.at[slot])
  return nxt


def drain(last, *, free):
  """Producer, after its loop (``last`` = publications made): wait for the releases of the
  last two publications, so every barrier phase is observed before the barriers go away."""
  @pl.loop(jnp.maximum(last - 1, 1), last + 1)
  def _(p):
    plgpu.barrier_wait(free.at[lax.rem(p, SLOTS)])

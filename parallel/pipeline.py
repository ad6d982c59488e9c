"""Pipeline parallelism with ``shard_map`` + ``ppermute`` over the ``stage`` mesh axis.

A model's blocks are held stacked (leading layer axis, ``GPTConfig(scan_layers=True)``). With
``p`` stages and ``v`` virtual stages the ``L`` layers form ``p * v`` chunks of ``L / (p v)``
consecutive layers; chunk ``r * p + s`` lives on stage ``s``. The batch is split into ``m``
micro-batches that flow stage to stage, one hop per tick.

Schedules:
  * ``gpipe``: all forwards, then (by autodiff of the tick loop) all backwards. Activations of
    all ``m`` micro-batches stay alive. Bubble ``(p - 1) / (m + p - 1)``.
  * ``1f1b``: after ``p - s - 1`` warm-up forwards, stage ``s`` alternates one forward and one
    backward, so at most ``p`` micro-batch inputs are stashed per stage; the stage interior is
    recomputed in the backward (stage-level checkpointing). The loss function stays opaque, so the
    loss itself comes from a plain forward sweep and the 1F1B sweep runs in the backward pass
    (``jax.custom_vjp``); cost 3F + B instead of 2F + B. Bubble ``(p - 1) / (m + p - 1)``.
  * ``interleaved``: circular pipeline; every micro-batch goes ``v`` times round the ring of
    stages, bubble ``(p - 1) / (v m + p - 1)``. Needs ``m % p == 0``.

The ``shard_map`` is manual over ``stage`` only, so data / FSDP / tensor sharding of the other
mesh axes keeps working inside each stage (3D parallelism).

Example:
  >>> cfg = PipelineConfig(schedule="1f1b", microbatches=8)
  >>> y = pipeline_apply(layer_fn, stacked_params, x, mesh=make_mesh(stage=4, data=2), config=cfg)
  >>> cfg.bubble_fraction(stages=4)
  0.2727...
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

SCHEDULES = ("gpipe", "1f1b", "interleaved")
LayerFn = Callable[[Any, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """How to pipeline: schedule, number of micro-batches, virtual stages per device.

  Example:
    >>> PipelineConfig(schedule="interleaved", microbatches=8, virtual_stages=2)
  """
  schedule: str = "gpipe"
  microbatches: int = 4
  virtual_stages: int = 1
  axis: str = "stage"

  def __post_init__(self):
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule={self.schedule!r} is not one of {SCHEDULES}")
    for name in ("microbatches", "virtual_stages"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    if self.schedule != "interleaved" and self.virtual_stages != 1:
      raise ValueError(f"virtual_stages={self.virtual_stages} needs schedule='interleaved'")

  def validate(self, *, stages: int, layers: int, batch: int | None = None) -> None:
    """Raises ``ValueError`` naming the problem when this config cannot run."""
    if self.microbatches % stages:
      raise ValueError(f"microbatches={self.microbatches} must be divisible by "
                       f"stages={stages}")
    chunks = stages * self.virtual_stages
    if layers % chunks:
      raise ValueError(f"layers={layers} must be divisible by stages={stages} x "
                       f"virtual_stages={self.virtual_stages} = {chunks}")
    if batch is not None and batch % self.microbatches:
      raise ValueError(f"batch={batch} must be divisible by microbatches={self.microbatches}")

  def bubble_fraction(self, *, stages: int) -> float:
    """Idle fraction of the schedule: ``(p - 1) / (v m + p - 1)``."""
    return (stages - 1) / (self.virtual_stages * self.microbatches + stages - 1)


# ------------------------------------------------------------------------------ 1F1B schedule
IDLE, FWD, BWD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Schedule1F1B:
  """Static 1F1B timetable. ``op[t, s]`` in {IDLE, FWD, BWD} on micro-batch ``mb[t, s]``.

  ``recv_f[t, s]`` / ``recv_b[t, s]``: micro-batch whose activation / gradient arrives at stage
  ``s`` at the start of tick ``t`` (-1: none). ``stash`` and ``grad_slots`` are the buffer sizes
  needed (activations alive from arrival to backward; gradients from arrival to use).
  """
  op: np.ndarray
  mb: np.ndarray
  recv_f: np.ndarray
  recv_b: np.ndarray
  stash: int
  grad_slots: int

  @property
  def bubble_fraction(self) -> float:
    return float((self.op == IDLE).mean())


@functools.lru_cache(maxsize=64)
def schedule_1f1b(*, stages: int, microbatches: int) -> Schedule1F1B:
  """Builds the 1F1B timetable by simulating each stage's op list against its dependencies.

  Example:
    >>> schedule_1f1b(stages=4, microbatches=8).stash
    4
  """
  p, m = stages, microbatches
  lists = []
  for s in range(p):
    warm = min(p - s - 1, m)
    ops = [(FWD, i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
      ops += [(FWD, f), (BWD, b)]
      f, b = f + 1, b + 1
    ops += [(BWD, i) for i in range(b, m)]
    lists.append(ops)
  done: dict[tuple[int, int, int], int] = {}   # (kind, stage, mb) -> tick finished
  pos = [0] * p
  rows = []
  t = 0
  while any(pos[s] < len(lists[s]) for s in range(p)):
    row = []
    for s in range(p):
      if pos[s] == len(lists[s]):
        row.append((IDLE, -1))
        continue
      kind, i = lists[s][pos[s]]
      if kind == FWD:
        ready = s == 0 or done.get((FWD, s - 1, i), t) < t
      else:
        ready = done.get((FWD, s, i), t) < t if s == p - 1 else done.get((BWD, s + 1, i), t) < t
      row.append((kind, i) if ready else (IDLE, -1))
    for s, (kind, i) in enumerate(row):
      if kind != IDLE:
        done[(kind, s, i)] = t
        pos[s] += 1
    rows.append(row)
    t += 1
    if t > 4 * (m + p) + 8:
      raise RuntimeError("1F1B schedule simulation did not terminate")
  ticks = len(rows)
  op = np.array([[k for k, _ in r] for r in rows], np.int32)
  mb = np.array([[i for _, i in r] for r in rows], np.int32)
  recv_f = np.full((ticks, p), -1, np.int32)
  recv_b = np.full((ticks, p), -1, np.int32)
  for t in range(1, ticks):
    for s in range(p):
      if s > 0 and op[t - 1, s - 1] == FWD:
        recv_f[t, s] = mb[t - 1, s - 1]
      if s < p - 1 and op[t - 1, s + 1] == BWD:
        recv_b[t, s] = mb[t - 1, s + 1]
  stash = grad_slots = 1
  for s in range(p):
    start_f = {i: (done[(FWD, s - 1, i)] + 1 if s else done[(FWD, s, i)]) for i in range(m)}
    start_b = {i: done[(BWD, s + 1, i)] + 1 for i in range(m)} if s < p - 1 else {}
    for t in range(ticks):
      alive = sum(start_f[i] <= t <= done[(BWD, s, i)] for i in range(m))
      waiting = sum(start_b[i] <= t <= done[(BWD, s, i)] for i in start_b)
      stash, grad_slots = max(stash, alive), max(grad_slots, waiting)
  return Schedule1F1B(op, mb, recv_f, recv_b, stash, grad_slots)


# ------------------------------------------------------------------------------ helpers
def _num_layers(params: Any) -> int:
  sizes = {x.shape[0] for x in jax.tree.leaves(params)}
  if len(sizes) != 1:
    raise ValueError(f"stacked params must share one leading layer dimension, got {sizes}")
  return sizes.pop()


def _stage_fn(layer_fn: LayerFn, remat: str) -> Callable[[Any, jax.Array], jax.Array]:
  from parallel.train import REMAT_POLICIES
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat={remat!r} is not one of {sorted(REMAT_POLICIES)}")
  fn = layer_fn if remat == "none" else jax.checkpoint(layer_fn, policy=REMAT_POLICIES[remat])

  def stage(chunk_params, h):
    h, _ = jax.lax.scan(lambda h, p: (fn(p, h), None), h, chunk_params)
    return h
  return stage


def _to_microbatches(x: jax.Array, m: int) -> jax.Array:
  # Strided split (micro-batch j = rows j, j + m, ...) keeps data-parallel rows on their devices.
  return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _from_microbatches(x: jax.Array) -> jax.Array:
  return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _chunked(params: Any, *, stages: int, virtual: int) -> Any:
  # [L, ...] -> [v, p, L / (p v), ...]; chunk r * p + s holds layers of that index.
  return jax.tree.map(
      lambda a: a.reshape(virtual, stages, a.shape[0] // (stages * virtual), *a.shape[1:]), params)


def _select(pred, new, old):
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


# ------------------------------------------------------------------------------ forward sweep
def _forward_sweep(stage, params, xs, *, axis: str, stages: int, virtual: int):
  """Runs inside shard_map. params: [v, 1, Lc, ...] local; xs: [m, mb, ...]. Returns [m, mb, ...]
  (valid on every stage)."""
  p, v, m = stages, virtual, xs.shape[0]
  s = jax.lax.axis_index(axis)
  params = jax.tree.map(lambda a: a[:, 0], params)
  n_items = m * v
  ring = [(j, (j + 1) % p) for j in range(p)]
  zero = jax.lax.pcast(jnp.zeros_like(xs[0]), axis, to="varying")
  buf = jax.lax.pcast(jnp.zeros_like(xs), axis, to="varying")
  # Only the circular schedule needs stage 0 to keep items between rounds.
  circ0 = buf if v > 1 else jax.lax.pcast(jnp.zeros((1,), xs.dtype), axis, to="varying")

  def tick(carry, t):
    recv, circ, out = carry
    if v > 1:  # stage 0 keeps items coming back round the ring for their next round
      k_in = t - p
      keep = (s == 0) & (k_in >= 0) & (k_in < n_items - m)
      slot = jnp.clip(k_in, 0, n_items - 1) % m
      circ = circ.at[slot].set(jnp.where(keep, recv, circ[slot]))
    k = jnp.clip(t - s, 0, n_items - 1)
    r, i = k // m, k % m
    first = jnp.where(r == 0, xs[i], circ[i]) if v > 1 else xs[i]
    # Bubble ticks (no item here yet, or none left) run the stage on a real micro-batch, not
    # on the placeholder zeros: their result is discarded with ``where``, but autodiff still
    # sends a zero cotangent through the stage, and 0 * NaN = NaN for a layer singular at 0
    # (a norm without eps). (Skipping the stage with ``lax.cond`` would put a conditional,
    # a predicate copy to the host on GPU, in every tick; the bubble's time is spent anyway.)
    active = (t - s >= 0) & (t - s < n_items)
    h = jnp.where(active, jnp.where(s == 0, first, recv), xs[i])
    chunk = jax.tree.map(lambda a: a[r], params)
    y = stage(chunk, h)
    done = (s == p - 1) & active & (r == v - 1)
    out = out.at[i].set(jnp.where(done, y, out[i]))
    recv = jax.lax.ppermute(y, axis, ring)
    return (recv, circ, out), None

  (_, _, out), _ = jax.lax.scan(tick, (zero, circ0, buf), jnp.arange(n_items + p - 1))
  return jax.lax.psum(jnp.where(s == p - 1, out, jnp.zeros_like(out)), axis)


# ------------------------------------------------------------------------------ 1F1B sweep
def _one_f_one_b_sweep(stage, params, xs, dys, *, axis: str, stages: int, table: Schedule1F1B):
  """Runs inside shard_map: forward and backward interleaved per the 1F1B table.
  Returns (parameter gradients [1, 1, Lc, ...], input gradients [m, mb, ...])."""
  p = stages
  s = jax.lax.axis_index(axis)
  local = jax.tree.map(lambda a: a[0, 0], params)
  op, mb = jnp.asarray(table.op), jnp.asarray(table.mb)
  recv_f, recv_b = jnp.asarray(table.recv_f), jnp.asarray(table.recv_b)
  fwd_perm = [(j, j + 1) for j in range(p - 1)]
  bwd_perm = [(j + 1, j) for j in range(p - 1)]

  def varying(x):
    return jax.lax.pcast(x, axis, to="varying")

  stash = varying(jnp.zeros((table.stash,) + xs.shape[1:], xs.dtype))
  gbuf = varying(jnp.zeros((table.grad_slots,) + xs.shape[1:], xs.dtype))
  dxs = varying(jnp.zeros_like(xs))
  grads = jax.tree.map(jnp.zeros_like, local)
  zero = varying(jnp.zeros_like(xs[0]))

  def tick(carry, t):
    in_f, in_b, stash, gbuf, dxs, grads = carry
    i_f, i_b = recv_f[t, s], recv_b[t, s]
    sl = jnp.maximum(i_f, 0) % table.stash
    stash = stash.at[sl].set(jnp.where(i_f >= 0, in_f, stash[sl]))
    gl = jnp.maximum(i_b, 0) % table.grad_slots
    gbuf = gbuf.at[gl].set(jnp.where(i_b >= 0, in_b, gbuf[gl]))
    i = jnp.maximum(mb[t, s], 0)

    def idle(stash, dxs, grads):
      return zero, zero, stash, dxs, grads

    def forward(stash, dxs, grads):
      h = jnp.where(s == 0, xs[i], stash[i % table.stash])
      stash = stash.at[i % table.stash].set(h)
      return stage(local, h), zero, stash, dxs, grads

    def backward(stash, dxs, grads):
      h = stash[i % table.stash]
      dy = jnp.where(s == p - 1, dys[i], gbuf[i % table.grad_slots])
      _, vjp = jax.vjp(stage, local, h)
      dp, dh = vjp(dy)
      dxs = dxs.at[i].set(jnp.where(s == 0, dh, dxs[i]))
      return zero, dh, stash, dxs, jax.tree.map(jnp.add, grads, dp)

    send_f, send_b, stash, dxs, grads = jax.lax.switch(
        op[t, s], (idle, forward, backward), stash, dxs, grads)
    in_f = jax.lax.ppermute(send_f, axis, fwd_perm)
    in_b = jax.lax.ppermute(send_b, axis, bwd_perm)
    return (in_f, in_b, stash, gbuf, dxs, grads), None

  init = (zero, zero, stash, gbuf, dxs, grads)
  (_, _, _, _, dxs, grads), _ = jax.lax.scan(tick, init, jnp.arange(table.op.shape[0]))
  dxs = jax.lax.psum(jnp.where(s == 0, dxs, jnp.zeros_like(dxs)), axis)
  return jax.tree.map(lambda g: g[None, None], grads), dxs


# ------------------------------------------------------------------------------ public
def pipeline_apply(layer_fn: LayerFn, params: Any, x: jax.Array, *, mesh: Mesh,
                   config: PipelineConfig, remat: str = "none") -> jax.Array:
  """Applies ``L`` stacked layers to ``x`` as a pipeline over ``config.axis``.

  Equal to ``lax.scan(lambda h, p: (layer_fn(p, h), None), x, params)[0]``, and differentiable
  (GPipe / interleaved by autodiff of the tick loop, 1F1B by its own backward sweep).

  Args:
    layer_fn: ``layer_fn(layer_params, h) -> h``, one layer, pure.
    params: pytree of arrays with a leading layer axis ``L``.
    x: ``[B, ...]`` with ``B`` divisible by ``config.microbatches``.
    mesh: a mesh with the ``config.axis`` axis.
    config: the schedule.
    remat: activation checkpointing policy per layer (see ``parallel.REMAT_POLICIES``).

  Example:
    >>> y = pipeline_apply(lambda w, h: jnp.tanh(h @ w), ws, x, mesh=mesh,
    ...                    config=PipelineConfig(schedule="gpipe", microbatches=4))
  """
  axis = config.axis
  if axis not in mesh.shape:
    raise ValueError(f"mesh has no pipeline axis {axis!r}; its axes are {tuple(mesh.shape)}")
  p, v, m = mesh.shape[axis], config.virtual_stages, config.microbatches
  config.validate(stages=p, layers=_num_layers(params), batch=x.shape[0])
  stage = _stage_fn(layer_fn, remat)
  chunked = _chunked(params, stages=p, virtual=v)
  param_spec = jax.tree.map(lambda _: P(None, axis), chunked)
  forward = jax.shard_map(
      functools.partial(_forward_sweep, stage, axis=axis, stages=p, virtual=v),
      mesh=mesh, in_specs=(param_spec, P()), out_specs=P(), axis_names={axis})
  xs = _to_microbatches(x, m)
  if config.schedule != "1f1b":
    return _from_microbatches(forward(chunked, xs))

  table = schedule_1f1b(stages=p, microbatches=m)
  sweep = jax.shard_map(
      functools.partial(_one_f_one_b_sweep, stage, axis=axis, stages=p, table=table),
      mesh=mesh, in_specs=(param_spec, P(), P()), out_specs=(param_spec, P()),
      axis_names={axis})

  @jax.custom_vjp
  def run(chunked, xs):
    return forward(chunked, xs)

  def run_fwd(chunked, xs):
    return forward(chunked, xs), (chunked, xs)

  def run_bwd(res, dys):
    chunked, xs = res
    return sweep(chunked, xs, dys)

  run.defvjp(run_fwd, run_bwd)
  return _from_microbatches(run(chunked, xs))


def pipeline_runner(*, mesh: Mesh, config: PipelineConfig, remat: str = "none") -> Callable:
  """A ``GPT.layer_runner`` that pipelines the stacked blocks (``make_train_step`` installs it).

  Example:
    >>> model.layer_runner = pipeline_runner(mesh=mesh, config=PipelineConfig(microbatches=4))
  """
  def run(apply, params, x, *, stacked):
    if not stacked:
      raise ValueError("pipelines need stacked layers: GPTConfig(scan_layers=True)")
    return pipeline_apply(apply, params, x, mesh=mesh, config=config, remat=remat)
  return run

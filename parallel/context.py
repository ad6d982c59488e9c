"""Context parallelism: ring attention over a sequence-sharded mesh axis.

Queries, keys and values ``[B, T, N|K, H]`` are split over the sequence on ``axis`` (``n``
devices). Each device keeps its queries and passes its K/V chunk round the ring with
``ppermute``; after ``n`` steps every query has met every key. Per step and per pair of chunks it
calls ``pallas_attn.flash_attention(..., return_lse=True)`` and merges the partial results by
their log-sum-exp:

    lse = log(e^lse_a + e^lse_b),   out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse)

computed around a finite running maximum, so rows that have seen no key yet (lse = -inf) give 0
and never NaN, in the forward and the backward pass.

Causal masks are decided per chunk pair from global chunk indices: a K/V chunk entirely before the
query chunk is attended in full, the diagonal chunk with ``causal=True`` (equal lengths, so the
bottom-right alignment of ``flash_attention`` is the usual one), and chunks after it are skipped
(no kernel call). With ``load_balance=True`` the sequence is cut into ``2n`` chunks and device
``d`` holds chunks ``d`` and ``2n - 1 - d`` (zig-zag), so every device does the same causal work.

Gradients: by default a ``custom_vjp`` turns the ring a second time in the backward pass, carrying
each K/V chunk with its gradient accumulators and recomputing every chunk's attention under
``jax.vjp`` (like FlashAttention's own recompute), so memory stays ``O(T / n)`` per device.
``efficient_backward=False`` instead differentiates the forward ring (``flash_attention`` is a
``custom_vjp`` whose lse output is differentiable), which keeps all K/V chunks: ``O(T)``.

Example:
  >>> mesh = make_mesh(data=2, tensor=4)
  >>> out = ring_attention(q, k, v, mesh=mesh, axis="tensor", causal=True)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from parallel.mesh import axis_size

BatchAxes = str | tuple[str, ...] | None
FULL, DIAGONAL, HIDDEN = 0, 1, 2


def zigzag_permutation(length: int, n: int) -> np.ndarray:
  """Positions in zig-zag order: device ``d`` gets chunks ``d`` and ``2n - 1 - d`` of ``2n``.

  Example:
    >>> zigzag_permutation(8, 2)
    array([0, 1, 6, 7, 2, 3, 4, 5])
  """
  if length % (2 * n):
    raise ValueError(f"sequence length {length} is not divisible by 2 x {n} (zig-zag chunks)")
  c = length // (2 * n)
  chunks = [i for d in range(n) for i in (d, 2 * n - 1 - d)]
  return np.concatenate([np.arange(i * c, (i + 1) * c) for i in chunks])


def merge_partials(out_a, lse_a, out_b, lse_b):
  """Combines two attention partials over disjoint key sets by their lse (``[B, T, N, H]`` /
  ``[B, N, T]``). Safe for ``-inf``: no NaN in values or gradients.

  Example:
    >>> out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
  """
  m = jax.lax.stop_gradient(jnp.maximum(lse_a, lse_b))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
  total = wa + wb
  seen = total > 0
  safe = jnp.where(seen, total, 1.0)
  lse = jnp.where(seen, m + jnp.log(safe), -jnp.inf)
  to_out = lambda w: jnp.swapaxes(w / safe, 1, 2)[..., None]      # [B, N, T] -> [B, T, N, 1]
  out = out_a * to_out(wa).astype(out_a.dtype) + out_b * to_out(wb).astype(out_b.dtype)
  return out, lse


def _varying_axes(x) -> tuple[str, ...]:
  # The manual mesh axes along which x differs between devices inside shard_map.
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  return tuple(sorted(mat.varying if mat is not None else getattr(aval, "vma", ())))


def _attend(q, k, v, *, causal, scale, implementation):
  import pallas_attn
  out, lse = pallas_attn.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True,
                                         implementation=implementation)
  return out, lse.astype(jnp.float32)


def _hidden(q, k, v):
  """The partial of a key chunk hidden from every query: out 0, lse -inf."""
  b, t, n, _ = q.shape
  lse = jnp.full((b, n, t), -jnp.inf, jnp.float32)
  vma = _varying_axes(q)
  return jnp.zeros_like(q), (jax.lax.pcast(lse, vma, to="varying") if vma else lse)


def _pair_kind(a: int, b: int, step: int, *, causal: bool, load_balance: bool):
  """Static visibility of (query piece a, key piece b) at ring step ``step``: FULL, DIAGONAL,
  HIDDEN, or ("dynamic", sign) when it depends on the device: full iff sign * (src - d) < 0."""
  if not causal:
    return FULL
  if load_balance:
    # Pieces: query chunks (d, 2n-1-d), key chunks (s, 2n-1-s), with d, s < n.
    if (a, b) == (0, 1):
      return HIDDEN                     # key chunk 2n-1-s >= n > d
    if (a, b) == (1, 0):
      return FULL                       # key chunk s < n <= 2n-1-d
  if step == 0:
    return DIAGONAL                     # s == d: the same chunk
  return ("dynamic", 1 if a == 0 else -1)


def _tasks(step, d, *, n, pieces, c, causal, load_balance, scale, implementation):
  """The calls of one ring step: (query piece, key slice, partial attention fn, predicate),
  where the predicate (None: always) says whether the device sees that key chunk at all."""
  src = (d - step) % n                          # owner of the K/V chunk held at this step
  attend = functools.partial(_attend, scale=scale, implementation=implementation)
  tasks = []
  for a in range(pieces):
    if not causal:                              # every key visible: one call on the whole chunk
      tasks.append((a, None, functools.partial(attend, causal=False), None))
      continue
    for b in range(pieces):
      kind = _pair_kind(a, b, step, causal=causal, load_balance=load_balance)
      if kind == HIDDEN:
        continue
      sl = None if pieces == 1 else slice(b * c, (b + 1) * c)
      if kind in (FULL, DIAGONAL):
        tasks.append((a, sl, functools.partial(attend, causal=kind == DIAGONAL), None))
      else:
        tasks.append((a, sl, functools.partial(attend, causal=False),
                      kind[1] * (src - d) < 0))
  return tasks


def _take(x, sl):
  return x if sl is None else x[:, sl]


def _ring_forward(q, k, v, *, axis: str, n: int, pieces: int, **statics):
  """Local out [B, T/n, N, H] and lse [B, N, T/n] after a full turn of the ring."""
  d = jax.lax.axis_index(axis)
  c = q.shape[1] // pieces
  q_parts = [q[:, i * c:(i + 1) * c] for i in range(pieces)]
  outs, lses = [None] * pieces, [None] * pieces
  ring = [(j, (j + 1) % n) for j in range(n)]
  for step in range(n):
    for a, sl, fn, visible in _tasks(step, d, n=n, pieces=pieces, c=c, **statics):
      args = (q_parts[a], _take(k, sl), _take(v, sl))
      o, l = fn(*args) if visible is None else jax.lax.cond(visible, fn, _hidden, *args)
      if outs[a] is None:
        outs[a], lses[a] = o, l
      else:
        outs[a], lses[a] = merge_partials(outs[a], lses[a], o, l)
    if step < n - 1:
      k, v = jax.lax.ppermute((k, v), axis, ring)
  return jnp.concatenate(outs, axis=1).astype(q.dtype), jnp.concatenate(lses, axis=2)


def _ring_backward(q, k, v, out, lse, dout, *, axis: str, n: int, pieces: int, **statics):
  """Gradients in O(T / n) memory: K/V go round again with their gradient accumulators; each
  chunk's partial attention is recomputed under ``jax.vjp`` with the cotangents the lse merge
  gives it:  w_j = exp(lse_j - lse),  d out_j = w_j dout,  d lse_j = w_j <dout, out_j - out>."""
  d = jax.lax.axis_index(axis)
  c = q.shape[1] // pieces
  part = lambda x, a: x[:, a * c:(a + 1) * c]
  q_parts = [part(q, a) for a in range(pieces)]
  dq = [jnp.zeros_like(p) for p in q_parts]
  dk, dv = jnp.zeros_like(k), jnp.zeros_like(v)
  ring = [(j, (j + 1) % n) for j in range(n)]
  for step in range(n):
    for a, sl, fn, visible in _tasks(step, d, n=n, pieces=pieces, c=c, **statics):
      def grads(q_a, k_b, v_b, fn=fn, a=a):
        (o, l), vjp = jax.vjp(fn, q_a, k_b, v_b)
        total = lse[:, :, a * c:(a + 1) * c]
        ok = jnp.isfinite(total) & jnp.isfinite(l)
        w = jnp.where(ok, jnp.exp(jnp.where(ok, l - total, 0.0)), 0.0)          # [B, N, t]
        g = part(dout, a).astype(jnp.float32)
        g_o = (g * jnp.swapaxes(w, 1, 2)[..., None]).astype(o.dtype)
        inner = jnp.sum(g * (o.astype(jnp.float32) - part(out, a).astype(jnp.float32)), axis=-1)
        return vjp((g_o, w * jnp.swapaxes(inner, 1, 2)))

      args = (q_parts[a], _take(k, sl), _take(v, sl))
      if visible is None:
        dq_a, dk_b, dv_b = grads(*args)
      else:   # a chunk this device cannot see contributes nothing: skip its recompute
        dq_a, dk_b, dv_b = jax.lax.cond(
            visible, grads, lambda *xs: tuple(jnp.zeros_like(x) for x in xs), *args)
      dq[a] = dq[a] + dq_a
      if sl is None:
        dk, dv = dk + dk_b, dv + dv_b
      else:
        dk, dv = dk.at[:, sl].add(dk_b), dv.at[:, sl].add(dv_b)
    if step < n - 1:
      k, v, dk, dv = jax.lax.ppermute((k, v, dk, dv), axis, ring)
  dk, dv = jax.lax.ppermute((dk, dv), axis, ring)   # one more hop: back to the chunks' owners
  return jnp.concatenate(dq, axis=1), dk, dv


def _ring(q, k, v, *, axis: str, n: int, causal: bool, load_balance: bool, scale,
          implementation, efficient_backward: bool):
  statics = dict(axis=axis, n=n, pieces=2 if load_balance else 1, causal=causal,
                 load_balance=load_balance, scale=scale, implementation=implementation)
  if not efficient_backward:
    return _ring_forward(q, k, v, **statics)[0]

  @jax.custom_vjp
  def ring(q, k, v):
    return _ring_forward(q, k, v, **statics)[0]

  def ring_fwd(q, k, v):
    out, lse = _ring_forward(q, k, v, **statics)
    return out, (q, k, v, out, lse)

  def ring_bwd(res, dout):
    return _ring_backward(*res, dout, **statics)

  ring.defvjp(ring_fwd, ring_bwd)
  return ring(q, k, v)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Mesh, axis: str,
                   causal: bool = False, scale: float | None = None,
                   batch_axes: BatchAxes = None, head_axis: str | None = None,
                   load_balance: bool = True, implementation: str | None = None,
                   efficient_backward: bool = True) -> jax.Array:
  """Attention with the sequence split over ``axis``; equals ``flash_attention(q, k, v)``.

  Args:
    q: ``[B, T, N, H]``; k, v: ``[B, T, K, H]`` (self-attention: same length), natural order.
    mesh: the mesh; ``axis`` is the sequence (context) axis.
    causal: causal self-attention.
    scale: default ``1 / sqrt(H)``.
    batch_axes: mesh axes splitting the batch (e.g. ``("data", "fsdp")``), or None.
    head_axis: mesh axis splitting the heads (tensor parallel), or None.
    load_balance: zig-zag chunks so every device has the same causal work. The inputs are
      permuted to that order and the output back inside this function.
    implementation: passed to ``pallas_attn.flash_attention``.
    efficient_backward: a second turn of the ring in the backward pass that recomputes each
      chunk's attention (``O(T / n)`` memory); False differentiates the forward ring directly
      (keeps every K/V chunk it saw: ``O(T)``).

  Example:
    >>> out = ring_attention(q, k, v, mesh=make_mesh(tensor=8), axis="tensor", causal=True)
  """
  if axis not in mesh.shape:
    raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}")
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [B, T, N|K, H], got {q.shape}, {k.shape}, {v.shape}")
  if k.shape != v.shape or k.shape[1] != q.shape[1]:
    raise ValueError(f"ring attention needs k, v of q's length: q {q.shape}, k {k.shape}, "
                     f"v {v.shape}")
  n = mesh.shape[axis]
  pieces = 2 * n if load_balance else n
  if q.shape[1] % pieces:
    raise ValueError(f"sequence length {q.shape[1]} is not divisible by {pieces} chunks "
                     f"({'2 x ' if load_balance else ''}{axis}={n})")
  if q.shape[0] % axis_size(mesh, batch_axes):
    raise ValueError(f"batch {q.shape[0]} is not divisible by batch_axes {batch_axes!r}")
  if head_axis is not None and k.shape[2] % mesh.shape[head_axis]:
    raise ValueError(f"K/V heads {k.shape[2]} are not divisible by head_axis {head_axis!r} of "
                     f"size {mesh.shape[head_axis]}")
  if load_balance:
    perm = zigzag_permutation(q.shape[1], n)
    q, k, v = (jnp.take(x, perm, axis=1) for x in (q, k, v))
  spec = P(batch_axes, axis, head_axis, None)
  body = functools.partial(_ring, axis=axis, n=n, causal=causal, load_balance=load_balance,
                           scale=scale, implementation=implementation,
                           efficient_backward=efficient_backward)
  out = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)
  if load_balance:
    out = jnp.take(out, np.argsort(perm), axis=1)
  return out

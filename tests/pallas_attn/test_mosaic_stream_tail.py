"""``Config.stream_tail``: the persistent unmasked forward's last partial wave cut along the keys.

Checked here: the deal (every tail tile's key blocks covered once, in key order; the kernel's
traced items agree with the host's table), the merge against attention computed whole (plain
JAX), the kernel in interpret mode against the reference under the ratio rule, bitwise equal to
the whole-tile form outside the tail tiles, the flag's scope, sm90 lowering, and compiled runs.
"""
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness as H
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, default_config, ops, stream_tail
from pallas_attn.mosaic.stream_tail import Tail

PERSISTENT = dict(persistent=True, block_kv=128, backward="mosaic")


@pytest.mark.parametrize("num_tiles,ctas,blocks", [
    (7, 3, 4), (8, 3, 3), (7, 3, 1), (2048, 132, 32), (2048, 132, 16), (2048, 132, 8),
    (1376, 132, 128), (11, 5, 2), (5, 4, 7)])
def test_the_deal_partitions_each_tail_tile(num_tiles, ctas, blocks):
  tail = Tail(num_tiles, ctas, blocks)
  table = stream_tail.part_table(tail)       # asserts the partition itself
  assert len(table) == tail.rest
  per_cta = {}
  for u, parts in enumerate(table):
    for lo, hi, c, p in parts:
      per_cta.setdefault(c, []).append((p, u, lo, hi))
  for c in range(ctas):
    count, item = stream_tail.kernel_items(jnp.int32(c), tail)
    mine = sorted(per_cta.get(c, []))
    assert int(count) == tail.rounds + len(mine)
    assert len(mine) <= stream_tail.MAX_PARTS
    for i in range(tail.rounds):
      flat, lo, hi, part = (int(x) for x in item(jnp.int32(i)))
      assert (flat, lo, hi, part) == (c + i * ctas, 0, blocks, -1)
    for p, u, lo, hi in mine:
      got = tuple(int(x) for x in item(jnp.int32(tail.rounds + p)))
      assert got == (tail.rounds * ctas + u, lo, hi, p)
    # Each CTA's share of the tail differs from any other's by at most one block.
    total = sum(hi - lo for _, _, lo, hi in mine)
    assert abs(total - tail.rest * blocks / ctas) < 1


def _attend(q, k, v):
  s = jnp.einsum("qh,kh->qk", q, k, precision=jax.lax.Precision.HIGHEST)
  lse = jax.nn.logsumexp(s, axis=-1)
  return jnp.exp(s - lse[:, None]) @ v, lse


def test_merge_equals_attention_over_all_keys():
  """Parts over key ranges, each normalised with its own lse, merge to the whole row's O and
  lse (float32 workspace here, so only float32 rounding separates them)."""
  tail = Tail(num_tiles=5, num_ctas=3, blocks=4)      # 1 round, 2 tail tiles of 4 blocks
  rows, hd, block, heads = 8, 16, 6, 1
  keys = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(keys[0], (tail.num_tiles * rows, hd)) * 2
  k = jax.random.normal(keys[1], (tail.blocks * block, hd))
  v = jax.random.normal(keys[2], (tail.blocks * block, hd))
  want, want_lse = _attend(q, k, v)
  o_parts = np.zeros((tail.num_ctas, 2, rows, hd), np.float32)
  lse_parts = np.zeros((tail.num_ctas, 2, rows), np.float32)
  for u, parts in enumerate(stream_tail.part_table(tail)):
    tile = tail.rounds * tail.num_ctas + u
    qt = q[tile * rows:(tile + 1) * rows]
    for lo, hi, c, p in parts:
      o, lse = _attend(qt, k[lo * block:hi * block], v[lo * block:hi * block])
      o_parts[c, p], lse_parts[c, p] = o, lse
  out = jnp.zeros((1, tail.num_tiles * rows, heads, hd)).at[:, :, 0].set(want)
  stale = out.at[:, tail.rounds * tail.num_ctas * rows:].set(7.0)    # tail rows overwritten
  lse_all = want_lse[None, None]
  got, got_lse = stream_tail.merge(stale, lse_all.at[..., -1].set(0.0), jnp.asarray(o_parts),
                                   jnp.asarray(lse_parts), tail=tail, heads=heads,
                                   tile_rows=rows)
  np.testing.assert_allclose(got, out, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(got_lse, lse_all, rtol=2e-5, atol=2e-5)


# Interpret mode runs three CTAs (ops.INTERPRET_CTAS); 128-row tiles, 128-key blocks.
# (T, S, N, K): 7 tiles = 2 rounds + 1 tail tile of 4 blocks (one part a CTA); 8 tiles with 3
# blocks (a CTA with two parts); 7 tiles of one block (two CTAs without a part); GQA 4:2.
SHAPES = [(896, 512, 1, 1), (256, 384, 4, 2), (896, 128, 1, 1)]


def _run(shape, tail: bool, seed: int, grads: bool = False):
  t, s, n, kh = shape
  q, k, v = H.qkv_inputs(1, t, s, n, kh, 64, seed=seed)
  cfg = Config(stream_tail=tail, **PERSISTENT)
  f = lambda q, k, v: flash_attention(q, k, v, implementation="mosaic", config=cfg,
                                      interpret=True, return_lse=True)
  if not grads:
    return f(q, k, v)
  do = jax.random.normal(jax.random.key(seed + 1), q.shape, q.dtype)
  (out, lse), vjp = jax.vjp(f, q, k, v)
  return out, lse, *vjp((do, jnp.zeros_like(lse)))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_same_outside_the_tail_close_inside_in_interpret_mode(shape):
  t, s, n, kh = shape
  out, lse = _run(shape, True, seed=861)
  out0, lse0 = _run(shape, False, seed=861)
  tiles = n * (t // 128)
  tail = Tail(tiles, min(tiles, ops.INTERPRET_CTAS), s // 128)
  assert tail.rest, "the shape must leave a partial wave"
  first = tail.rounds * tail.num_ctas           # flat tiles >= first are cut (tile fastest)
  in_tail = np.zeros((n, t // 128), bool)
  for f in range(first, tiles):
    in_tail[f // (t // 128), f % (t // 128)] = True
  rows = np.repeat(in_tail, 128, axis=1)        # [N, T]
  o, o0 = np.asarray(out, np.float32), np.asarray(out0, np.float32)
  keep = rows.T[None, :, :, None]
  assert np.array_equal(np.where(keep, 0, o), np.where(keep, 0, o0))
  assert np.array_equal(np.where(rows[None], 0, lse), np.where(rows[None], 0, lse0))
  assert np.max(np.abs(o - o0)) <= 8e-3 * np.max(np.abs(o0))
  np.testing.assert_allclose(lse, lse0, rtol=1e-5, atol=1e-5)
  if shape[1] > 128:                            # parts exist: the tail rows really changed path
    assert not np.array_equal(o, o0) or not np.array_equal(np.asarray(lse), np.asarray(lse0))


@pytest.mark.parametrize("case", [
    H.Case(t=256, s=320, n=4, kh=2, h=64, b=1, seed=862),
    H.Case(t=256, s=320, n=2, kh=1, h=128, b=2, seed=863)], ids=lambda c: c.id)
def test_matches_reference_in_interpret_mode(case):
  """8 tiles on 3 CTAs, 5 blocks of 64 keys: two tail tiles cut at blocks 3 and 6 (the middle
  CTA holds the end of one and the start of the other)."""
  cfg = Config(stream_tail=True, **dict(PERSISTENT, block_kv=64))
  H.check_case(case, "mosaic", config=cfg)


def test_deterministic_in_interpret_mode():
  a = _run(SHAPES[1], True, seed=864)
  b = _run(SHAPES[1], True, seed=864)
  for x, y in zip(a, b):
    assert np.array_equal(np.asarray(x), np.asarray(y))


def _statics_of(cfg, *, t=1024, s=1024, n=4, interpret=False, **kw):
  """The forward Statics ops._forward builds (its kernel call intercepted)."""
  seen = {}

  def spy(body, **kwargs):
    seen["st"] = body.keywords["st"]
    raise RuntimeError("stop")
  q = jnp.zeros((1, t, n, 128), jnp.bfloat16)
  k = jnp.zeros((1, s, n, 128), jnp.bfloat16)
  orig, ops.plgpu.kernel = ops.plgpu.kernel, spy
  try:
    with pytest.raises(RuntimeError, match="stop"):
      ops._forward(q, k, k, None, None, None, causal=kw.get("causal", False), scale=0.1,
                   window=None, softcap=None, cfg=cfg, hp=128, interpret=interpret)
  finally:
    ops.plgpu.kernel = orig
  return seen["st"]


def test_the_flag_reaches_only_unmasked_persistent_calls():
  cfg = Config(stream_tail=True, persistent=True)
  st = _statics_of(cfg, t=2048, n=16)           # 256 tiles on 132 SMs (compiled count)
  assert st.persistent and st.stream_tail
  assert not _statics_of(cfg, t=2048, n=16, causal=True).stream_tail
  assert not _statics_of(cfg, t=2000, n=16).stream_tail      # rows off the tile
  assert not _statics_of(cfg, t=2048, s=2000, n=16).stream_tail   # keys padded: masked
  assert not _statics_of(dataclasses.replace(cfg, stream_tail=False), t=2048, n=16).stream_tail


def test_lowers_for_sm90():
  cfg = dataclasses.replace(default_config(head_dim=128, seq_k=4096), stream_tail=True)
  q = jnp.zeros((4, 4096, 16, 128), jnp.bfloat16)
  fwd = lambda q: ops._attention(q, q, q, None, None, None, False, 0.125, None, None, cfg, 128,
                                 False)[0]
  text = jax.jit(fwd).trace(q).lower(lowering_platforms=("cuda",)).as_text()
  assert "flash_attention_fwd" in text
  assert text.count("gather") and text.count("scatter")     # the merge of the tail parts


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    H.Case(t=4096, s=4096, n=4, kh=2, h=128, b=3, seed=865),    # 96 tiles < 132: no tail
    H.Case(t=2048, s=2048, n=16, kh=8, h=128, b=9, seed=866),   # 2304 tiles: 17 rounds + 60
    H.Case(t=1024, s=3072, n=8, kh=8, h=64, b=9, seed=867)], ids=lambda c: c.id)
def test_matches_reference_compiled(case):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  cfg = dataclasses.replace(H.mosaic_default_config(case), persistent=True, consumers=2,
                            stream_tail=True)
  H.check_case(case, "mosaic", config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    # 512 tiles: 3 rounds + 116 (2 batches: the float32 reference's logits stay at 1 GB)
    H.Case(t=4096, s=4096, n=8, kh=8, h=128, b=2, seed=868),
    H.Case(t=4096, s=4096, n=8, kh=4, h=64, b=2, seed=869)], ids=lambda c: c.id)
def test_defaults_compiled(case):
  """The default from 4096 unmasked keys (session 37), run as the library runs it."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  assert H.mosaic_default_config(case).stream_tail
  H.check_case(case, "mosaic")


def test_grid_shapes_of_the_issue_table_have_a_tail():
  """Why the flag exists: 2048 tiles on 132 SMs at every H = 128 row."""
  for (b, t, n), c in itertools.product([(4, 4096, 16), (8, 2048, 16), (2, 8192, 16),
                                          (16, 1024, 16), (1, 16384, 16)], [132]):
    tail = Tail(b * n * t // 128, c, t // 128)
    assert (tail.rounds, tail.rest) == (15, 68)


# ``Config.bwd_stream_tail``: the grid dK/dV kernel runs the whole tiles, a persistent launch the
# tail's parts. Interpret mode: 3 CTAs; 128-key dK/dV tiles, 64-query steps.
BWD = dict(backward="mosaic", bwd_stream_tail=True)


def _grads(cfg, *, t, s, n, kh, h=64, b=1, seed=870):
  q, k, v = H.qkv_inputs(b, t, s, n, kh, h, seed=seed)
  do = jax.random.normal(jax.random.key(seed + 1), q.shape, q.dtype)
  f = lambda q, k, v: flash_attention(q, k, v, implementation="mosaic", config=cfg,
                                      interpret=True)
  out, vjp = jax.vjp(f, q, k, v)
  return [np.asarray(x, np.float32) for x in (out, *vjp(do))]


@pytest.mark.parametrize("t,s,n,kh,b", [(256, 640, 2, 1, 1), (192, 384, 4, 2, 2)])
def test_backward_tail_same_outside_close_inside_in_interpret_mode(t, s, n, kh, b):
  """(1x5 tiles: 1 round + 2 tail tiles of 4 Q blocks x 2 heads; 2x2x3 = 12 tiles: 4 rounds,
  no tail, so equal throughout.) The whole tiles' dK, dV bitwise the grid's; the tail tiles'
  within float32 reordering (then bf16 rounding). dQ may have a tail of its own (its test is
  below): close here."""
  got = _grads(Config(**BWD), t=t, s=s, n=n, kh=kh, b=b)
  want = _grads(Config(backward="mosaic"), t=t, s=s, n=n, kh=kh, b=b)
  tiles = b * kh * (s // 128)
  tail = Tail(tiles, min(tiles, ops.INTERPRET_CTAS), t // 64)
  in_tail = np.zeros((b, s // 128, kh), bool)
  for f in range(tail.rounds * tail.num_ctas, tiles):   # tiles fastest (_decode_tile)
    in_tail[f // (kh * (s // 128)), f % (s // 128), (f // (s // 128)) % kh] = True
  rows = np.repeat(in_tail, 128, axis=1)[..., None]      # [B, S, K, 1]
  for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
    if name == "out":
      assert np.array_equal(a, w), name
      continue
    if name != "dq":
      assert np.array_equal(np.where(rows, 0, a), np.where(rows, 0, w)), name
    assert np.max(np.abs(a - w)) <= 1e-2 * np.max(np.abs(w)), name
  # (Two partials' float32 sum differs from the running sum by ~1e-7: the bf16 gradients may
  # well be bitwise equal, so the tail launch's presence is checked in the traced program.)
  q, k, v = H.qkv_inputs(b, t, s, n, kh, 64, seed=870)
  f = lambda q, k, v: flash_attention(q, k, v, implementation="mosaic", config=Config(**BWD),
                                      interpret=True).astype(jnp.float32).sum()
  traced = str(jax.make_jaxpr(jax.grad(f, argnums=1))(q, k, v))
  assert ("flash_attention_dkdv_tail" in traced) == bool(tail.rest)


@pytest.mark.parametrize("case", [
    # 5 K/V tiles of 128 keys on 3 CTAs: 2 dK/dV tail tiles of 2 Q blocks x 2 heads (GQA 2:1)
    H.Case(t=128, s=640, n=2, kh=1, h=64, b=1, seed=871),
    # 5 Q tiles of 128 rows on 3 CTAs: 2 dQ tail tiles of 2 K/V blocks
    H.Case(t=640, s=128, n=1, kh=1, h=64, b=1, seed=876)], ids=lambda c: c.id)
def test_backward_tail_matches_reference_in_interpret_mode(case):
  """Against the reference under the ratio rule."""
  H.check_case(case, "mosaic", config=Config(**BWD))


def test_backward_tail_deterministic_in_interpret_mode():
  a = _grads(Config(**BWD), t=256, s=640, n=2, kh=1, seed=872)
  b = _grads(Config(**BWD), t=256, s=640, n=2, kh=1, seed=872)
  for x, y in zip(a, b):
    assert np.array_equal(x, y)


def test_backward_tail_lowers_for_sm90():
  cfg = dataclasses.replace(default_config(head_dim=128, seq_k=4096), bwd_stream_tail=True)
  q = jnp.zeros((4, 4096, 16, 128), jnp.bfloat16)

  def loss(q, k, v):
    out, _ = ops._attention(q, k, v, None, None, None, False, 0.125, None, None, cfg, 128, False)
    return jnp.sum(out.astype(jnp.float32))
  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "flash_attention_dkdv_tail" in text and "flash_attention_dq_tail" in text


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    H.Case(t=2048, s=2048, n=16, kh=8, h=128, b=9, seed=873),   # 1152 tiles: 8 rounds + 96
    H.Case(t=1000, s=1536, n=4, kh=2, h=128, b=11, seed=874),   # T off the tile
    H.Case(t=2048, s=4096, n=8, kh=8, h=64, b=3, seed=875)], ids=lambda c: c.id)
def test_backward_tail_matches_reference_compiled(case):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  cfg = dataclasses.replace(H.mosaic_default_config(case), bwd_stream_tail=True,
                            bwd_persistent=False)
  H.check_case(case, "mosaic", config=cfg)


@pytest.mark.parametrize("t,s,n,kh", [(640, 256, 1, 1), (640, 384, 2, 1)])
def test_dq_tail_same_outside_close_inside_in_interpret_mode(t, s, n, kh):
  """dQ tiles of 128 rows: 5 (or 2 x 5) on 3 CTAs, 2 (or 1) tail tiles cut over 4 (6) K/V
  blocks of 64 keys (S a multiple of the dK/dV kernel's 128-key tile: unmasked). dQ of the whole tiles bitwise the grid's, the tail tiles' within float32
  reordering; out, dK, dV unchanged (the L2 / D records of the tail tiles come from the tail
  launch: the same values)."""
  cfg = dict(bwd_block_kv=64)
  got = _grads(Config(**BWD, **cfg), t=t, s=s, n=n, kh=kh)
  want = _grads(Config(backward="mosaic", **cfg), t=t, s=s, n=n, kh=kh)
  tiles = n * (t // 128)
  tail = Tail(tiles, min(tiles, ops.INTERPRET_CTAS), s // 64)
  in_tail = np.zeros((t // 128, n), bool)
  for f in range(tail.rounds * tail.num_ctas, tiles):   # tiles fastest (_decode_tile)
    in_tail[f % (t // 128), (f // (t // 128)) % n] = True
  rows = np.repeat(in_tail, 128, axis=0)[None, :, :, None]     # [1, T, N, 1]
  for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
    if name != "dq":
      assert np.array_equal(a, w), name
      continue
    assert np.array_equal(np.where(rows, 0, a), np.where(rows, 0, w)), name
    assert np.max(np.abs(a - w)) <= 1e-2 * np.max(np.abs(w)), name
  q, k, v = H.qkv_inputs(1, t, s, n, kh, 64, seed=870)
  f = lambda q, k, v: flash_attention(q, k, v, implementation="mosaic",
                                      config=Config(**BWD, **cfg),
                                      interpret=True).astype(jnp.float32).sum()
  assert "flash_attention_dq_tail" in str(jax.make_jaxpr(jax.grad(f))(q, k, v))

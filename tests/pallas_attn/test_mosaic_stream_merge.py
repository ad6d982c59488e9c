"""The forward's tail merge as one Pallas (Triton) kernel (``Config.stream_tail_merge``,
``pallas_attn/mosaic/stream_merge.py``) against the XLA merge it replaces."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import mesh as mesh_lib

import harness as H
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, default_config, ops, stream_merge, stream_tail
from pallas_attn.mosaic.stream_tail import Tail

PERSISTENT = dict(persistent=True, block_kv=128, backward="mosaic", stream_tail=True)


def _workspace(tail: Tail, *, rows: int, hd: int, heads: int, batch: int, seed: int,
               empty_row: bool = False):
  """Random out / lse and a workspace of parts (bf16 O, float32 lse with a wide spread)."""
  t = tail.num_tiles * rows // (heads * batch)
  keys = jax.random.split(jax.random.key(seed), 4)
  out = jax.random.normal(keys[0], (batch, t, heads, hd)).astype(jnp.bfloat16)
  lse = jax.random.normal(keys[1], (batch, heads, t))
  o_parts = jax.random.normal(keys[2], (tail.num_ctas, 2, rows, hd)).astype(jnp.bfloat16)
  lse_parts = jax.random.normal(keys[3], (tail.num_ctas, 2, rows)) * 6
  if empty_row:                   # a row no key reached in any part (every lse_p = -inf)
    lse_parts = lse_parts.at[:, :, 1].set(-jnp.inf)
  return out, lse, o_parts, lse_parts


@pytest.mark.parametrize("num_tiles,ctas,blocks,rows,hd,heads,batch", [
    (5, 3, 4, 8, 16, 1, 1),        # one tail tile in two parts
    (12, 5, 7, 16, 32, 3, 1),      # two tail tiles, a CTA with two parts
    (22, 6, 3, 8, 16, 2, 1),       # tiles of 3 blocks: up to three parts a tile
    (24, 7, 5, 8, 16, 3, 2)])      # tail tiles in the second batch
def test_bitwise_the_xla_merge_in_interpret_mode(num_tiles, ctas, blocks, rows, hd, heads,
                                                  batch):
  tail = Tail(num_tiles, ctas, blocks)
  args = _workspace(tail, rows=rows, hd=hd, heads=heads, batch=batch, seed=num_tiles,
                    empty_row=num_tiles == 12)
  want = stream_tail.merge(*args, tail=tail, heads=heads, tile_rows=rows)
  got = stream_merge.merge(*args, tail=tail, heads=heads, tile_rows=rows, interpret=True)
  for w, g in zip(want, got):
    assert w.dtype == g.dtype and w.shape == g.shape
    assert np.array_equal(np.asarray(w, np.float32), np.asarray(g, np.float32))
  out, lse = got
  first = tail.rounds * tail.num_ctas * rows // (heads * batch)
  if batch == 1 and heads == 1:     # rows before the tail are the input's, untouched
    assert np.array_equal(np.asarray(out[:, :first]), np.asarray(args[0][:, :first]))
  if num_tiles == 12:               # the row no part saw: O = 0, lse = -inf
    tail_tile0 = tail.rounds * tail.num_ctas
    row = (tail_tile0 % (num_tiles // heads)) * rows + 1
    head = tail_tile0 // (num_tiles // heads)
    assert np.all(np.asarray(out[0, row, head], np.float32) == 0)
    assert lse[0, head, row] == -jnp.inf


def test_slot_table_is_padded_to_a_power_of_two():
  slots = stream_merge._part_slots(Tail(22, 6, 3))
  assert slots.shape[1] in (2, 4) and slots.shape[0] == Tail(22, 6, 3).rest
  for u, parts in enumerate(stream_tail.part_table(Tail(22, 6, 3))):
    assert list(slots[u, :len(parts)]) == [c * 2 + p for _, _, c, p in parts]
    assert np.all(slots[u, len(parts):] == -1)


def test_rejects_blocks_triton_cannot_take():
  tail = Tail(5, 3, 4)
  out, lse, o_parts, lse_parts = _workspace(tail, rows=8, hd=16, heads=1, batch=1, seed=1)
  with pytest.raises(NotImplementedError, match="power of two"):
    stream_merge.merge(out[..., :12], lse, o_parts[..., :12], lse_parts, tail=tail, heads=1,
                       tile_rows=8, interpret=True)
  with pytest.raises(ValueError, match="heads=2"):
    stream_merge.merge(out, lse, o_parts, lse_parts, tail=tail, heads=2, tile_rows=8,
                       interpret=True)


def test_config_names_the_merge():
  assert Config().stream_tail_merge == "xla"
  with pytest.raises(ValueError, match="stream_tail_merge"):
    Config(stream_tail_merge="triton")


@pytest.mark.parametrize("shape", [(256, 384, 4, 2), (896, 512, 1, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_attention_bitwise_the_xla_merge_in_interpret_mode(shape):
  """Interpret mode runs three CTAs: (256, 384, 4, 2) has 8 tiles = 2 rounds + 2 tail tiles
  of 3 blocks (a CTA with two parts); (896, 512, 1, 1) 7 tiles = 2 rounds + 1 in 4 blocks."""
  t, s, n, kh = shape
  q, k, v = H.qkv_inputs(1, t, s, n, kh, 64, seed=871)
  outs = []
  for merge in ("xla", "pallas"):
    cfg = Config(stream_tail_merge=merge, **PERSISTENT)
    outs.append(flash_attention(q, k, v, implementation="mosaic", config=cfg, interpret=True,
                                return_lse=True))
  for a, b in zip(*outs):
    assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_inside_shard_map_the_xla_merge_serves():
  """The kernel's workspace gather trips the vma check in interpret mode inside shard_map, so
  there the XLA merge runs (``stream_merge.merge_parts``): same results, no error."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  spec = jax.sharding.PartitionSpec(None, None, "x")
  q, k, v = H.qkv_inputs(1, 896, 512, 2, 2, 64, seed=874)
  outs = []
  for merge in ("xla", "pallas"):
    cfg = Config(stream_tail_merge=merge, **PERSISTENT)
    f = jax.shard_map(lambda q, k, v, cfg=cfg: flash_attention(
        q, k, v, implementation="mosaic", config=cfg, interpret=True),
        mesh=mesh, in_specs=spec, out_specs=spec)
    outs.append(np.asarray(jax.jit(f)(q, k, v), np.float32))
  assert np.array_equal(*outs)


def test_lowers_for_sm90():
  cfg = dataclasses.replace(default_config(head_dim=128, seq_k=4096), stream_tail=True,
                            stream_tail_merge="pallas")
  q = jnp.zeros((4, 4096, 16, 128), jnp.bfloat16)
  fwd = lambda q: ops._attention(q, q, q, None, None, None, False, 0.125, None, None, cfg, 128,
                                 False)[0]
  dev = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=dev)):
    text = jax.jit(fwd).trace(q).lower(lowering_platforms=("cuda",)).as_text()
  assert "flash_attention_fwd" in text and "flash_attention_tail_merge" in text
  assert "scatter" not in text                 # the XLA merge is gone


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    H.Case(t=2048, s=2048, n=16, kh=8, h=128, b=9, seed=872),   # 2304 tiles: 17 rounds + 60
    H.Case(t=4096, s=4096, n=8, kh=4, h=64, b=2, seed=873)], ids=lambda c: c.id)
def test_compiled_matches_reference_and_the_xla_merge(case):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  base = dataclasses.replace(H.mosaic_default_config(case), persistent=True, consumers=2,
                             stream_tail=True)
  cfg = dataclasses.replace(base, stream_tail_merge="pallas")
  H.check_case(case, "mosaic", config=cfg)
  q, k, v = H.qkv_inputs(case.b, case.t, case.s, case.n, case.kh, case.h, seed=case.seed)
  run = lambda c: flash_attention(q, k, v, implementation="mosaic", config=c, return_lse=True)
  for a, b in zip(run(base), run(cfg)):
    assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

"""mosaic.autotune: search, JSON cache, lookup (interpret mode, tiny problem, injected timer)."""
import json

import jax.numpy as jnp
import pytest

import harness as H
from pallas_attn.mosaic import Config, autotune, default_config

SPACE = (Config(block_q=64, block_kv=64, num_stages=2), Config(block_q=64, block_kv=128,
                                                               num_stages=2))


def test_tune_picks_fastest_and_lookup_reads_it(tmp_path):
  path = str(tmp_path / "tune.json")
  calls = []

  def timer(fn, iterations):
    out = fn()                                        # really runs the kernel (interpret mode)
    assert out.shape == (1, 64, 2, 64) and bool(jnp.all(jnp.isfinite(out)))
    calls.append(iterations)
    return 2.0 if len(calls) == 1 else 1.0           # the second config is "faster"

  best = autotune.tune(batch=1, seq_q=64, seq_k=100, heads=2, kv_heads=1, head_dim=64,
                       causal=True, space=SPACE, iterations=3, path=path, interpret=True,
                       timer=timer)
  assert best == SPACE[1] and calls == [3, 3]
  with open(path) as f:
    cache = json.load(f)
  key = autotune.problem_key(head_dim=64, seq_k=100, causal=True, dtype=jnp.bfloat16)
  assert key == "h64-s128-causal-bfloat16" and cache[key]["ms"] == 1.0
  # Same bucket (S in (64, 128]) and class: found; other classes: not.
  assert autotune.lookup(head_dim=50, seq_k=128, causal=True, dtype=jnp.bfloat16,
                         path=path) == SPACE[1]
  assert autotune.lookup(head_dim=64, seq_k=100, causal=False, dtype=jnp.bfloat16,
                         path=path) is None
  assert autotune.lookup(head_dim=64, seq_k=100, causal=True, dtype=jnp.bfloat16,
                         path=str(tmp_path / "missing.json")) is None


def test_tune_skips_failing_configs_and_errors_when_none_run(tmp_path):
  def timer(fn, iterations):
    raise RuntimeError("does not compile")

  with pytest.raises(ValueError, match="no Config"):
    autotune.tune(batch=1, seq_q=64, seq_k=64, heads=2, kv_heads=1, head_dim=64, space=SPACE,
                  path=str(tmp_path / "t.json"), interpret=True, timer=timer)


@pytest.mark.parametrize("name", ["batch", "seq_q", "head_dim", "iterations"])
def test_tune_rejects_non_positive_sizes(name, tmp_path):
  kw = dict(batch=1, seq_q=64, seq_k=64, heads=2, kv_heads=1, head_dim=64, iterations=2)
  kw[name] = 0
  with pytest.raises(ValueError, match=name):
    autotune.tune(**kw, path=str(tmp_path / "t.json"), interpret=True)


def test_corrupt_cache_is_ignored(tmp_path):
  path = tmp_path / "bad.json"
  path.write_text("{not json")
  assert autotune.lookup(head_dim=64, seq_k=64, causal=False, dtype=jnp.bfloat16,
                         path=str(path)) is None


@pytest.mark.parametrize("causal", [False, True])
def test_search_space_keeps_the_default_flags(causal):
  """Only tiles, ring depth and the launch style vary; the backward and the forward flags stay
  at default_config's values (a cached winner must not switch the backward or a forward flag)."""
  from pallas_attn.mosaic import default_config
  base = default_config(head_dim=128, seq_k=4096, masked=causal)
  space = autotune.search_space(head_dim=128, seq_k=4096, causal=causal)
  # 2 block_q x (64, 128, 256 keys, and FA3's 176 unmasked) x 2 ring depths x 2 launches,
  # then three consumers: (64, 128 keys) x 2 ring depths on the grid
  assert len(space) == len(set(space)) == (28 if causal else 36) and base in space
  varied = {"block_q", "block_kv", "num_stages", "persistent", "consumers"}
  for cfg in space:
    for field in Config.__dataclass_fields__:
      if field not in varied:
        assert getattr(cfg, field) == getattr(base, field), field


def test_search_space_holds_the_three_consumer_default():
  """Long unmasked H = 128 rows default to three consumers (session 27): the space holds that
  default, tries two consumers there too, and gives three only to H = 128."""
  base = default_config(head_dim=128, seq_k=16384, masked=False)
  space = autotune.search_space(head_dim=128, seq_k=16384, causal=False)
  assert base.consumers == 3 and base in space
  assert {cfg.consumers for cfg in space} == {2, 3}
  assert all(cfg.block_q == 64 and not cfg.persistent for cfg in space if cfg.consumers == 3)
  for h in (64, 256):
    assert {cfg.consumers for cfg in autotune.search_space(head_dim=h, seq_k=16384,
                                                           causal=False)} == {2}


def test_search_space_tries_the_persistent_launch_where_it_is_a_default():
  for h, expect in ((64, {False, True}), (128, {False, True}), (256, {False})):
    space = autotune.search_space(head_dim=h, seq_k=4096, causal=False)
    assert {cfg.persistent for cfg in space} == expect, h


def test_search_space_adds_fa3s_key_block():
  """FlashAttention-3's key block for the head dim (80 at 256, 176 at 128 unmasked, 192 at 64)
  joins the 64 / 128 / 256 blocks."""
  for h, causal, extra in ((64, False, {192}), (128, False, {176}), (128, True, set()),
                           (256, True, {80})):
    space = autotune.search_space(head_dim=h, seq_k=4096, causal=causal)
    assert {cfg.block_kv for cfg in space} == {64, 128, 256} | extra, (h, causal)


def test_search_space_holds_the_masked_head_dim_64_default():
  """Masked H = 64 with 1025-4096 keys runs persistent by default: the space must contain it."""
  base = default_config(head_dim=64, seq_k=4096, masked=True)
  space = autotune.search_space(head_dim=64, seq_k=4096, causal=True)
  assert base.persistent and base in space


def test_cached_winner_keeps_todays_backward(tmp_path, monkeypatch):
  """A winner cached before the backward defaults moved gives ops its forward fields only."""
  import dataclasses  # pylint: disable=import-outside-toplevel
  stale = Config(block_q=64, block_kv=64, num_stages=3, backward="triton", bwd_registers=224)
  path = tmp_path / "tune.json"
  key = autotune.problem_key(head_dim=64, seq_k=4096, causal=False, dtype=jnp.bfloat16)
  path.write_text(json.dumps({key: {"config": dataclasses.asdict(stale), "ms": 1.0}}))
  monkeypatch.setenv(autotune.ENV_VAR, str(path))
  choose = H.chosen_config(monkeypatch)
  q = jnp.zeros((1, 4096, 2, 64), jnp.bfloat16)
  got = choose(q)
  want = default_config(head_dim=64, seq_k=4096)
  assert (got.block_kv, got.num_stages) == (64, 3)                        # the tuned forward
  assert all(getattr(got, f) == getattr(want, f) for f in autotune.backward_fields())
  assert got.backward == "mosaic" and got.bwd_dkdv_block_q == 128
  # The call's own masks choose the backward too: segment ids take the 240-register pair.
  seg = jnp.zeros((1, 4096), jnp.int32)
  segmented = choose(q, q_segment_ids=seg, kv_segment_ids=seg)
  assert (segmented.bwd_registers, want.bwd_registers) == (240, 232)
  assert segmented.block_kv == 64
  # A window was never tuned: the heuristic whole, not the unmasked class's winner.
  assert choose(q, window=(256, 0)) == default_config(head_dim=64, seq_k=4096, masked=True, windowed=True)

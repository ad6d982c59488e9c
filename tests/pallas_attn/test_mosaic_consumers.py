"""Mosaic GPU forward with three consumer warpgroups (``Config.consumers=3``: 192-row tiles).

Interpret mode checks the arithmetic and the 192-row tiling (padding of T, the per-tile block
ranges, masks); the compiled form (named-barrier ring of three, the 160/32 register split) is
lowered for sm90 on CPU.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

import harness as H
from pallas_attn import flash_attention, reference
from pallas_attn.mosaic import Config, default_config, kernels


def _inputs(b, t, s, n, kh, h, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, kh, h), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, kh, h), jnp.bfloat16)
  return q, k, v


def _rel_err(out, ref):
  return float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))


def test_config_takes_two_or_three_consumers():
  assert Config().consumers == 2
  assert Config(consumers=3).consumers == 3
  with pytest.raises(ValueError, match="consumers"):
    Config(consumers=4)


def test_barrier_ids_stay_clear_of_mosaic_and_each_other():
  """Mosaic GPU keeps hardware barriers 0 .. warpgroups; the ping-pong ring takes one per
  consumer after those, named_free's slots follow (16 in all)."""
  for nc in (2, 3):
    sched, free = kernels.schedule_bar(nc), kernels.free_bar(nc)
    assert sched > nc + 1                      # warpgroups = nc + 1 (the producer)
    assert free >= sched + nc
    assert free + 2 * 4 <= 16                  # two rings of at most 4 slots
  assert (kernels.schedule_bar(2), kernels.free_bar(2)) == (4, 6)    # unchanged for two
  for nc, (c, p) in kernels.FWD_REGISTERS.items():
    launch = 65536 // ((nc + 1) * kernels.WG_THREADS) // 8 * 8
    assert nc * c + p <= (nc + 1) * launch and c % 8 == 0 and p % 8 == 0


# (b, t, s, n, kh, h, kw). The interpreter's cost grows with batch x heads x tiles: one batch row
# where no mask differs between rows, two (the per-row masks) with kv_lengths and segments.
@pytest.mark.parametrize("b,t,s,n,kh,h,kw", [
    (1, 200, 260, 2, 1, 64, dict()),                            # T not a multiple of 192
    (1, 384, 384, 2, 2, 64, dict(causal=True)),
    (1, 250, 300, 4, 2, 64, dict(window=(60, 10), softcap=20.0)),
    (2, 193, 193, 2, 1, 128, dict(causal=True, kv_lengths=True)),
    (2, 260, 250, 2, 2, 64, dict(segments=True)),
], ids=["full", "causal", "window_softcap_gqa", "causal_kvlen_h128", "segments"])
def test_three_consumers_match_reference_in_interpret_mode(b, t, s, n, kh, h, kw):
  q, k, v = _inputs(b, t, s, n, kh, h)
  kw = H.flag_kwargs(kw, t=t, s=s)
  cfg = Config(block_kv=64, consumers=3)
  out = flash_attention(q, k, v, implementation="mosaic", config=cfg, interpret=True, **kw)
  ref_kw = {key: val for key, val in kw.items()}
  ref = reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                            precision=jax.lax.Precision.HIGHEST, **ref_kw)
  assert _rel_err(out, ref) < 1e-2
  two = flash_attention(q, k, v, implementation="mosaic", config=Config(block_kv=64),
                        interpret=True, **kw)
  # Same blocks, same order within each row: the two- and three-consumer forwards agree to
  # the rounding of the final bf16 cast.
  assert _rel_err(out, two.astype(jnp.float32)) < 1e-2


def test_three_consumer_forward_feeds_the_backward_in_interpret_mode():
  """The forward's O and lse (192-row tiles) are the backward's residuals."""
  q, k, v = _inputs(1, 200, 200, 2, 1, 64, seed=1)

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * jnp.linspace(-1, 1, 64))
  ours = functools.partial(flash_attention, implementation="mosaic", causal=True,
                           config=Config(block_kv=64, consumers=3), interpret=True)
  ref = lambda q, k, v: reference.attention(q, k, v, causal=True,
                                            precision=jax.lax.Precision.HIGHEST)
  g = jax.grad(functools.partial(loss, ours), argnums=(0, 1, 2))(q, k, v)
  g_ref = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(
      *(x.astype(jnp.float32) for x in (q, k, v)))
  for a, r in zip(g, g_ref):
    assert _rel_err(a, r) < 2e-2


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_three_consumers_lower_for_sm90(causal):
  """Compiled form: four warpgroups, the 160 / 32 register split and a ping-pong ring on three
  named barriers of two warpgroups' threads each."""
  cfg = dataclasses.replace(default_config(head_dim=64, seq_k=1024, masked=causal), block_kv=128,
                            consumers=3)
  text = H.lower_mosaic_forward(cfg, causal=causal)
  assert "flash_attention_fwd" in text
  assert "bar.sync $0, 256" in text and "bar.arrive $0, 256" in text
  assert "setmaxnreg.inc.sync.aligned.u32 160;" in text
  assert "setmaxnreg.dec.sync.aligned.u32 32;" in text


# The default at H = 128 from 16384 unmasked keys (sessions 26-27): three consumers, the grid.
LONG_ROWS = [
    H.Case(t=1000, s=16384, n=4, kh=2, h=128, seed=401),
    H.Case(t=700, s=16500, n=2, kh=1, h=128, kv_lengths=(16500, 9000), seed=402),
    H.Case(t=600, s=16384, n=2, kh=2, h=128, segments=3, seed=403),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", LONG_ROWS, ids=lambda c: c.id)
def test_three_consumer_default_rows_compiled(case):
  """Compiled: the long-row default (three consumers) passes the ratio rule, forward and
  backward, with GQA, kv_lengths and segment ids."""
  cfg = default_config(head_dim=case.h, seq_k=case.s, masked=False)
  assert cfg.consumers == 3 and not cfg.persistent
  H.check_case(case, "mosaic", config=cfg)

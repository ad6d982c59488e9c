"""FA4's conditional rescaling in the Mosaic forward (``Config.lazy_rescale``).

The online softmax keeps a row's stale max until some row of the warpgroup grows by more than
tau (log2 units); O and l then accumulate P = 2^(c s - m_stale) <= 2^tau. The maths is checked
on ``kernels._exp_block_lazy`` in plain JAX (both branches, empty rows, a blockwise loop
against the exact softmax), the kernel in interpret mode against the float32 reference (inputs
whose max grows past tau on every block, and inputs where it almost never does), and the
compiled form by its sm90 lowering.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import mesh as mesh_lib

import harness as H
from pallas_attn import flash_attention, reference
from pallas_attn.mosaic import Config, kernels, ops

NEG = -jnp.inf


def test_exp_block_lazy_branches():
  """No row grew by more than tau: every row keeps its max (alpha exactly 1, P up to 2^tau);
  one row did: every row takes its new max; a first visible key counts as +inf growth; rows
  with no key keep -inf and P = 0."""
  s = jnp.array([[5.0, 1.0], [3.0, 2.0]])
  p, alpha, m, rescale = kernels._exp_block_lazy(s, jnp.array([0.0, 0.0]), None, 8.0)
  assert not bool(rescale)
  np.testing.assert_array_equal(alpha, [1.0, 1.0])
  np.testing.assert_array_equal(m, [0.0, 0.0])
  np.testing.assert_allclose(p, 2.0 ** s)
  p, alpha, m, rescale = kernels._exp_block_lazy(s.at[0, 0].set(10.0), jnp.array([0.0, 0.0]),
                                                 None, 8.0)
  assert bool(rescale)
  np.testing.assert_array_equal(m, [10.0, 3.0])
  np.testing.assert_allclose(alpha, [2.0 ** -10, 2.0 ** -3])
  p, alpha, m, rescale = kernels._exp_block_lazy(jnp.array([[1.0, 0.0], [NEG, NEG]]),
                                                 jnp.array([NEG, NEG]), None, 8.0)
  assert bool(rescale)                                       # row 0's first key
  np.testing.assert_array_equal(m, [1.0, NEG])
  np.testing.assert_array_equal(p[1], [0.0, 0.0])
  p, alpha, m, rescale = kernels._exp_block_lazy(jnp.full((2, 2), NEG), jnp.array([0.0, NEG]),
                                                 None, 8.0)
  assert not bool(rescale)
  np.testing.assert_array_equal(m, [0.0, NEG])
  np.testing.assert_array_equal(p, jnp.zeros((2, 2)))


@pytest.mark.parametrize("ramp", [0.0, 1.0], ids=["flat", "growing"])
def test_blockwise_loop_is_the_softmax(ramp):
  """The online softmax with lazy maxima over 16-key blocks: O / l and lse = m + log2 l equal
  the exact softmax (base 2) of the whole row, with maxima that grow slowly or every block."""
  rng = np.random.default_rng(0)
  s = rng.normal(size=(8, 128)) * 3 + ramp * np.arange(128)[None]
  v = rng.normal(size=(128, 4))
  m, l, o = jnp.full((8,), NEG), jnp.zeros((8,)), jnp.zeros((8, 4))
  rescales = 0
  for j in range(0, 128, 16):
    p, alpha, m, rescale = kernels._exp_block_lazy(jnp.asarray(s[:, j:j + 16]), m, None, 8.0)
    rescales += int(rescale)
    l = l * alpha + p.sum(axis=1)
    o = o * alpha[:, None] + p @ v[j:j + 16]
  w = 2.0 ** (s - s.max(axis=1, keepdims=True))
  np.testing.assert_allclose(o / l[:, None], (w @ v) / w.sum(axis=1, keepdims=True), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(m + jnp.log2(l), np.log2((2.0 ** s).sum(axis=1)), rtol=1e-6)
  # The first block always rescales; a ramp of 16 per block grows every row past tau = 8.
  assert rescales == 8 if ramp else rescales <= 2


def test_config_rejects_bad_thresholds():
  for bad in (-1.0, 101.0):
    with pytest.raises(ValueError, match="lazy_rescale"):
      Config(lazy_rescale=bad)
  with pytest.raises(ValueError, match="lazy_rescale"):
    Config(lazy_rescale=8.0, sum_in_pv=True)


@pytest.mark.parametrize("h,ramp,kw", [(64, 0.0, dict(causal=True, kv_lengths=True)),
                                       (64, 0.09, dict(window=(40, 5), segments=True)),
                                       (256, 0.4, dict())],
                         ids=["h64_flat_causal_len", "h64_mixed_window_seg", "h256_growing"])
def test_lazy_forward_matches_reference_in_interpret_mode(h, ramp, kw):
  """Forward (out, lse) and gradients (the backward reads the forward's lse) against the
  float32 reference. ``ramp`` adds a logit that grows along the keys (q[..., 0] * k[..., 0] =
  ramp * key index, natural units): 0 (maxima settle after the first block: stale steps),
  0.09 (~9 log2 units a 64-key block: some steps rescale, some keep), 0.4 (~37 a block: every
  step rescales, so the output is bitwise the plain kernel's). dq's channel 0 is left out of
  the comparison: it is scale * sum_j dS_ij k_j0 with |k_j0| up to ramp * S, a cancellation
  that amplifies any kernel's rounding (the plain kernel misses it by the same amount)."""
  # S = 320: five whole 64-key blocks, so that with ramp 0.4 every block grows every row's max
  # past tau (a ragged last block of 10 keys would grow it by only ~6 log2 units).
  b, t, s, n, kh = (2 if kw.get("kv_lengths") else 1), 150, 320, 4, 2
  keys = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.float32)
  k = jax.random.normal(keys[1], (b, s, kh, h), jnp.float32)
  v = jax.random.normal(keys[2], (b, s, kh, h), jnp.bfloat16)
  do = jax.random.normal(keys[3], (b, t, n, h), jnp.bfloat16)
  q = q.at[..., 0].set(h ** 0.5)
  k = k.at[..., 0].set(ramp * jnp.arange(s)[None, :, None])
  q, k = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
  extra = {x: kw[x] for x in ("causal", "window") if x in kw}
  if kw.get("segments"):
    extra["q_segment_ids"] = (jnp.arange(t)[None] * 2 // t).repeat(b, 0)
    extra["kv_segment_ids"] = (jnp.arange(s)[None] * 2 // s).repeat(b, 0)
  if kw.get("kv_lengths"):
    extra["kv_lengths"] = jnp.array([s, 201], jnp.int32)

  def run(fn, *args):
    (out, lse), vjp = jax.vjp(fn, *args)
    return (out, lse, *vjp((do.astype(out.dtype), jnp.zeros_like(lse))))

  def mosaic(tau):
    cfg = Config(block_kv=64, lazy_rescale=tau)
    return run(lambda q, k, v: flash_attention(q, k, v, implementation="mosaic", config=cfg,
                                               interpret=True, return_lse=True, **extra), q, k, v)
  got = mosaic(8.0)
  want = run(lambda q, k, v: reference.attention(q, k, v, precision=jax.lax.Precision.HIGHEST,
                                                 return_lse=True, **extra),
             *(x.astype(jnp.float32) for x in (q, k, v)))
  for name, x, r in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    x, r = np.asarray(x, np.float32), np.asarray(r, np.float32)
    if name == "dq":
      x, r = x[..., 1:], r[..., 1:]
    fin = np.isfinite(r)
    np.testing.assert_array_equal(np.isfinite(x), fin, err_msg=name)
    err = np.abs(x[fin] - r[fin]).max() / max(1.0, np.abs(r[fin]).max())
    assert err < 2e-2, (name, err)
  if ramp >= 0.4:
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, mosaic(0.0)):
      np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                    err_msg=name)


def test_lazy_forward_lowers_for_sm90():
  """The compiled form (the warpgroup-wide max, the branch around O's rescale) lowers, with and
  without pinned softmax, at H = 256 and H = 128 persistent."""
  dev = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  for cfg, h, causal in [(Config(block_kv=64, lazy_rescale=8.0), 256, False),
                         (Config(block_kv=64, lazy_rescale=8.0, pin_softmax=True,
                                 named_free=True), 256, True),
                         (Config(lazy_rescale=8.0, persistent=True), 128, False)]:
    q = jnp.zeros((2, 700, 4, h), jnp.bfloat16)

    def fwd(q, k, v, cfg=cfg, h=h, causal=causal):
      out, _ = ops._attention(q, k, v, None, None, None, causal, h ** -0.5, None, None, cfg, h,
                              False)
      return out
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=dev)):
      text = jax.jit(fwd).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
    assert "flash_attention_fwd" in text


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    H.Case(t=1000, s=1100, h=256, n=4, kh=2, causal=True, seed=501),
    H.Case(t=600, s=900, h=128, n=4, kh=2, window=(100, 20), softcap=30.0, segments=2,
           kv_lengths=(900, 555), seed=502),
], ids=lambda c: c.id)
def test_lazy_forward_compiled(case):
  """Compiled on the GPU: the ratio rule (TESTING.md) with lazy rescaling on."""
  H.check_mosaic_default_with(case, lazy_rescale=8.0)

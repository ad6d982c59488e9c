"""Ring attention equals unsharded attention (forward and gradients)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn
import parallel
from parallel.context import merge_partials, ring_attention, zigzag_permutation
from parallel_helpers import FAST_COMPILE

CAP_F32 = 2e-5   # TESTING.md cap for float32: max|kernel - ref_hi| <= CAP * max(1, max|ref_hi|)


def qkv(b=2, t=32, n=4, kv=2, h=8, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (b, t, n, h))
  k = jax.random.normal(ks[1], (b, t, kv, h))
  v = jax.random.normal(ks[2], (b, t, kv, h))
  return q, k, v, jax.random.normal(ks[3], q.shape)


def within_rule(actual, ref_hi, what):
  actual, ref_hi = np.asarray(actual), np.asarray(ref_hi)
  assert np.array_equal(np.isfinite(actual), np.isfinite(ref_hi)), f"{what}: finite pattern"
  err = np.abs(actual - ref_hi).max()
  assert err <= CAP_F32 * max(1.0, np.abs(ref_hi).max()), f"{what}: max err {err}"


CASES = [
    ("zigzag-causal", dict(data=2, fsdp=2, tensor=2), "tensor", "data", None, True, True, True),
    ("contiguous-causal", dict(tensor=8), "tensor", None, None, True, False, True),
    ("zigzag-full", dict(tensor=8), "tensor", None, None, False, True, True),
    ("seq-on-fsdp+heads-on-tensor", dict(fsdp=4, tensor=2), "fsdp", None, "tensor", True, True,
     True),
    ("autodiff-backward", dict(data=2, tensor=4), "tensor", "data", None, True, True, False),
]


@pytest.mark.parametrize("name,mesh_kw,axis,batch_axes,head_axis,causal,balance,efficient", CASES,
                         ids=[c[0] for c in CASES])
def test_ring_attention_matches_unsharded(name, mesh_kw, axis, batch_axes, head_axis, causal,
                                          balance, efficient):
  mesh = parallel.make_mesh(**mesh_kw)
  q, k, v, ct = qkv()
  ring = functools.partial(ring_attention, mesh=mesh, axis=axis, causal=causal,
                           batch_axes=batch_axes, head_axis=head_axis, load_balance=balance,
                           implementation="xla", efficient_backward=efficient)
  with jax.default_matmul_precision("highest"):
    ref = functools.partial(pallas_attn.reference.attention, causal=causal)
    ref_out = ref(q, k, v)
    ref_grads = jax.grad(lambda *a: (ref(*a) * ct).sum(), argnums=(0, 1, 2))(q, k, v)
  fwd = jax.jit(ring, compiler_options=FAST_COMPILE)
  out = fwd(q, k, v)
  grads = jax.jit(jax.grad(lambda *a: (ring(*a) * ct).sum(), argnums=(0, 1, 2)),
                  compiler_options=FAST_COMPILE)(q, k, v)
  within_rule(out, ref_out, "out")
  for g, r, n in zip(grads, ref_grads, "qkv"):
    within_rule(g, r, f"d{n}")
  assert np.array_equal(np.asarray(out), np.asarray(fwd(q, k, v)))    # deterministic


@pytest.mark.parametrize("balance,conds", [(False, 3), (True, 2 * 3)])
def test_causal_chunk_pairs_are_skipped_not_computed(balance, conds):
  # 4 devices. Contiguous: a diagonal call at step 0, then one call per step behind a
  # conditional (visible or skipped). Zig-zag: step 0 has the 2 diagonal pieces (+1 full pair);
  # later steps one statically visible pair and 2 conditional pairs; 1 pair is never called.
  mesh = parallel.make_mesh(data=2, tensor=4)
  q, k, v, _ = qkv()
  f = functools.partial(ring_attention, mesh=mesh, axis="tensor", causal=True,
                        batch_axes="data", load_balance=balance, implementation="xla")
  jaxpr = str(jax.make_jaxpr(f)(q, k, v))
  assert jaxpr.count("cond[") == conds
  assert jaxpr.count("ppermute[") == 2 * 3          # k and v, 3 hops
  # The backward turns the ring once more (k, v, dk, dv for 3 hops, then dk, dv home) and skips
  # hidden chunks behind the same number of conditionals.
  grad_jaxpr = str(jax.make_jaxpr(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2)))(q, k, v))
  assert grad_jaxpr.count("ppermute[") == 2 * 3 + 4 * 3 + 2
  assert grad_jaxpr.count("cond[") == 2 * conds


def test_merge_partials_handles_empty_rows():
  out_a = jnp.ones((1, 3, 2, 4))
  lse_a = jnp.array([[[0.5, -jnp.inf, -jnp.inf], [1.0, -jnp.inf, 2.0]]])
  out_b = 2 * jnp.ones((1, 3, 2, 4))
  lse_b = jnp.array([[[0.5, -jnp.inf, 1.0], [-jnp.inf, -jnp.inf, 2.0]]])
  out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
  assert lse[0, 0, 1] == -jnp.inf and lse[0, 1, 1] == -jnp.inf
  np.testing.assert_allclose(lse[0, 0, 0], 0.5 + np.log(2), rtol=1e-6)
  np.testing.assert_allclose(out[0, 0, 0], 1.5, rtol=1e-6)      # equal weights
  np.testing.assert_allclose(out[0, 2, 0], 2.0, rtol=1e-6)      # only b saw keys
  np.testing.assert_array_equal(out[0, 1], 0.0)                 # no keys anywhere
  grads = jax.grad(lambda *a: merge_partials(*a)[0].sum() + jnp.where(
      jnp.isfinite(merge_partials(*a)[1]), merge_partials(*a)[1], 0).sum(),
                   argnums=(0, 1, 2, 3))(out_a, lse_a, out_b, lse_b)
  for g in grads:
    assert np.isfinite(np.asarray(g)).all()


def test_zigzag_permutation():
  np.testing.assert_array_equal(zigzag_permutation(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
  with pytest.raises(ValueError, match="not divisible by 2 x 4"):
    zigzag_permutation(12, 4)


@pytest.mark.parametrize("t,kv_t,kw,match", [
    (30, 30, {}, r"sequence length 30 is not divisible by 8 chunks"),
    (32, 16, {}, r"needs k, v of q's length"),
    (32, 32, dict(axis="context"), r"mesh has no axis 'context'"),
    (32, 32, dict(head_axis="tensor", axis="fsdp"), r"K/V heads 2 are not divisible"),
])
def test_bad_inputs(t, kv_t, kw, match):
  mesh = parallel.make_mesh(fsdp=2, tensor=4)
  q = jnp.zeros((2, t, 4, 8))
  k = v = jnp.zeros((2, kv_t, 2, 8))
  args = dict(mesh=mesh, axis="tensor", causal=True)
  args.update(kw)
  with pytest.raises(ValueError, match=match):
    ring_attention(q, k, v, **args)


def test_gpt_with_ring_attention_trains_like_one_device():
  # Context parallel inside make_train_step: the model's attention_fn is the ring over "tensor".
  import optax
  from flax import nnx
  from examples.gpt import GPT, dense_attention, next_token_nll
  from parallel import rules as R
  from parallel_helpers import assert_trees_close, make_tokens, tiny_config

  mesh = parallel.make_mesh(data=4, tensor=2)
  ring = functools.partial(ring_attention, mesh=mesh, axis="tensor", batch_axes="data",
                           implementation="xla")
  tokens = make_tokens()
  out = {}
  for name, attn, m in (("ring", ring, mesh),
                        ("dense", dense_attention, parallel.make_mesh(devices=jax.devices()[:1]))):
    model = GPT(tiny_config(), rngs=nnx.Rngs(0), attention_fn=attn)
    step = parallel.make_train_step(model, optax.sgd(0.1), next_token_nll, mesh=m, rules=R.DP,
                                    compiler_options=FAST_COMPILE)
    out[name] = step.loss_and_grad(step.init(model), tokens)
  assert_trees_close(out["ring"], out["dense"], what="loss and grads", scale_atol=True)


def test_efficient_backward_uses_less_memory_than_autodiff():
  # Autodiff of the forward ring keeps every K/V chunk each device saw (O(T)); the custom
  # backward carries one chunk and its gradient accumulators round the ring (O(T / n)).
  mesh = parallel.make_mesh(tensor=8)
  q = k = v = jnp.ones((1, 256, 2, 16))
  temp = {}
  for efficient in (True, False):
    f = functools.partial(ring_attention, mesh=mesh, axis="tensor", causal=True,
                          implementation="xla", efficient_backward=efficient)
    grad = jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2)),
                   compiler_options=FAST_COMPILE)
    temp[efficient] = grad.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes
  assert temp[True] < temp[False], temp


# On CPU the Triton kernel runs in Pallas interpret mode, which jax 0.11.2 cannot run inside
# shard_map(check_vma=True) (see tests/pallas_attn/test_transforms.py); on a GPU it is compiled.
@pytest.mark.parametrize("implementation",
                         ["xla"] + (["triton"] if jax.default_backend() == "gpu" else []))
def test_ring_attention_bf16_within_ratio_rule(implementation):
  """bf16, the FlashAttention ratio rule of TESTING.md (ref_hi: float32 HIGHEST; ref_lo: bf16)."""
  import importlib.util
  import pathlib
  spec = importlib.util.spec_from_file_location(
      "attn_harness", pathlib.Path(__file__).parents[1] / "pallas_attn" / "harness.py")
  harness = importlib.util.module_from_spec(spec)
  import sys
  sys.modules["attn_harness"] = harness      # its dataclasses look their module up
  spec.loader.exec_module(harness)

  mesh = parallel.make_mesh(data=2, tensor=4)
  q, k, v, ct = (x.astype(jnp.bfloat16) for x in qkv(t=64, h=16, seed=3))
  ring = functools.partial(ring_attention, mesh=mesh, axis="tensor", causal=True,
                           batch_axes="data", implementation=implementation)

  def out_and_grads(fn, *args):
    out, vjp = jax.vjp(fn, *args)
    return (out,) + vjp(ct.astype(out.dtype))

  ours = jax.jit(lambda *a: out_and_grads(ring, *a), compiler_options=FAST_COMPILE)(q, k, v)
  ref = functools.partial(pallas_attn.reference.attention, causal=True)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  with jax.default_matmul_precision("highest"):
    hi = out_and_grads(functools.partial(ref, precision=jax.lax.Precision.HIGHEST), *f32)
  lo = out_and_grads(ref, q, k, v)
  bad = []
  for name, a, h, l in zip(("out", "dq", "dk", "dv"), ours, hi, lo):
    bad += harness.ratio_rule_violations(name, a, h, l, "bfloat16")
  assert not bad, "\n".join(bad)

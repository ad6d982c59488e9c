"""``Config.bwd_joint``: the dQ and dK/dV grid kernels in one launch (``backward_joint.py``),
dQ CTAs first, each dK/dV CTA waiting on a GMEM semaphore for its heads' D records, so that
the dK/dV CTAs fill the SMs the dQ kernel's last partial wave leaves idle.

The kernel bodies are the two launches' own, so the gradients must be bitwise theirs: checked
in interpret mode (no semaphores there: the interpreter runs the CTAs in grid order) and
compiled, where the semaphores and the proxy fences are exercised."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import harness as H
from benchmarks import mosaic_mlir
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, default_config

JOINT = dict(bwd_joint=True)


def _grid_config(head_dim, **kw):
  """The row's default with the grid (not persistent) backward, the joint launch's form; short
  rows like these take the persistent one by default."""
  return dataclasses.replace(default_config(head_dim=head_dim, **kw), bwd_persistent=False)


def _inputs(b, t, s, n, kh, h, seed):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (b, s, kh, h), jnp.bfloat16) for kk in keys[1:])
  return q, k, v


def _loss(cfg, interpret, **kw):
  return lambda q, k, v: flash_attention(q, k, v, implementation="mosaic", config=cfg,
                                         interpret=interpret, **kw).astype(jnp.float32).sum()


def _run(cfg, *, interpret, seed=471, kw=None, **shape):
  f = _loss(cfg, interpret, **(kw or {}))
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(*_inputs(seed=seed, **shape))


def _kernels(cfg, *, kw=None, **shape):
  """Names of the backward's Mosaic kernels in the traced gradient (interpret mode)."""
  text = str(jax.make_jaxpr(jax.grad(_loss(cfg, True, **(kw or {})), argnums=(0, 1, 2)))(
      *_inputs(seed=0, **shape)))
  return {name for name in ("flash_attention_bwd", "flash_attention_dq", "flash_attention_dkdv")
          if name in text}


def test_off_by_default():
  assert Config().bwd_joint is False
  assert not default_config(head_dim=128, seq_k=4096, batch=4).bwd_joint


def test_one_launch_only_where_it_applies():
  shape = dict(b=2, t=128, s=256, n=2, kh=1, h=64)
  base = _grid_config(64, seq_k=256, batch=2)
  assert _kernels(dataclasses.replace(base, **JOINT), **shape) == {"flash_attention_bwd"}
  assert _kernels(base, **shape) == {"flash_attention_dq", "flash_attention_dkdv"}
  # masked calls (per-CTA ranges) and the persistent backward keep the two launches
  masked = dataclasses.replace(_grid_config(64, seq_k=256, batch=2, masked=True), **JOINT)
  assert _kernels(masked, kw=dict(causal=True), **shape) == {"flash_attention_dq",
                                                            "flash_attention_dkdv"}
  persistent = dataclasses.replace(base, bwd_persistent=True, **JOINT)
  assert "flash_attention_bwd" not in _kernels(persistent, **shape)


def test_interpret_bitwise():
  # GQA 2:1, three sequences, more keys than queries (dQ and dK/dV tiles differ in number)
  shape = dict(b=3, t=128, s=256, n=2, kh=1, h=64)
  base = _grid_config(64, seq_k=256, batch=3)
  H.assert_same_value_and_grads(_run(dataclasses.replace(base, **JOINT), interpret=True, **shape),
               _run(base, interpret=True, **shape))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled runs lower it for real")
def test_lowered_semaphores_are_shared_and_counted():
  """The compiled kernel (lowered for sm90 on the CPU host): one int32 semaphore per dK/dV
  CTA shared by all CTAs (Pallas' kernel-scoped semaphores are per CTA, which hung the first
  form), each dQ consumer adding 1 to its group's K/V tiles after a proxy fence, each dK/dV
  producer waiting with a decrementing compare-and-swap. [1, 1024, 2, 128]: 8 K/V tiles.
  Each dQ consumer signals with its dQ store still in flight: it waits for the older bulk
  group (its D record) only, and the full waits (0) come after."""
  cfg = dataclasses.replace(_grid_config(128, seq_k=1024, batch=1), **JOINT)
  low = mosaic_mlir.lower_attention(cfg, head_dim=128, grad=True, causal=False)
  fwd, bwd = mosaic_mlir.kernel_texts(low)
  assert bwd.count("red.relaxed.gpu.global.add.u32") == 8
  assert bwd.count("atom.relaxed.gpu.global.cas") == 1
  assert bwd.count("fence.proxy.async.global") == 2
  waits = re.findall(r"nvvm.cp.async.bulk.wait_group (\d)", bwd)
  assert waits.count("1") == 1 and "0" in waits[waits.index("1"):], waits
  calls = [line for line in low.as_text().splitlines() if "custom_call" in line]
  assert [re.findall(r"tensor<\d+xi32>", c) for c in calls if "xi32>" in c] == [
      ["tensor<16xi32>", "tensor<16xi32>"]]       # 1 batch x 2 heads x 8 tiles, in and out


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [dict(b=4, t=2048, s=2048, n=4, kh=2, h=128),
                                   dict(b=1, t=1024, s=3072, n=8, kh=8, h=64),
                                   dict(b=2, t=4096, s=4096, n=16, kh=16, h=128)])
def test_compiled_bitwise(shape):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  base = _grid_config(shape["h"], seq_k=shape["s"], batch=shape["b"])
  H.assert_same_value_and_grads(_run(dataclasses.replace(base, **JOINT), interpret=False, **shape),
               _run(base, interpret=False, **shape))

"""128-key dQ steps at H = 128 without Q / dO in registers (``bwd_dq_block_kv=128,
bwd_dq_regs=False``): a candidate for the unmasked H = 128 default, untimed (session 44).

At H = 128 the default dQ kernel takes 64-key steps with Q and dO as register operands (dQ 64 +
S 32 + dP 32 + Q 32 + dO 32 registers a thread). With 128-key steps S and dP double (64 each)
and Q / dO go back to shared memory: offline ptxas (4x4096x16x128 unmasked, session 44) puts the
step loop at 409 instructions per 128 keys against 238 per 64 keys, no spills, and 24 HGMMA
per 128 keys against 40. Causal: 136-140 B of spills in the masked diagonal loops. The same
form with Q / dO in registers spills 232 B (C7512).

Checked here: the statics the form gives the dQ kernel, that its sm90 lowering changes only the
dQ kernel, the gradients in interpret mode (interpret ignores ``bwd_dq_regs``) and, compiled,
against the float32 reference (the ratio rule) and against the default (out and dK / dV
bitwise, dQ within float32 rounding: 128-key wgmmas sum in another order)."""
import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness as H
from benchmarks import mosaic_mlir
from pallas_attn import flash_attention
from pallas_attn.mosaic import default_config, ops

FORM = dict(bwd_dq_block_kv=128, bwd_dq_regs=False)


def _statics(cfg):
  q = jnp.zeros((1, 4096, 2, 128), jnp.bfloat16)
  return ops._backward_statics(q, q, None, None, causal=False, scale=1.0, window=None,
                               softcap=None, cfg=cfg, interpret=False)


def test_statics():
  base = default_config(head_dim=128, seq_k=4096)
  st_dq, st_dkdv = _statics(dataclasses.replace(base, **FORM))
  st_dq0, st_dkdv0 = _statics(base)
  assert (st_dq0.block_kv, st_dq0.qdo_regs) == (64, True)            # today's default
  assert (st_dq.block_kv, st_dq.qdo_regs) == (128, False)
  # (the statics share their fields; the dK/dV kernel does not read qdo_regs: its lowering is
  # the same, below)
  assert dataclasses.replace(st_dkdv, qdo_regs=True) == st_dkdv0
  assert ops.dq_smem_bytes(st=st_dq, head_dim=128) <= ops.SMEM_LIMIT_BYTES


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled runs lower it for real")
def test_lowering_changes_only_the_dq_kernel():
  base = default_config(head_dim=128, seq_k=4096)

  def kernels(cfg):
    low = mosaic_mlir.lower_attention(cfg, head_dim=128, grad=True, causal=False)
    texts = [re.sub(r"(flash_attention_[a-z]+)_\d+", r"\1", t)
             for t in mosaic_mlir.kernel_texts(low)]
    return {("dkdv" if "dkdv" in t else "dq" if "_dq" in t else "fwd"): t for t in texts}
  before, after = kernels(base), kernels(dataclasses.replace(base, **FORM))
  assert after["fwd"] == before["fwd"] and after["dkdv"] == before["dkdv"]
  shapes = lambda text: collections.Counter(re.findall(r"mma_async[\w.]*\.(m64n\d+k16)", text))
  # A step: S and dP, one wgmma per k16 slice of H = 128 each (n = the step's keys), and
  # dQ += dS K, one per k16 slice of the keys (n = H = 128).
  assert shapes(before["dq"]) == {"m64n64k16": 16, "m64n128k16": 4}
  assert shapes(after["dq"]) == {"m64n128k16": 24}


def test_interpret_mode():
  # One small case (CI time): GQA 2:1, causal, a partial last key block of the 128-key steps.
  case = H.Case(t=130, s=257, n=2, kh=1, h=128, causal=True, seed=442)
  H.check_mosaic_default_with(case, **FORM)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    H.Case(t=2048, s=2048, n=4, kh=2, h=128, seed=443),
    H.Case(t=1000, s=1536, n=4, kh=4, h=128, seed=444),
    H.Case(t=2048, s=2048, n=4, kh=4, h=128, causal=True, seed=445)], ids=lambda c: c.id)
def test_compiled_against_reference(case):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  H.check_mosaic_default_with(case, **FORM)


@pytest.mark.gpu
def test_compiled_against_the_default():
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  keys = jax.random.split(jax.random.key(446), 3)
  q, k, v = (jax.random.normal(kk, (2, 4096, 4, 128), jnp.bfloat16) for kk in keys)
  base = default_config(head_dim=128, seq_k=4096, batch=2)

  def run(cfg):
    f = lambda q, k, v: flash_attention(q, k, v, implementation="mosaic",
                                        config=cfg).astype(jnp.float32).sum()
    return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)
  ref_val, ref = run(base)
  val, grads = run(dataclasses.replace(base, **FORM))
  np.testing.assert_array_equal(np.asarray(val), np.asarray(ref_val))
  dq, dq0 = np.asarray(grads[0], np.float32), np.asarray(ref[0], np.float32)
  assert np.abs(dq - dq0).max() <= 2.0 ** -7 * np.abs(dq0).max()
  for g, g0 in zip(grads[1:], ref[1:]):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g0))

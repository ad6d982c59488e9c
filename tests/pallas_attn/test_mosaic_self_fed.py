"""``Config.bwd_self_fed``: the dK/dV kernel without a producer warpgroup, its consumer 0 filling
the Q / dO / stats ring itself.

Interpret mode runs the form (the interpreter simulates the two warpgroups, the TMA copies and
every mbarrier phase, and fails if one is left unobserved), so the ring's refill and drain are
checked on CPU: gradients bitwise those of the default kernel (the same products in the same
order), with more ring steps than slots (GQA, two Q blocks) and with fewer (one step). Lowered
for sm90, the kernel asks ptxas for no register reallocation (no ``setmaxnreg``): its two
warpgroups take what ptxas allocates. Compiled (``gpu``): bitwise the default's, alone and with
``bwd_defer_wait``, which it was written to make affordable.
"""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

import harness as H
from benchmarks import mosaic_mlir
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, default_config


def _grads(q, k, v, cfg, *, interpret, **kw):
  f = lambda q, k, v: flash_attention(q, k, v, implementation="mosaic", config=cfg,
                                      interpret=interpret, **kw).astype(jnp.float32).sum()
  return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("t,s,n,kh,flags", [
    (128, 128, 4, 2, {}),                                              # 4 ring steps, 2 slots
    (64, 128, 2, 2, dict(causal=True, segments=True, kv_lengths=True)),  # 1 step: no refill
    (128, 128, 4, 2, dict(causal=True, kv_lengths=True)),             # masked, several steps
], ids=["gqa_4_steps", "masked_1_step", "masked_gqa"])
def test_self_fed_matches_default_in_interpret_mode(t, s, n, kh, flags):
  q, k, v = H.qkv_inputs(2, t, s, n, kh, 64)
  kw = H.flag_kwargs(flags, t=t, s=s, segment_lengths=(40, 30))
  base = Config(block_kv=64)
  H.assert_same_value_and_grads(_grads(q, k, v, dataclasses.replace(base, bwd_self_fed=True), interpret=True, **kw),
               _grads(q, k, v, base, interpret=True, **kw))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="compiled runs lower it for real")
def test_self_fed_kernel_has_no_register_reallocation():
  base = default_config(head_dim=128, seq_k=4096, masked=False)

  def dkdv_text(cfg):
    low = mosaic_mlir.lower_attention(cfg, head_dim=128, grad=True, causal=False)
    (text,) = [t for t in mosaic_mlir.kernel_texts(low) if "dkdv" in t]
    return text
  assert "setmaxnreg" in dkdv_text(base)
  assert "setmaxnreg" not in dkdv_text(dataclasses.replace(base, bwd_self_fed=True))
  assert Config().bwd_self_fed is False


@pytest.mark.gpu
@pytest.mark.parametrize("h,causal,defer", [(128, False, False), (128, False, True),
                                            (128, True, False), (64, False, False)])
def test_self_fed_gradients_bitwise_compiled(h, causal, defer):
  if jax.default_backend() != "gpu":
    pytest.skip("needs the GPU")
  q, k, v = H.qkv_inputs(2, 1024, 1024, 4, 4, h, seed=30)
  base = dataclasses.replace(default_config(head_dim=h, seq_k=1024, masked=causal),
                             bwd_persistent=False, bwd_defer_wait=defer)
  H.assert_same_value_and_grads(_grads(q, k, v, dataclasses.replace(base, bwd_self_fed=True), interpret=None,
                      causal=causal),
               _grads(q, k, v, base, interpret=None, causal=causal))

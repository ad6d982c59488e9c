"""Q (and, in the dQ kernel, dO) as register A operands of wgmma (``Config.q_regs_cols``,
``Config.bwd_dq_regs``).

Compiled only: JAX 0.11.2's Mosaic GPU interpreter has no register wgmma operands, so interpret
mode must ignore both fields (bitwise the default's outputs and gradients). The compiled forms
are lowered for sm90 on CPU: they must lower, and change the kernel.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import harness as H
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, default_config, kernels, ops


def test_interpret_mode_ignores_register_q():
  # One KV head (GQA 2:1); two Q tiles and two KV blocks, one of them cut by the causal mask
  # and the kv lengths, are all the flags could change (the interpreter's time grows with
  # tiles x blocks: 3 x 3 took 75-107 s on CI).
  b, t, s, h = 2, 70, 100, 64
  q, k, v = H.qkv_inputs(b, t, s, 2, 1, h)
  kw = H.flag_kwargs(dict(causal=True, kv_lengths=True), t=t, s=s)

  def run(cfg):
    f = lambda q, k, v: flash_attention(q, k, v, implementation="mosaic", config=cfg,
                                        interpret=True, **kw).astype(jnp.float32).sum()
    return jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)
  (val, grads), (base_val, base_grads) = (run(Config(block_kv=64, q_regs_cols=64,
                                                     bwd_dq_regs=True, bwd_dkdv_regs="kv")),
                                          run(Config(block_kv=64)))
  np.testing.assert_array_equal(np.asarray(val), np.asarray(base_val))
  for g, g0 in zip(grads, base_grads):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(g0))


@pytest.mark.parametrize("h,cols,causal", [(64, 64, False), (128, 128, True), (256, 128, False),
                                           (128, 512, True)],
                         ids=["h64_all", "h128_all_causal", "h256_split", "h128_clipped"])
def test_register_q_lowers_for_sm90(h, cols, causal):
  """The forward with Q (or its first ``cols`` columns) in registers lowers and differs from
  the SMEM form (a request above the head dim takes all of Q: test_statics_clip_...)."""
  base = default_config(head_dim=h, seq_k=1024, masked=causal)
  lower = lambda c: H.lower_mosaic_forward(dataclasses.replace(base, q_regs_cols=c), h=h,
                                           causal=causal)
  regs, smem = lower(cols), lower(0)
  assert "flash_attention_fwd" in regs and regs != smem


def _forward_statics(cfg, *, h, interpret):
  """The Statics ops._forward builds (captured from the kernel launch it traces)."""
  seen = {}
  real = kernels.fwd_kernel

  def spy(*refs, st, has_meta):
    seen["st"] = st
    return real(*refs, st=st, has_meta=has_meta)
  q = jax.ShapeDtypeStruct((1, 256, 2, h), jnp.bfloat16)
  fwd = functools.partial(ops._forward, causal=False, scale=h ** -0.5, window=None,
                          softcap=None, cfg=cfg, hp=h, interpret=interpret)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(kernels, "fwd_kernel", spy)
    jax.jit(fwd).trace(q, q, q, None, None, None)
  return seen["st"]


def test_statics_clip_and_drop_register_q():
  cfg = Config(q_regs_cols=512, block_kv=64)
  assert _forward_statics(cfg, h=128, interpret=False).q_regs_cols == 128
  assert _forward_statics(Config(q_regs_cols=128, block_kv=64), h=256,
                          interpret=False).q_regs_cols == 128
  # Unmasked with block_kv == head dim: wrong outputs compiled (H200, session 14), not served,
  # whether all of Q or a part of it is asked for.
  for h, cols in ((64, 64), (128, 128), (128, 64)):
    assert _forward_statics(Config(q_regs_cols=cols, block_kv=h), h=h,
                            interpret=False).q_regs_cols == 0
  assert _forward_statics(Config(q_regs_cols=64, block_kv=64), h=128,
                          interpret=False).q_regs_cols == 64
  assert _forward_statics(cfg, h=128, interpret=True).q_regs_cols == 0
  assert _forward_statics(dataclasses.replace(cfg, overlap=True), h=128,
                          interpret=False).q_regs_cols == 0


# The rows where ``default_config`` turns register Q on (H = 64, 1025-4096 keys), with every
# mask that reaches its loops: unmasked (persistent, 256-key blocks), causal / window (128-key
# blocks, masked and unmasked loops), kv_lengths and segment ids (the masked loops of the grid).
# The shared grid's key lengths stop at 1024, so none of its cases takes this path.
REGISTER_Q_ROWS = [
    H.Case(t=1000, s=1536, n=4, kh=2, seed=301),
    H.Case(t=1000, s=1536, n=4, kh=2, causal=True, seed=302),
    H.Case(t=1000, s=1536, n=4, kh=2, window=(300, 40), softcap=20.0, seed=303),
    H.Case(t=1000, s=1536, n=4, kh=2, kv_lengths=(1536, 1100), seed=304),
    H.Case(t=1000, s=1536, n=4, kh=2, segments=3, seed=305),
    H.Case(t=1000, s=2048, n=4, kh=2, causal=True, segments=2, kv_lengths=(2048, 1300),
           dtype="float16", seed=306),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", REGISTER_Q_ROWS, ids=lambda c: c.id)
def test_register_q_default_rows_compiled(case):
  """Compiled: the default config of these rows (Q in registers) passes the ratio rule, and its
  forward is bitwise the same config's with Q read from shared memory (same products, same
  order)."""
  masked = case.causal or case.window is not None
  cfg = default_config(head_dim=case.h, seq_k=case.s, masked=masked)
  assert cfg.q_regs_cols == 64
  res = H.check_case(case, "mosaic", config=cfg)
  smem = H.runner(case, implementation="mosaic",
                  config=dataclasses.replace(cfg, q_regs_cols=0))(H.case_data(case)[0])
  H.assert_bitwise(res, smem, f"register Q vs SMEM Q, {case.id}", names=("out", "lse"))

"""Triton backend: Config validation, heuristics, and lowering to Triton IR for an H200.

The lowering test needs no GPU: it lowers the jitted forward and backward for the "cuda" platform
against an abstract H200, which runs the whole Pallas -> Triton lowering (power-of-two shapes,
supported primitives) that a compiled GPU run would, short of PTX generation.
"""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax._src import mesh as mesh_lib

import pallas_attn
from pallas_attn.triton import Config, default_config
from pallas_attn.triton.config import (BWD_SMEM_BUDGET_BYTES, SMEM_LIMIT_BYTES,
                                       backward_smem_bytes, fit_to_lengths, forward_smem_bytes)


@pytest.mark.parametrize("field,value", [("block_q", 96), ("block_k", 8), ("block_q_dq", 512),
                                         ("num_warps", 3), ("num_stages", 0),
                                         ("bwd_num_stages", 9)])
def test_config_rejects_bad_values(field, value):
  with pytest.raises(ValueError, match=field):
    Config(**{field: value})


def test_config_is_frozen_and_hashable():
  cfg = Config()
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.block_q = 64
  assert hash(cfg) == hash(Config())


@pytest.mark.parametrize("head_dim", [32, 64, 72, 96, 128, 256])
@pytest.mark.parametrize("seq", [1, 3, 100, 4096])
def test_default_config_fits(head_dim, seq):
  cfg = default_config(head_dim=head_dim, seq_q=seq, seq_k=seq)
  cfg32 = default_config(head_dim=head_dim, seq_q=seq, seq_k=seq, itemsize=4)
  assert forward_smem_bytes(cfg, head_dim=head_dim, itemsize=2) <= SMEM_LIMIT_BYTES
  assert forward_smem_bytes(cfg32, head_dim=head_dim, itemsize=4) <= SMEM_LIMIT_BYTES
  for c, size in ((cfg, 2), (cfg32, 4)):
    assert backward_smem_bytes(c, head_dim=head_dim, itemsize=size) <= BWD_SMEM_BUDGET_BYTES
  tiles = (cfg.block_q, cfg.block_k, cfg.block_q_dkv, cfg.block_k_dkv, cfg.block_q_dq,
           cfg.block_k_dq)
  assert all(16 <= b <= max(16, 1 << (seq - 1).bit_length()) for b in tiles)


def test_fit_to_lengths_clamps_but_keeps_launch_params():
  cfg = fit_to_lengths(Config(block_q=128, num_warps=8), seq_q=20, seq_k=3)
  assert (cfg.block_q, cfg.block_k, cfg.num_warps) == (32, 16, 8)


def test_config_over_shared_memory_is_not_implemented():
  q = jnp.ones((1, 256, 2, 256), jnp.bfloat16)
  big = Config(block_q=128, block_k=128, num_stages=3)
  with pytest.raises(NotImplementedError, match="shared memory"):
    pallas_attn.flash_attention(q, q, q, implementation="triton", config=big, interpret=False)


def test_wrong_config_type_is_not_implemented():
  q = jnp.ones((1, 16, 2, 32), jnp.float32)
  with pytest.raises(NotImplementedError, match="triton Config"):
    pallas_attn.flash_attention(q, q, q, implementation="triton", config={"block_q": 64})


def _h200():
  dev = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(
      jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev))


@pytest.mark.parametrize("kw", [
    dict(),
    dict(causal=True),
    dict(window=(64, 0), softcap=20.0),
    dict(kv_lengths=jnp.array([100, 200], jnp.int32)),
    dict(q_segment_ids=jnp.zeros((2, 200), jnp.int32),
         kv_segment_ids=jnp.zeros((2, 300), jnp.int32), causal=True),
], ids=["full", "causal", "window_softcap", "kv_lengths", "segments"])
@pytest.mark.parametrize("dtype,head_dim", [(jnp.bfloat16, 128), (jnp.float16, 72),
                                            (jnp.float32, 64), (jnp.bfloat16, 256)])
def test_lowers_to_triton_for_h200(kw, dtype, head_dim):
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  q = jax.ShapeDtypeStruct((2, 200, 4, head_dim), dtype)
  k = jax.ShapeDtypeStruct((2, 300, 2, head_dim), dtype)

  def loss(q, k, v):
    out, lse = pallas_attn.flash_attention(q, k, v, implementation="triton", interpret=False,
                                           return_lse=True, **kw)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

  with _h200():
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k).lower(
        lowering_platforms=("cuda",))
  text = lowered.as_text()
  for name in ("flash_attention_fwd", "flash_attention_dkdv", "flash_attention_dq"):
    assert name in text

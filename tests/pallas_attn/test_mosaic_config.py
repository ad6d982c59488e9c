"""Mosaic GPU backend: Config validation, heuristics, and lowering of the compiled kernel form.

The shared suite (test_attention.py etc.) runs the kernel in Mosaic GPU interpret mode, which
uses the shared-memory form of the P V step. The form compiled for the GPU (P in registers, O
accumulated in place) is lowered here, on CPU, to Mosaic GPU MLIR for sm90: that catches layout,
barrier and shape errors without a GPU.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import mesh as mesh_lib

import harness as H
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, default_config, kernels, ops
from pallas_attn.mosaic.config import LONG_ROW_THREE_CONSUMERS, padded_head_dim


@pytest.mark.parametrize("field,value", [("block_q", 32), ("block_kv", 72), ("num_stages", 1),
                                         ("num_stages", 5), ("bwd_registers", 248),
                                         ("bwd_registers", 216), ("q_regs_cols", 96),
                                         ("q_regs_cols", -64), ("bwd_dkdv_regs", "q")])
def test_config_rejects_bad_values(field, value):
  with pytest.raises(ValueError, match=field):
    Config(**{field: value})


def test_config_rejects_two_fused_dq_forms():
  with pytest.raises(ValueError, match="bwd_dq_lag"):
    Config(bwd_dq_lag=True, bwd_dq_writer=True)


@pytest.mark.parametrize("h,want", [(32, 64), (64, 64), (72, 128), (128, 128), (192, 192),
                                    (200, 256), (256, 256)])
def test_padded_head_dim(h, want):
  assert padded_head_dim(h) == want


def test_head_dim_over_256_is_not_implemented():
  with pytest.raises(NotImplementedError, match="head_dim"):
    padded_head_dim(320)


@pytest.mark.parametrize("h", [64, 128, 256])
def test_default_config_fits_shared_memory(h):
  cfg = default_config(head_dim=h, seq_k=4096)
  st = kernels.Statics(scale=1.0, softcap=None, spec=ops.masks.MaskSpec(None, None, 0),
                       has_kv_len=False, has_segments=False, groups=1, block_q=cfg.block_q,
                       block_kv=cfg.block_kv, num_stages=cfg.num_stages, num_kv_blocks=32,
                       registers_pv=True)
  assert kernels.smem_bytes(st=st, head_dim=padded_head_dim(h), itemsize=2) <= ops.SMEM_LIMIT_BYTES


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("seq_k", [1024, 16384])
def test_default_config_flags_by_mask(masked, seq_k):
  """H200 sessions 6-7: masked calls pin the softmax, release slots on hardware barriers and
  run persistent with the dynamic tile counter (at every length since H100 session 34:
  1x16384x16x128 causal 1.6452 -> 1.6205 ms); unmasked calls run persistent without those
  flags."""
  cfg = default_config(head_dim=128, seq_k=seq_k, masked=masked)
  three = not masked and seq_k >= 16384               # the grid with three consumers (below)
  assert (cfg.pin_softmax, cfg.named_free) == (masked, masked)
  assert cfg.persistent == (not three)
  assert cfg.dynamic_schedule == masked
  assert not cfg.bwd_fused_dq                                     # measured slower: opt-in
  assert cfg.bwd_dq_regs and cfg.q_regs_cols == 0                 # session 14


@pytest.mark.parametrize("h", [64, 100, 128, 256])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("seq_k", [4096, 8192, 16384, 32768])
def test_default_config_three_consumers_on_long_unmasked_h128_rows(h, masked, seq_k):
  """Sessions 26-27: 1x16384x16x128 full forward 0.83% faster on the H200 (1.002x cuDNN) and
  1% on an H100 with three consumers; 13% slower at 4096 keys; 8192 not measured."""
  cfg = default_config(head_dim=h, seq_k=seq_k, masked=masked)
  three = padded_head_dim(h) == 128 and not masked and seq_k >= LONG_ROW_THREE_CONSUMERS
  assert cfg.consumers == (3 if three else 2)
  assert LONG_ROW_THREE_CONSUMERS == 16384


@pytest.mark.parametrize("h,masked", [(256, False), (256, True)])
def test_default_config_keeps_the_grid_off_head_dim_128(h, masked):
  """The persistent launch is default only where it ran compiled at scale and won (H = 128;
  H = 64 at 4096 keys, below)."""
  cfg = default_config(head_dim=h, seq_k=4096, masked=masked)
  assert not cfg.persistent and not cfg.dynamic_schedule


@pytest.mark.parametrize("h", [64, 128, 256])
@pytest.mark.parametrize("masked", [False, True])
def test_default_config_lazy_rescale_only_masked_wide(h, masked):
  """H200 session 17: lazy rescaling (tau 8) made the causal H = 256 forward 1.03 -> 1.06x
  cuDNN; unmasked it was slower (H = 256 +0.6%, H = 128 +5-6%), so it is on for masked calls
  at head dims over 128 only."""
  cfg = default_config(head_dim=h, seq_k=4096, masked=masked)
  assert cfg.lazy_rescale == (8.0 if masked and h > 128 else 0.0)


@pytest.mark.parametrize("windowed", [False, True], ids=["causal", "windowed"])
@pytest.mark.parametrize("seq_k", [128, 256, 512, 1024, 2048, 4096, 8192, 16384])
def test_default_config_masked_head_dim_64(seq_k, windowed):
  """H200 session 12: causal 4x4096x32x64 with 128-key blocks and the dynamic tile counter ran
  1.012x cuDNN (the grid with 256-key blocks: 0.941x); H100 session 34 took it down to 129
  keys (16x1024 0.72 -> 0.97x, 32x512 0.56 -> 0.91x, 64x256 0.53 -> 0.88x). Longer causal
  rows keep the grid; windowed ones take the 128-key form at every length (H100, session 36:
  1x16384x32x64 window (1024, 0) forward 0.86 -> 1.07x cuDNN). The persistent loop never gets
  256-key blocks (it hangs compiled)."""
  cfg = default_config(head_dim=64, seq_k=seq_k, masked=True, windowed=windowed)
  on = 128 < seq_k and (seq_k <= 4096 or windowed)
  assert (cfg.persistent, cfg.dynamic_schedule) == (on, on)
  assert cfg.block_kv == (128 if seq_k <= 4096 or windowed else 256)
  assert cfg.pin_softmax and cfg.named_free
  assert cfg.q_regs_cols == (64 if on else 0)          # session 14: 1.011 -> 1.041x cuDNN


@pytest.mark.parametrize("seq_k", [128, 256, 512, 1024, 2048, 4096, 8192])
def test_default_config_unmasked_head_dim_64(seq_k):
  """H200 session 13: unmasked 4x4096x32x64, persistent with 256-key blocks and the turns on
  mbarriers, 0.989x cuDNN (the grid: 0.948x). H100 session 34: at 129-1024 keys 128-key blocks
  with the named-barrier turns (16x1024 0.84 -> 0.97x, 32x512 0.72 -> 0.95x; mbarrier turns 6%
  slower there); longer rows keep the grid with the named-barrier turns."""
  cfg = default_config(head_dim=64, seq_k=seq_k, masked=False)
  long_form = seq_k > 1024                  # 1x16384: 0.99 -> 1.03x cuDNN (H100, session 34)
  short_form = 128 < seq_k <= 1024
  assert (cfg.persistent, cfg.named_barriers) == (long_form or short_form, not long_form)
  assert cfg.block_kv == (128 if short_form or seq_k <= 128 else 256)
  assert not cfg.dynamic_schedule
  assert cfg.q_regs_cols == (64 if long_form or short_form else 0)   # s14: 0.989 -> 1.030x


def test_unmasked_head_dim_64_default_launches_persistent_when_compiled(launched):
  """The 256-key persistent loop runs compiled only with mbarrier turns (named-barrier turns
  hang): the default takes it; the same blocks on named barriers, or causal, run the grid."""
  q = jax.ShapeDtypeStruct((1, 4096, 2, 64), jnp.bfloat16)
  base = default_config(head_dim=64, seq_k=4096, masked=False)
  for cfg, causal, expect in ((base, False, True),
                              (dataclasses.replace(base, named_barriers=True), False, False),
                              (dataclasses.replace(base, block_kv=256), True, False)):
    fwd = functools.partial(ops._forward, causal=causal, scale=0.125, window=None, softcap=None,
                            cfg=cfg, hp=64, interpret=False)
    launched.clear()
    jax.jit(fwd).trace(q, q, q, None, None, None).lower(lowering_platforms=("cuda",))
    assert launched and launched[-1].persistent == expect, (cfg, causal)
    assert not launched[-1].named_barriers or not expect


@pytest.mark.parametrize("seq,causal", [(512, False), (1024, False), (512, True)])
def test_short_head_dim_64_defaults_launch_persistent_when_compiled(launched, seq, causal):
  """Session 34's short-row H = 64 forms reach the persistent launch compiled (128-key blocks:
  named-barrier turns are allowed there), the causal one with the tile counter."""
  q = jax.ShapeDtypeStruct((2, seq, 2, 64), jnp.bfloat16)
  cfg = default_config(head_dim=64, seq_k=seq, masked=causal)
  fwd = functools.partial(ops._forward, causal=causal, scale=0.125, window=None, softcap=None,
                          cfg=cfg, hp=64, interpret=False)
  launched.clear()
  jax.jit(fwd).trace(q, q, q, None, None, None).lower(lowering_platforms=("cuda",))
  st = launched[-1]
  assert st.persistent and st.named_barriers and st.dynamic == causal


def test_shard_map_masked_call_keeps_the_grid_without_the_counter(launched):
  """Inside shard_map the counter (a fresh mutable ref) is unavailable; a masked call that asked
  for it runs one CTA per tile rather than the static deal (measured 18% slower)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  q = jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
  cfg = default_config(head_dim=128, seq_k=128, masked=True)
  assert cfg.persistent and cfg.dynamic_schedule
  spec = jax.sharding.PartitionSpec(None, None, "x")
  f = jax.shard_map(lambda q: flash_attention(q, q, q, causal=True, implementation="mosaic",
                                              config=cfg, interpret=True),
                    mesh=mesh, in_specs=spec, out_specs=spec)
  jax.jit(f).trace(q)                                    # traced only: the launch is decided
  assert launched and not launched[-1].persistent
  launched.clear()
  jax.jit(lambda q: flash_attention(q, q, q, causal=True, implementation="mosaic", config=cfg,
                                    interpret=True)).trace(q)
  assert launched and launched[-1].persistent and launched[-1].dynamic     # outside: counter


def test_float32_is_not_implemented_so_dispatch_falls_back():
  q = jnp.zeros((1, 8, 2, 64), jnp.float32)
  with pytest.raises(NotImplementedError, match="float32"):
    flash_attention(q, q, q, implementation="mosaic")


def test_foreign_config_is_not_implemented():
  from pallas_attn import triton
  q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="config"):
    flash_attention(q, q, q, implementation="mosaic", config=triton.Config(), interpret=True)


LOWER_CASES = [
    (64, dict()),
    (128, dict(causal=True)),
    (128, dict(window=(100, 0), softcap=30.0, segments=True, kv_lengths=True)),
    (256, dict(causal=True, kv_lengths=True)),
]


TUNED = dict(fold_scale=True, named_barriers=True, early_k_wait=True, no_auto_barriers=True,
             computed_ranges=True, persistent=True)
FORMS = {"plain": dict(), "overlap": dict(overlap=True),
         "overlap_rendezvous": dict(overlap=True, named_barriers=False), "tuned": TUNED,
         "pinned": dict(pin_softmax=True), "named_free": dict(named_free=True, persistent=True),
         "q_regs": dict(q_regs_cols=256), "q_regs_split": dict(q_regs_cols=64, persistent=True)}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("h,kw", LOWER_CASES, ids=lambda x: str(x))
def test_compiled_form_lowers_for_sm90(h, kw, form):
  b, t, s, n, kh = 2, 1000, 1000, 4, 2
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, s, kh, h), jnp.bfloat16)
  ids = (jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, s), jnp.int32))
  qs, ks = ids if kw.get("segments") else (None, None)
  lens = jax.ShapeDtypeStruct((b,), jnp.int32) if kw.get("kv_lengths") else None
  fwd = functools.partial(
      ops._forward, causal=kw.get("causal", False), scale=h ** -0.5, window=kw.get("window"),
      softcap=kw.get("softcap"),
      cfg=dataclasses.replace(default_config(head_dim=h, seq_k=s), **FORMS[form]),
      hp=padded_head_dim(h), interpret=False)
  lowered = jax.jit(fwd).trace(q, k, k, qs, ks, lens).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "mosaic_gpu" in text                        # one Mosaic GPU custom call
  assert "flash_attention_fwd" in text               # named for profiles


@pytest.mark.parametrize("named", [True, False], ids=["named", "rendezvous"])
def test_overlapped_loop_takes_named_barrier_turns(named):
  """``overlap`` with ``named_barriers``: the turns are bar.sync / bar.arrive over both consumer
  warpgroups (256 threads), as in the plain loop; without, the mbarrier rendezvous."""
  cfg = dataclasses.replace(default_config(head_dim=64, seq_k=1024), overlap=True, block_kv=128,
                            named_barriers=named)
  text = H.lower_mosaic_forward(cfg)
  assert ("bar.sync $0, 256" in text and "bar.arrive $0, 256" in text) == named


BWD_CONFIGS = {"default": Config(), "dq128_3stages": Config(bwd_dq_block_kv=128, bwd_num_stages=3),
               "fused_dq": Config(bwd_fused_dq=True), "named_free": Config(named_free=True),
               "fused_named": Config(bwd_fused_dq=True, named_free=True),
               "defer_wait": Config(bwd_defer_wait=True),
               "defer_named": Config(bwd_defer_wait=True, named_free=True),
               "regs240": Config(bwd_registers=240),
               "pt_smem": Config(bwd_pt_smem=True),
               "pt_smem_regs240": Config(bwd_pt_smem=True, bwd_registers=240, named_free=True),
               "dq_writer": Config(bwd_dq_writer=True),
               "dq_writer_named": Config(bwd_dq_writer=True, named_free=True),
               "dq_lag": Config(bwd_dq_lag=True),
               "dq_lag_named240": Config(bwd_dq_lag=True, named_free=True, bwd_registers=240),
               "dq_regs": Config(bwd_dq_regs=True), "kv_regs": Config(bwd_dkdv_regs="kv"),
               "k_regs": Config(bwd_dkdv_regs="k")}


@pytest.mark.parametrize("cfg_name", list(BWD_CONFIGS))
@pytest.mark.parametrize("h,kw", LOWER_CASES[:3], ids=lambda x: str(x))
def test_compiled_backward_lowers_for_sm90(h, kw, cfg_name):
  b, t, s, n, kh = 2, 700, 900, 4, 2
  bf = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  q, k, out, do = bf(b, t, n, h), bf(b, s, kh, h), bf(b, t, n, h), bf(b, t, n, h)
  lse = jax.ShapeDtypeStruct((b, n, t), jnp.float32)
  qs = jax.ShapeDtypeStruct((b, t), jnp.int32) if kw.get("segments") else None
  ks = jax.ShapeDtypeStruct((b, s), jnp.int32) if kw.get("segments") else None
  lens = jax.ShapeDtypeStruct((b,), jnp.int32) if kw.get("kv_lengths") else None
  mask_kw = dict(causal=kw.get("causal", False), scale=h ** -0.5, window=kw.get("window"),
                 softcap=kw.get("softcap"))
  q_seg_probe = None if qs is None else jnp.zeros(qs.shape, jnp.int32)
  lens_probe = None if lens is None else jnp.zeros(lens.shape, jnp.int32)
  st_dq, st_dkdv = ops._backward_statics(jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype),
                                         q_seg_probe, lens_probe, cfg=BWD_CONFIGS[cfg_name],
                                         interpret=False, **mask_kw)
  assert st_dq.registers_pv and st_dkdv.registers_pv
  assert st_dq.block_kv == BWD_CONFIGS[cfg_name].bwd_dq_block_kv
  assert ops.dq_smem_bytes(st=st_dq, head_dim=padded_head_dim(h)) <= ops.SMEM_LIMIT_BYTES
  cfg = BWD_CONFIGS[cfg_name]
  fused = ops.fused_dq_served(cfg, st_dkdv, padded_head_dim(h))
  assert fused == ((cfg.bwd_fused_dq or cfg.bwd_dq_writer or cfg.bwd_dq_lag)
                   and padded_head_dim(h) in (64, 128))
  assert st_dkdv.dq_writer == cfg.bwd_dq_writer
  assert st_dkdv.dq_lag == cfg.bwd_dq_lag
  assert st_dq.named_free == st_dkdv.named_free == BWD_CONFIGS[cfg_name].named_free
  assert st_dq.defer_wait == st_dkdv.defer_wait == BWD_CONFIGS[cfg_name].bwd_defer_wait
  assert st_dq.consumer_registers == st_dkdv.consumer_registers == cfg.bwd_registers
  assert st_dkdv.pt_smem == BWD_CONFIGS[cfg_name].bwd_pt_smem
  assert st_dq.qdo_regs == cfg.bwd_dq_regs and st_dkdv.kv_regs == cfg.bwd_dkdv_regs
  assert ops.backward_smem_bytes(st=st_dkdv, head_dim=padded_head_dim(h)) <= ops.SMEM_LIMIT_BYTES
  bwd = functools.partial(ops._backward, st_dq=st_dq, st_dkdv=st_dkdv, hp=padded_head_dim(h),
                          interpret=False, fused_dq=fused)
  # The D pre-pass is a Pallas Triton kernel: its lowering needs a (here abstract) H200.
  dev = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=dev)):
    lowered = jax.jit(bwd).trace(q, k, k, out, lse, do, lse, qs, ks, lens).lower(
        lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert text.count("mosaic_gpu") >= (1 if fused else 2)      # (dQ and) dK/dV kernels
  # Named, so that profiles tell them apart.
  assert "flash_attention_dkdv" in text and ("flash_attention_dq" in text) != fused


@pytest.mark.parametrize("h", [64, 128])
def test_tuned_forward_lowers_without_any_mask(h):
  """No mask and S a multiple of the K/V block: the block range is a compile-time constant."""
  q = jax.ShapeDtypeStruct((2, 256, 4, h), jnp.bfloat16)
  fwd = functools.partial(ops._forward, causal=False, scale=h ** -0.5, window=None, softcap=None,
                          cfg=dataclasses.replace(default_config(head_dim=h, seq_k=256), **TUNED),
                          hp=h, interpret=False)
  text = jax.jit(fwd).trace(q, q, q, None, None, None).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_tuned_forward_uses_named_barriers_and_no_metadata():
  """The named-barrier ping-pong reaches the PTX, and a causal call with computed ranges passes
  no per-tile metadata array to the kernel (q, k, v only)."""
  b, t, n, h = 1, 512, 2, 128
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  fwd = functools.partial(ops._forward, causal=True, scale=h ** -0.5, window=None, softcap=None,
                          cfg=dataclasses.replace(default_config(head_dim=h, seq_k=t), **TUNED),
                          hp=h, interpret=False)
  text = jax.jit(fwd).trace(q, q, q, None, None, None).lower(lowering_platforms=("cuda",)).as_text()
  assert "bar.sync $0, 256" in text and "bar.arrive $0, 256" in text   # two consumers' threads
  call = [line for line in text.splitlines() if "mosaic_gpu" in line and "custom_call" in line]
  assert call and all("tensor<1x4x" not in line for line in call)   # no [B, tiles, 8] record


def test_named_free_releases_slots_on_hardware_barriers():
  """named_free: K/V slot releases are bar.arrive / bar.sync over all three warpgroups' threads
  (384), on top of the ping-pong's 256-thread barriers; without it no 384-thread barrier."""
  b, t, n, h = 1, 512, 2, 128
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)

  def lower(named_free):
    cfg = dataclasses.replace(default_config(head_dim=h, seq_k=t), named_free=named_free)
    fwd = functools.partial(ops._forward, causal=True, scale=h ** -0.5, window=None,
                            softcap=None, cfg=cfg, hp=h, interpret=False)
    return jax.jit(fwd).trace(q, q, q, None, None, None).lower(
        lowering_platforms=("cuda",)).as_text()
  on, off = lower(True), lower(False)
  assert "bar.arrive $0, 384" in on and "bar.sync $0, 384" in on
  assert "bar.sync $0, 256" in on                       # the ping-pong is unchanged
  assert "$0, 384" not in off


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(40, 0), softcap=20.0)],
                         ids=["full", "causal", "window_softcap"])
@pytest.mark.parametrize("b,n", [(2, 3), (1, 5)], ids=["12tiles", "10tiles"])
def test_tuned_persistent_forward_matches_reference_in_interpret_mode(kw, b, n):
  """Persistent launch (3 CTAs in interpret mode over b x n x 2 tiles, so every CTA walks
  several tiles and the K/V ring runs across tile boundaries; 10 tiles leave a partial last
  round, dealt in reverse by the masked "snake" order) with the tuned flags."""
  from pallas_attn import reference
  t, s, kh, h = 200, 260, 1, 64
  keys = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, kh, h), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, kh, h), jnp.bfloat16)
  cfg = Config(block_kv=64, backward="mosaic", **TUNED)
  out = flash_attention(q, k, v, implementation="mosaic", config=cfg, interpret=True, **kw)
  ref = reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                            precision=jax.lax.Precision.HIGHEST, **kw)
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
  assert err < 1e-2, err
  assert ops.INTERPRET_CTAS < b * n * 2                      # really more tiles than CTAs
  if b * n == 5:
    assert (b * n * 2) % ops.INTERPRET_CTAS and (b * n * 2) // ops.INTERPRET_CTAS % 2  # odd, partial


@pytest.mark.parametrize("kw,b,n,block_kv", [
    (dict(causal=True), 2, 3, 64), (dict(causal=True), 1, 5, 64),
    (dict(window=(30, 5), softcap=20.0), 2, 3, 64), (dict(window=(30, 5), softcap=20.0), 1, 5, 64),
    (dict(causal=True), 2, 3, 128)],                    # the masked H = 64 default's blocks
    ids=["causal-12tiles", "causal-10tiles", "window_softcap-12tiles", "window_softcap-10tiles",
         "causal-12tiles-bkv128"])
def test_dynamic_schedule_matches_reference_in_interpret_mode(kw, b, n, block_kv, monkeypatch):
  """Persistent masked forward with the tile queue (schedule.py): the producer publishes each
  CTA's next tile through the two-slot SMEM ring, the consumers take it, and an index past the
  last tile ends all three warpgroups' loops. Interpret mode publishes the round-robin successor
  (no atomics there); the publications are counted to show that the queue really ran."""
  from pallas_attn import reference
  from pallas_attn.mosaic import schedule
  calls = {"publish": 0, "take": 0}

  def counting(name, fn):
    def wrapped(*args, **kwargs):
      calls[name] += 1
      return fn(*args, **kwargs)
    return wrapped
  monkeypatch.setattr(schedule, "publish", counting("publish", schedule.publish))
  monkeypatch.setattr(schedule, "take", counting("take", schedule.take))
  t, s, kh, h = 200, 260, 1, 64
  keys = jax.random.split(jax.random.key(4), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, kh, h), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, kh, h), jnp.bfloat16)
  cfg = Config(block_kv=block_kv, persistent=True, dynamic_schedule=True)
  out = flash_attention(q, k, v, implementation="mosaic", config=cfg, interpret=True, **kw)
  ref = reference.attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                            precision=jax.lax.Precision.HIGHEST, **kw)
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
  assert err < 1e-2, err
  assert calls["publish"] >= 1 and calls["take"] >= 1       # traced into the kernel body
  assert ops.INTERPRET_CTAS < b * n * 2


def test_dynamic_schedule_lowers_with_an_atomic_counter():
  """Compiled form (sm90): the claim is an LLVM atomicrmw on a fresh int32 counter operand;
  without a mask the flag changes nothing (equal tiles keep the static stride)."""
  b, t, n, h = 2, 1000, 4, 128
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)

  def lower(causal):
    cfg = dataclasses.replace(default_config(head_dim=h, seq_k=t, masked=causal),
                              persistent=True, dynamic_schedule=True)
    fwd = functools.partial(ops._forward, causal=causal, scale=h ** -0.5, window=None,
                            softcap=None, cfg=cfg, hp=h, interpret=False)
    return jax.jit(fwd).trace(q, q, q, None, None, None).lower(
        lowering_platforms=("cuda",)).as_text()
  masked, full = lower(True), lower(False)
  assert "llvm.atomicrmw" in masked and "llvm.atomicrmw" not in full
  call = [line for line in masked.splitlines() if "custom_call @mosaic_gpu" in line]
  assert call and "tensor<1xi32>" in call[0]                 # the counter operand


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(30, 5), softcap=20.0)],
                         ids=["causal", "window_softcap"])
def test_backward_tiles_differ_between_dq_and_dkdv_in_interpret_mode(kw):
  """dQ with 128-key steps next to 64-key dK/dV consumers and 3-deep rings: S (here 200) is
  padded to a multiple of both, and the gradients still match the float32 reference."""
  cfg = Config(block_kv=64, bwd_dq_block_kv=128, bwd_num_stages=3, backward="mosaic")
  _assert_grads_match_reference(cfg, kw, b=1, t=150, s=200, n=2, kh=1, h=64, seed=5)


def _assert_grads_match_reference(cfg: Config, kw: dict, *, b, t, s, n, kh, h, seed):
  """out, dq, dk, dv of the Mosaic backend (interpret mode) within 2e-2 of max |ref| of the
  float32 reference, for bf16 random-normal inputs and cotangent and the masks named in ``kw``
  (``harness.grads_against_reference``: segment / kv_lengths flags become 3 equal segments and
  a second batch row of 77 keys)."""
  got, want = H.grads_against_reference(cfg, kw, b=b, t=t, s=s, n=n, kh=kh, h=h, seed=seed)
  for name, x, r in zip(("out", "dq", "dk", "dv"), got, want):
    err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
    assert err < 2e-2, (name, err)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(30, 5), softcap=20.0,
                                                        segments=True, kv_lengths=True),
                                dict()], ids=["causal", "window_softcap_seg_len", "full"])
@pytest.mark.parametrize("h", [128, 64], ids=["h128_split_columns", "h64_alternate_steps"])
@pytest.mark.parametrize("form", ["consumers", "dq_writer", "dq_lag"])
def test_fused_dq_backward_matches_reference_in_interpret_mode(kw, h, form, monkeypatch):
  """``bwd_fused_dq``: dQ from the dK/dV kernel (interpret mode: per-tile partials summed
  outside; compiled: TMA reductions), by the consumers after a rendezvous, (``bwd_dq_writer``)
  by the producer warpgroup, or (``bwd_dq_lag``) by the consumers one step behind. GQA 4:2
  with T, S off the tile (several Q blocks and two group heads per K/V tile, so the lagged
  form's hand-over crosses heads); the separate dQ kernel must not run."""
  from pallas_attn.mosaic import backward_dq

  def no_dq_kernel(*a, **k):
    raise AssertionError("the dQ kernel ran although bwd_fused_dq was served")
  monkeypatch.setattr(backward_dq, "dq_kernel", no_dq_kernel)
  cfg = Config(block_kv=64, bwd_fused_dq=form == "consumers", bwd_dq_writer=form == "dq_writer",
               bwd_dq_lag=form == "dq_lag", backward="mosaic")
  _assert_grads_match_reference(cfg, kw, b=2, t=150, s=200, n=4, kh=2, h=h, seed=7)


@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "fused_dq"])
def test_causal_grad_lowers_for_sm90_under_a_mesh_context(fused):
  """Forward + backward through the custom VJP, lowered inside a mesh context (as in a sharded
  training step). Regression: ``zeros_like`` in the in-kernel block-range maths emitted a
  ``reshard`` of a literal under a mesh, which the Mosaic GPU lowering rejected."""
  b, t, n, h = 2, 1024, 4, 128
  q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
  cfg = Config(bwd_fused_dq=fused)

  def loss(q, k, v):
    out, _ = ops._attention(q, k, v, None, None, None, True, h ** -0.5, None, None, cfg, h, False)
    return out.astype(jnp.float32).sum()
  dev = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=dev)):
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, q, q).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("interpret", [False, True])
def test_persistent_launch_with_256_key_blocks_runs_the_grid_when_compiled(interpret, launched):
  """Compiled, the persistent loop with 256-key blocks hung on the H200 (H = 64); the grid runs
  instead (compiled and interpreted alike); 128-key blocks keep the persistent launch."""
  q = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)
  for block_kv, expect in ((256, False), (128, True)):
    cfg = Config(block_kv=block_kv, persistent=True)
    fwd = functools.partial(ops._forward, causal=False, scale=0.125, window=None, softcap=None,
                            cfg=cfg, hp=64, interpret=interpret)
    launched.clear()
    traced = jax.jit(fwd).trace(q, q, q, None, None, None)
    if not interpret:
      traced.lower(lowering_platforms=("cuda",))
    assert launched and launched[-1].persistent == expect, (block_kv, interpret)



@pytest.mark.parametrize("consumer,writer", [(232, False), (240, False), (224, True), (232, True)])
def test_backward_register_split_fits_the_launch_pool(consumer, writer):
  """setmaxnreg moves registers inside the launch allocation (168 a thread at 384 threads): an
  increase that the pool cannot grant blocks forever, so 2 consumers + the producer must fit."""
  from pallas_attn.mosaic import backward
  st = ops._backward_statics(jnp.zeros((1, 128, 2, 128), jnp.bfloat16),
                             jnp.zeros((1, 128, 2, 128), jnp.bfloat16), None, None,
                             causal=False, scale=1.0, window=None, softcap=None,
                             cfg=Config(bwd_registers=consumer, bwd_dq_writer=writer),
                             interpret=False)[1]
  producer = backward.producer_registers(st)
  assert producer % 8 == 0 and producer >= 24
  consumer = st.consumer_registers
  assert 2 * consumer + producer <= 3 * backward.LAUNCH_REGISTERS == 3 * (65536 // 384 // 8 * 8)
  if writer:     # the dQ writer takes all that is left (its [64, 64] fp32 accumulator: 32)
    assert producer == 3 * backward.LAUNCH_REGISTERS - 2 * consumer


def test_one_sequence_takes_232_registers(monkeypatch):
  """Session 42 (H100, benchmarks/NOTES.md): with batch 1 the dK/dV kernel's step loop is
  another (the batch index is a constant), and at 232 registers it ran 13% fewer cycles than at
  240; with batch >= 2, 240 stays 4-6% faster. Only the unmasked H = 128 grid kernels change,
  and ``attention`` passes the call's batch."""
  one = default_config(head_dim=128, seq_k=16384, batch=1)
  assert one.bwd_registers == 232
  assert dataclasses.replace(one, bwd_registers=240) == default_config(head_dim=128, seq_k=16384)
  for kw in (dict(batch=2), dict(batch=None), dict(batch=1, masked=True),
             dict(batch=1, key_masks=True)):
    assert default_config(head_dim=128, seq_k=16384, **kw).bwd_registers == 240, kw
  for h, s in ((64, 16384), (256, 4096), (128, 1024)):     # other forms: batch changes nothing
    assert default_config(head_dim=h, seq_k=s, batch=1) == default_config(head_dim=h, seq_k=s)
  choose = H.chosen_config(monkeypatch)
  for b, want in ((1, 232), (2, 240)):
    assert choose(jnp.zeros((b, 2048, 2, 128), jnp.bfloat16)).bwd_registers == want

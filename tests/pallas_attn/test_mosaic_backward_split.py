"""The Mosaic backward at head dims over 128 (``pallas_attn/mosaic/backward_split.py``).

At H = 256 the dK/dV consumers split the work by role (dV side: S^T, P^T, dV; dK side: dP^T,
dS^T, dK, with P^T handed over in float16) and the dQ kernel's ring has two K slots and one V
slot compiled (one each in interpret mode, where dS goes through SMEM). Before session 16 such
calls ran the Triton FA2 backward; now ``default_config`` picks this form over 128. Interpret
mode against the float32 reference on CPU; the compiled form is lowered for sm90 here and runs
on the GPU in the shared suite's grid.
"""

import jax
import jax.numpy as jnp
import pytest
from jax._src import mesh as mesh_lib

import harness as H
from pallas_attn import flash_attention
from pallas_attn.mosaic import Config, backward, backward_dq, backward_split, default_config, ops


@pytest.mark.parametrize("kw,h", [(dict(causal=True, softcap=20.0), 256),
                                  (dict(window=(40, 9), segments=True, kv_lengths=True), 256),
                                  (dict(), 256), (dict(causal=True), 200),
                                  (dict(causal=True), 160)],
                         ids=["causal_softcap", "window_seg_len", "full", "h200_padded_causal",
                              "h160_padded_to_192"])
def test_split_backward_matches_reference_in_interpret_mode(kw, h, monkeypatch):
  """GQA 4:2, T and S off the tiles (several Q blocks and both group heads per K/V tile). The
  split dK/dV kernel and the one-stage dQ kernel must be the ones that run."""
  seen = {}

  def spy(name, fn):
    def wrapped(*args, **kwargs):
      seen[name] = kwargs["st"]
      return fn(*args, **kwargs)
    return wrapped
  monkeypatch.setattr(backward_split, "dkdv_split_kernel",
                      spy("split", backward_split.dkdv_split_kernel))
  monkeypatch.setattr(backward_dq, "dq_kernel", spy("dq", backward_dq.dq_kernel))
  cfg = Config(block_kv=64, backward="mosaic", bwd_split_dkdv=True)
  # One batch row unless kv_lengths cuts the second (the interpreter's time grows with b).
  b = 2 if kw.get("kv_lengths") else 1
  got, want = H.grads_against_reference(cfg, kw, b=b, t=150, s=200, n=4, kh=2, h=h, seed=11)
  assert set(seen) == {"split", "dq"}
  # (padded to 256 one dQ stage fits next to Q and dO in interpret mode; padded to 192, two)
  assert seen["dq"].num_stages == (1 if h > 192 else 2) and seen["split"].block_kv == 64
  for name, x, r in zip(("out", "dq", "dk", "dv"), got, want):
    err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
    assert err < 2e-2, (name, err)


def test_routing_by_shared_memory():
  """H = 256: the per-consumer dK/dV tiles overflow shared memory, the split ones fit; H = 128
  keeps the two-consumer kernel. ``backward="triton"`` still chooses the FA2 kernels."""
  def statics(h):
    return ops._backward_statics(jnp.zeros((1, 256, 2, h), jnp.bfloat16),
                                 jnp.zeros((1, 256, 2, h), jnp.bfloat16), None, None,
                                 causal=True, scale=1.0, window=None, softcap=None,
                                 cfg=Config(), interpret=False)
  st_dq, st_dkdv = statics(256)
  assert ops.backward_smem_bytes(st=st_dkdv, head_dim=256) > ops.SMEM_LIMIT_BYTES
  assert backward_split.split_smem_bytes(st=st_dkdv, head_dim=256) <= ops.SMEM_LIMIT_BYTES
  assert st_dq.block_kv == 64 and (st_dq.num_stages, st_dq.v_ring) == (2, 1)
  assert ops.dq_smem_bytes(st=st_dq, head_dim=256) <= ops.SMEM_LIMIT_BYTES
  st_dq, st_dkdv = statics(128)
  assert ops.backward_smem_bytes(st=st_dkdv, head_dim=128) <= ops.SMEM_LIMIT_BYTES
  assert st_dq.num_stages == 2


def test_split_is_the_default_over_128():
  """Measured on the H200 (session 16: 1.04x / 1.02x cuDNN fwd+bwd at 4x4096x8x256), the split
  backward is ``default_config``'s choice for padded head dims over 128, with the serial dQ
  order and no register Q / dO there; H <= 128 keeps the two-consumer kernels."""
  wide = default_config(head_dim=256, seq_k=4096)
  assert wide.bwd_split_dkdv and wide.bwd_dq_serial and not wide.bwd_dq_regs
  assert wide.bwd_registers == 240 and wide.backward == "mosaic"
  for h in (64, 128):
    cfg = default_config(head_dim=h, seq_k=4096)
    assert not cfg.bwd_split_dkdv and not cfg.bwd_dq_serial and cfg.bwd_dq_regs
    # 240 at H = 128 on the grid kernels (session 29); the persistent ones and H = 64 keep 232.
    assert cfg.bwd_registers == (240 if h == 128 else 232)
  assert default_config(head_dim=128, seq_k=1024).bwd_registers == 232
  assert default_config(head_dim=128, seq_k=1024, masked=True).bwd_registers == 240


@pytest.mark.parametrize("cfg", [Config(block_kv=64), Config(block_kv=64, backward="triton",
                                                               bwd_split_dkdv=True)],
                         ids=["plain_config", "triton_chosen"])
def test_h256_backward_runs_triton_unless_split_asked(cfg, monkeypatch):
  """A Config without ``bwd_split_dkdv`` (the field's own default stays False, as for every
  opt-in form) and ``backward="triton"`` still give H = 256 gradients from the FA2 kernels."""
  called = []
  real = ops.triton_ops.backward
  monkeypatch.setattr(ops.triton_ops, "backward",
                      lambda *a, **k: called.append(1) or real(*a, **k))
  q = jax.random.normal(jax.random.key(0), (1, 40, 2, 256), jnp.bfloat16)
  f = lambda q: flash_attention(q, q, q, implementation="mosaic", interpret=True,
                                config=cfg).astype(jnp.float32).sum()
  jax.grad(f)(q)
  assert called


@pytest.mark.parametrize("kw,h", [(dict(causal=True, kv_lengths=True), 256),
                                  (dict(window=(100, 0), softcap=30.0, segments=True), 256),
                                  (dict(causal=True), 192)],
                         ids=["causal_len", "window_softcap_seg", "h192_causal"])
def test_split_backward_lowers_for_sm90(kw, h, monkeypatch):
  """The compiled forward + backward (``ops._attention``'s custom VJP) at H = 256 and 192 with
  the split dK/dV kernel, lowered for sm90 on CPU: the two backward kernels are there, no Triton
  backward. At 192 the per-consumer dK/dV tiles fit in shared memory, but not in registers
  (ptxas: ~500 B spilled, wgmmas serialised), so the split form must be chosen there too; and
  the Triton D pre-pass must lower at a head dim that is not a power of two (session 31: it
  did not, so every H = 129..192 gradient failed to compile)."""
  monkeypatch.setattr(ops.triton_ops, "backward", None)          # must not be reached
  used = []
  real_split = backward_split.dkdv_split_kernel
  monkeypatch.setattr(backward_split, "dkdv_split_kernel",
                      lambda *a, **k: used.append(1) or real_split(*a, **k))
  b, t, s, n, kh = 2, 700, 900, 4, 2
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
  k, v = (jax.random.normal(x, (b, s, kh, h), jnp.bfloat16) for x in keys[1:])
  seg = (jnp.arange(t)[None] * 3 // t).repeat(b, 0) if kw.get("segments") else None
  kseg = (jnp.arange(s)[None] * 3 // s).repeat(b, 0) if kw.get("segments") else None
  lens = jnp.array([s, 500], jnp.int32) if kw.get("kv_lengths") else None
  cfg = Config(block_kv=64, bwd_split_dkdv=True)

  def loss(q, k, v):
    out, _ = ops._attention(q, k, v, seg, kseg, lens, kw.get("causal", False), h ** -0.5,
                            kw.get("window"), kw.get("softcap"), cfg, h, False)
    return out.astype(jnp.float32).sum()
  # The D pre-pass is a Pallas Triton kernel: its lowering needs a (here abstract) H200.
  dev = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=dev)):
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "flash_attention_dkdv" in text and "flash_attention_dq" in text
  assert used


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    H.Case(t=1000, s=1100, h=256, n=4, kh=2, causal=True, seed=401),
    H.Case(t=600, s=900, h=256, n=4, kh=2, window=(100, 20), softcap=30.0, segments=2,
           kv_lengths=(900, 555), seed=402),
    H.Case(t=513, s=700, h=200, n=2, kh=1, dtype="float16", seed=403),
    H.Case(t=700, s=900, h=160, n=4, kh=2, causal=True, seed=404),      # padded to 192
], ids=lambda c: c.id)
def test_split_backward_compiled(case):
  """Compiled on the GPU: the split form passes the ratio rule (TESTING.md) on out, lse and
  the gradients. Run this before turning ``bwd_split_dkdv`` on by default."""
  H.check_mosaic_default_with(case, bwd_split_dkdv=True)

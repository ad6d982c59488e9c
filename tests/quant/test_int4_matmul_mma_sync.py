"""The W4A16 decode step with warp-level ``mma.sync`` (``MosaicConfig.mma_sync``, ``mma_sync.py``).

The inline PTX cannot run in the Mosaic GPU interpreter, so on CPU: the index maths of x's
fragment order against a model of what each thread loads (its b0 / b1 registers must be
x[g, 16j + 2t ..] and x[g, 16j + 2t + 8 ..], the loads of a quarter-warp on distinct banks), the
config's rules, the kernels in interpret mode with the product emulated from the same
fragment-ordered buffer (grid and stream-K, against the reference: a wrong permutation fails
them), and the sm90 lowering (the kernel's MLIR holds mma.sync and no wgmma). Compiled runs
against the reference: GPU only.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quant.matmul import layout, mma_sync
from quant.matmul import mosaic as w4_mosaic
from quant.matmul.config import MosaicConfig, mosaic_smem_bytes
from test_int4_matmul_mosaic import BF16, _abstract_weight, _h200
from test_int4_matmul_triton import _check, _weight, _x

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import mosaic_mlir  # noqa: E402  pylint: disable=wrong-import-position

pytestmark = pytest.mark.timeout(300, method="thread")


@pytest.mark.parametrize("span2", mma_sync.SPANS)
def test_fragment_order_gives_each_thread_its_b_registers(span2):
  rng = np.random.default_rng(span2)
  x = rng.standard_normal((8, span2)).astype(np.float32)
  stored = np.asarray(mma_sync.permute_planes(jnp.asarray(x)[None]))[0]
  assert stored.shape == (8, mma_sync.pitch(span2))
  # The XLA transpose and the spec the emulated product undoes are the same permutation.
  cols = np.asarray(mma_sync.permute_planes(jnp.arange(span2)[None, None]))[0, 0, :span2]
  np.testing.assert_array_equal(cols, mma_sync.source_columns(span2))
  flat = stored.reshape(-1)
  for g in range(8):
    for t in range(4):
      words = []                                   # the kernel's 32-bit words, in load order
      for off in mma_sync.thread_chunk_offsets(span2, g, t):
        chunk = flat[off:off + 8]
        words += [chunk[2 * i:2 * i + 2] for i in range(4)]
      for j in range(span2 // 16):
        np.testing.assert_array_equal(words[2 * j], x[g, 16 * j + 2 * t:16 * j + 2 * t + 2])
        np.testing.assert_array_equal(words[2 * j + 1],
                                      x[g, 16 * j + 2 * t + 8:16 * j + 2 * t + 10])


@pytest.mark.parametrize("span2", mma_sync.SPANS)
def test_quarter_warp_loads_hit_distinct_banks(span2):
  """A warp's 16-byte loads run as four phases of 8 lanes; in each, the 8 chunks (4 banks
  each) must cover 32 different banks."""
  for v in range(span2 // 32):
    for phase in range(4):
      banks = []
      for lane in range(8 * phase, 8 * phase + 8):
        g, t = lane // 4, lane % 4
        byte = 2 * mma_sync.thread_chunk_offsets(span2, g, t)[v]
        banks += [(byte // 4 + i) % 32 for i in range(4)]
      assert len(set(banks)) == 32, (v, phase, sorted(banks))


def test_config_rules():
  # Ignored (not an error) with the planes through SMEM, so that replacing registers_a on a
  # default that has mma_sync stays valid; no padded ring is counted then.
  staged = MosaicConfig(block_n=64, block_k=512, num_stages=4, registers_a=False)
  assert mosaic_smem_bytes(dataclasses.replace(staged, mma_sync=True), m=1, asym=True) == (
      mosaic_smem_bytes(staged, m=1, asym=True))
  base = MosaicConfig(block_n=64, block_k=512, num_stages=4)
  padded = MosaicConfig(block_n=64, block_k=512, num_stages=4, mma_sync=True)
  grow = mosaic_smem_bytes(padded, m=1, asym=True) - mosaic_smem_bytes(base, m=1, asym=True)
  assert grow == 4 * 4 * 8 * mma_sync.PAD * 2                 # stages x planes x rows x pad
  with pytest.raises(ValueError, match="span2"):
    mma_sync.source_columns(32)


# (m, k, n, group_size, sym, block_k, block_n, stream_ctas): grid and stream-K, both plane
# widths, short / long groups, per-channel, symmetric, two warpgroups.
INTERPRET_CASES = [
    (1, 1024, 192, 128, False, 512, 64, 0),
    (16, 1024, 128, 64, True, 256, 64, 0),        # m_pad 16: two n8 chains
    (3, 2048, 128, 1024, False, 256, 128, 0),
    (5, 1024, 192, 128, False, 256, 64, 5),
    (2, 520, 70, -1, False, 256, 64, 0),
]


@pytest.mark.parametrize("m,k,n,group_size,sym,block_k,block_n,ctas", INTERPRET_CASES,
                         ids=[f"m{c[0]}_k{c[1]}_g{c[3]}_bk{c[5]}_wg{c[6] // 64}_c{c[7]}"
                              for c in INTERPRET_CASES])
def test_interpret_mode_emulates_the_product(monkeypatch, m, k, n, group_size, sym, block_k,
                                             block_n, ctas):
  """Interpret mode (no PTX) runs the form's x permutation, padded x ring and plumbing with the
  product emulated from the fragment-ordered buffer: the result meets the reference."""
  calls = []
  product = mma_sync.plane_product
  monkeypatch.setattr(mma_sync, "plane_product",
                      lambda *a, **kw: (calls.append(kw.get("emulate")), product(*a, **kw))[1])
  qw = _weight(k, n, group_size=group_size, sym=sym, act_order=False)
  x = _x(m, k, BF16, seed=m)
  b = _x(1, n, BF16, seed=4)[0]
  mw = layout.prepare_mosaic(qw, block_k=block_k)
  cfg = MosaicConfig(block_n=block_n, block_k=block_k, num_stages=2, stream_ctas=ctas,
                     mma_sync=True)
  jax.clear_caches()
  _check(w4_mosaic.int4_matmul(x, mw, bias=b, config=cfg, interpret=True), x, qw, b)
  assert calls and all(calls)


@pytest.mark.parametrize("m,block_k,group_size,sym,stream", [
    (1, 512, 128, False, 0), (8, 256, 128, True, 0), (3, 256, 1024, False, 0),
    (1, 512, 128, False, 12), (5, 256, -1, False, 7), (16, 512, 128, False, 12)],
    ids=["m1_bk512", "m8_sym", "long_groups", "stream", "stream_per_channel", "m16_stream"])
def test_lowering_runs_mma_sync_not_wgmma(m, block_k, group_size, sym, stream):
  if jax.default_backend() == "gpu":
    pytest.skip("compiled GPU runs exercise the real lowering")
  k, n = 2048, 256
  qw = _abstract_weight(k, n, group_size=group_size, sym=sym, act_order=False)
  mw = jax.eval_shape(lambda qw: layout.prepare_mosaic(qw, block_k=block_k), qw)
  texts = {}
  for flag in (False, True):
    cfg = MosaicConfig(block_n=64, block_k=block_k, num_stages=2, stream_ctas=stream,
                       mma_sync=flag)
    f = lambda x, mw, cfg=cfg: w4_mosaic.int4_matmul(x, mw, config=cfg, interpret=False)
    jax.clear_caches()
    with _h200():
      low = jax.jit(f).trace(jax.ShapeDtypeStruct((m, k), BF16), mw).lower(
          lowering_platforms=("cuda",))
    texts[flag] = "\n".join(mosaic_mlir.kernel_texts(low))
  assert "wgmma" in texts[False] and "mma.sync" not in texts[False]
  assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in texts[True]
  assert "wgmma.mma_async" not in texts[True]


def test_more_than_sixteen_rows_keep_wgmma():
  k, n = 1024, 128
  qw = _abstract_weight(k, n, group_size=128, sym=False, act_order=False)
  mw = jax.eval_shape(lambda qw: layout.prepare_mosaic(qw, block_k=256), qw)
  cfg = MosaicConfig(block_n=64, block_k=256, num_stages=2, mma_sync=True)
  f = lambda x, mw: w4_mosaic.int4_matmul(x, mw, config=cfg, interpret=False)
  jax.clear_caches()
  with _h200():
    low = jax.jit(f).trace(jax.ShapeDtypeStruct((17, k), BF16), mw).lower(
        lowering_platforms=("cuda",))
  text = "\n".join(mosaic_mlir.kernel_texts(low))
  assert "mma.sync" not in text and "wgmma" in text


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,group_size,sym,block_k,stream,dtype,block_n", [
    (1, 4096, 1024, 128, False, 512, 0, BF16, 64), (8, 2048, 640, 64, True, 256, 0, BF16, 64),
    (3, 4096, 1024, 512, False, 256, 40, BF16, 64),
    (1, 2048, 512, -1, False, 512, 0, jnp.float16, 64),
    (5, 8192, 2048, 128, False, 512, 132, BF16, 64),
    (16, 4096, 1024, 128, False, 512, 0, BF16, 64), (13, 2048, 640, 64, True, 256, 0, BF16, 128),
    (16, 8192, 4096, 128, False, 512, 132, BF16, 256)],
    ids=["decode_bk512", "m8_sym_g64", "stream_long_groups", "f16_per_channel", "stream_g128",
         "m16_bk512", "m13_sym_g64_wg2", "m16_stream_wg4"])
def test_compiled_mma_sync_matches_reference(m, k, n, group_size, sym, block_k, stream, dtype,
                                             block_n):
  """Compiled (H200): the mma.sync form against ``x @ dequantize(qw)`` (TESTING.md's rule, as
  every W4A16 test)."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  qw = _weight(k, n, group_size=group_size, sym=sym, act_order=False)
  x = _x(m, k, dtype, seed=m)
  b = _x(1, n, dtype, seed=4)[0]
  mw = layout.prepare_mosaic(qw, block_k=block_k)
  cfg = MosaicConfig(block_n=block_n, block_k=block_k, num_stages=4 if block_n < 256 else 2,
                     stream_ctas=stream, mma_sync=True)
  _check(w4_mosaic.int4_matmul(x, mw, bias=b, interpret=False, config=cfg), x, qw, b)

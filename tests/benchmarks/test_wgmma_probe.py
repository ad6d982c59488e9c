"""``benchmarks/wgmma_probe.py``: the skinny-wgmma throughput probe is right before it is timed.

CPU: the SMEM-operand form in Mosaic GPU interpret mode (the interpreter has no register
operands) gives every output element ``steps * 4 * sum_k w x``; the register-operand form, which
the H200 runs, lowers for sm90 at every N the probe times.
"""
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import wgmma_probe as W  # noqa: E402  pylint: disable=wrong-import-position


def test_interpret_mode_sums_every_step():
  n, ctas, steps = 8, 2, 3
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.integers(-4, 5, (n, W.SPAN)), jnp.bfloat16)
  w = jnp.asarray(rng.integers(-4, 5, (W.ROWS, W.SPAN)), jnp.bfloat16)
  got = W.wgmma_loop(x, w, n=n, ctas=ctas, steps=steps, a_in_registers=True, interpret=True)
  want = steps * W.PLANES * (np.asarray(w, np.float32) @ np.asarray(x, np.float32).T)
  np.testing.assert_array_equal(np.asarray(got), np.tile(want, (ctas, 1)))


@pytest.mark.parametrize("n", [8, 64, 256])
@pytest.mark.parametrize("regs", [True, False], ids=["reg", "smem"])
def test_lowers_for_sm90(n, regs):
  x = jax.ShapeDtypeStruct((n, W.SPAN), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((W.ROWS, W.SPAN), jnp.bfloat16)
  fn = lambda x, w: W.wgmma_loop(x, w, n=n, ctas=132, steps=16, a_in_registers=regs)
  text = jax.jit(fn).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
  assert f"wgmma_probe_n{n}" in text


def test_variants_cover_the_decode_shape():
  names = [v[0] for v in W.variants(16)]
  assert "n8_c264_reg" in names and "n256_c132_reg" in names
  assert W.step_flops(8) == 2 * 64 * 8 * 128 * 4


def test_mma_sync_form_lowers_with_its_instructions():
  """The mma.sync form (inline PTX: the Mosaic GPU interpreter cannot run it) lowers for sm90
  with 32 mma.sync per step (4 planes x 8 k16 steps) and the variants list carries it."""
  import mosaic_mlir  # noqa: E402  pylint: disable=import-outside-toplevel
  low = jax.jit(lambda: W.mma_sync_loop(ctas=132, steps=16)).trace().lower(
      lowering_platforms=("cuda",))
  text = mosaic_mlir.kernel_texts(low)[0]
  assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 32
  names = {v[0]: v for v in W.variants(16)}
  assert names["mmasync_n8_c264"][4] == 16 * 4 * 128 * 0.5

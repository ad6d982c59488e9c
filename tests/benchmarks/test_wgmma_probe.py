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

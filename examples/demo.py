"""End-to-end tour: `make demo`.

On CPU (8 simulated devices) the Pallas kernels run in interpret mode on small shapes; on a GPU the
same code runs the compiled kernels. Each section prints what it checked and how long it took.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import pallas_attn  # noqa: E402
from examples.gpt import GPT, GPTConfig, next_token_loss  # noqa: E402


def section(title: str):
  print(f"\n== {title} ==", flush=True)


def attention_tour():
  section("1. Attention: a Flax NNX GPT with our flash attention vs the reference")
  on_gpu = jax.default_backend() == "gpu"
  impl = None if on_gpu else "triton"          # CPU: the Triton kernel in interpret mode
  cfg = GPTConfig(vocab=256, d_model=128, n_heads=4, n_kv_heads=2, n_layers=2, max_len=128)
  ours = lambda q, k, v, *, causal: pallas_attn.flash_attention(q, k, v, causal=causal,
                                                                implementation=impl)
  ref = lambda q, k, v, *, causal: pallas_attn.flash_attention(q, k, v, causal=causal,
                                                               implementation="xla")
  tokens = jax.random.randint(jax.random.key(0), (2, 97), 0, 256)
  results = {}
  for name, fn in (("ours", ours), ("reference", ref)):
    model = GPT(cfg, rngs=nnx.Rngs(0), attention_fn=fn)
    t0 = time.perf_counter()
    loss, grads = nnx.value_and_grad(next_token_loss)(model, tokens)
    jax.block_until_ready(grads)
    results[name] = (loss, jax.tree.leaves(nnx.state(grads)), time.perf_counter() - t0)
  (l1, g1, t1), (l2, g2, t2) = results["ours"], results["reference"]
  gerr = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(g1, g2))
  print(f"backend: {'compiled on ' + jax.devices()[0].device_kind if on_gpu else 'triton, interpret mode (CPU)'}")
  print(f"loss ours {float(l1):.6f}  reference {float(l2):.6f}  |diff| {abs(float(l1 - l2)):.2e}")
  print(f"max |grad diff| over {len(g1)} parameters: {gerr:.2e}")
  print(f"time (loss + grads, incl. compile): ours {t1:.1f}s, reference {t2:.1f}s")
  assert abs(float(l1 - l2)) < 1e-4 and gerr < 1e-4, "attention disagrees with the reference"

  q = jax.random.normal(jax.random.key(1), (2, 200, 6, 64), jnp.float32)
  k, v = (jax.random.normal(jax.random.key(i), (2, 300, 2, 64), jnp.float32) for i in (2, 3))
  seg_q = jnp.repeat(jnp.array([[0, 1]]), 100, axis=1).repeat(2, 0)
  seg_k = jnp.repeat(jnp.array([[0, 1]]), 150, axis=1).repeat(2, 0)
  kw = dict(causal=True, window=(64, 0), softcap=30.0, q_segment_ids=seg_q, kv_segment_ids=seg_k,
            kv_lengths=jnp.array([300, 220]), return_lse=True)
  t0 = time.perf_counter()
  out, lse = pallas_attn.flash_attention(q, k, v, implementation=impl, **kw)
  dt = time.perf_counter() - t0
  ref_out, ref_lse = pallas_attn.flash_attention(q, k, v, implementation="xla", **kw)
  print(f"GQA 6:2, causal + window + softcap + packed sequences + kv_lengths: "
        f"max |out diff| {float(jnp.max(jnp.abs(out - ref_out))):.2e}, "
        f"lse finite-pattern equal: {bool(np.array_equal(np.isfinite(lse), np.isfinite(ref_lse)))} "
        f"({dt:.1f}s)")


def main():
  t0 = time.perf_counter()
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices")
  attention_tour()
  for name in ("quant_tour", "parallel_tour"):
    tour = globals().get(name)
    if tour is not None:
      tour()
  print(f"\nDemo finished in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
  main()

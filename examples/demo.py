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

  # FP8 forward (inference): e4m3 inputs with per-token scales after a Hadamard rotation. On a
  # Hopper GPU the Mosaic kernel runs both matmuls in FP8; on CPU its xla semantics run.
  kw8 = {key: val for key, val in kw.items() if key != "return_lse"}
  out8 = pallas_attn.flash_attention_fp8(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                                         v.astype(jnp.bfloat16), **kw8)
  rel = float(jnp.abs(out8 - ref_out).mean() / jnp.abs(ref_out).mean())
  print(f"FP8 forward, same masks: mean |out diff| / mean |out| {rel:.3f} (e4m3: ~3-5%)")
  assert rel < 0.08, "FP8 attention is further from the reference than e4m3 explains"
  # K and V quantised once and reused (a prompt's cache, cross-attention's memory): only Q is
  # quantised per call, and the result is the one-call form's, bit for bit.
  kv = pallas_attn.quantize_kv(k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                               kv_lengths=kw8["kv_lengths"])
  out_kv = pallas_attn.flash_attention_fp8_kv(q.astype(jnp.bfloat16), kv, **kw8)
  same = bool(jnp.array_equal(out_kv, out8))
  print(f"FP8 with K/V quantised once (quantize_kv + flash_attention_fp8_kv): "
        f"bitwise the one-call output: {same}")
  assert same, "flash_attention_fp8_kv differs from flash_attention_fp8 on the same inputs"


def quant_tour():
  section("2. 4-bit weights: RTN vs GPTQ vs AWQ on one layer, then the fused int4 matmul")
  import quant
  from quant import calibration

  k_in, n_out = 512, 256
  keys = jax.random.split(jax.random.key(3), 3)
  # Correlated, outlier-heavy activations (as in real LLM layers) make the Hessian matter.
  mix = jax.random.normal(keys[0], (k_in, k_in)) / k_in ** 0.5 + jnp.eye(k_in)
  x = jax.random.normal(keys[1], (4096, k_in)) @ mix
  x = x * (1 + 4 * (jnp.arange(k_in) % 61 == 0))
  w = jax.random.normal(keys[2], (k_in, n_out)) * 0.02
  t0 = time.perf_counter()
  stats = calibration.from_batches(jnp.split(x, 4))
  h, act = calibration.hessian(stats), calibration.mean_abs(stats)
  errs = {}
  ref = x @ w
  for name, qw in (("rtn", quant.rtn(w, bits=4, group_size=128)),
                   ("gptq", quant.gptq(w, h, bits=4, group_size=128).qweight),
                   ("gptq+act_order", quant.gptq(w, h, bits=4, group_size=128,
                                                 act_order=True).qweight)):
    errs[name] = float(jnp.linalg.norm(x @ quant.dequantize(qw) - ref) / jnp.linalg.norm(ref))
  res = quant.awq(w, h, act, bits=4, group_size=128)
  errs["awq"] = float(jnp.linalg.norm((x / res.scale) @ quant.dequantize(res.qweight) - ref)
                      / jnp.linalg.norm(ref))
  print("relative output error ||X (W - Q)|| / ||X W||, 4-bit g128:")
  for name, e in errs.items():
    print(f"  {name:15s} {e:.4f}")
  assert errs["gptq"] < errs["rtn"] and errs["awq"] < errs["rtn"]
  qw = quant.gptq(w, h, bits=4, group_size=128).qweight
  impl = None if jax.default_backend() == "gpu" else "triton"
  xb = x[:16].astype(jnp.bfloat16)
  y = quant.int4_matmul(xb, qw, implementation=impl)
  y_ref = xb.astype(jnp.float32) @ quant.dequantize(qw)
  rel = float(jnp.mean(jnp.abs(y.astype(jnp.float32) - y_ref)) / jnp.mean(jnp.abs(y_ref)))
  print(f"int4_matmul ({impl or 'auto'}) vs x @ dequantize(qw): mean relative error {rel:.1e}")
  # Hopper decode: the weight prepared once in the Mosaic kernel's layout (QuantLinear does this
  # by default on Hopper); on CPU the Mosaic GPU kernel runs in interpret mode.
  from quant.matmul import layout
  mw = layout.prepare_mosaic(qw)
  impl_m = None if jax.default_backend() == "gpu" else "mosaic"
  y_m = quant.int4_matmul(xb, mw, implementation=impl_m)
  rel_m = float(jnp.mean(jnp.abs(y_m.astype(jnp.float32) - y_ref)) / jnp.mean(jnp.abs(y_ref)))
  print(f"int4_matmul on the prepared (Mosaic layout) weight ({impl_m or 'auto'}): mean relative "
        f"error {rel_m:.1e} ({time.perf_counter() - t0:.1f}s for the section)")
  assert rel < 1e-2 and rel_m < 1e-2


def parallel_tour():
  section("3. 3D parallelism: the same GPT trained on (data=2, fsdp=2, tensor=2) and on 1 device")
  import optax
  import parallel

  if jax.device_count() < 8:
    print(f"skipped: needs 8 devices, found {jax.device_count()}")
    return
  cfg = GPTConfig(vocab=64, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, max_len=64)
  tokens = jax.random.randint(jax.random.key(4), (8, 33), 0, 64)
  attn = lambda q, k, v, *, causal: pallas_attn.flash_attention(q, k, v, causal=causal,
                                                                implementation="xla")
  losses = {}
  t0 = time.perf_counter()
  for name, mesh in (("1 device", parallel.make_mesh(devices=jax.devices()[:1])),
                     ("data=2 fsdp=2 tensor=2", parallel.make_mesh(data=2, fsdp=2, tensor=2))):
    model = GPT(cfg, rngs=nnx.Rngs(0), attention_fn=attn)
    step = parallel.make_train_step(model, optax.sgd(0.1), next_token_loss, mesh=mesh,
                                    rules=parallel.rules.FSDP_TP)
    state = step.init(model)
    trace = []
    for _ in range(3):
      state, metrics = step(state, tokens)
      trace.append(float(metrics["loss"]))
    losses[name] = trace
    print(f"  {name:24s} losses {['%.6f' % l for l in trace]}")
  diff = max(abs(a - b) for a, b in zip(*losses.values()))
  print(f"max |loss difference| over 3 steps: {diff:.1e} ({time.perf_counter() - t0:.1f}s)")
  assert diff < 1e-4


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

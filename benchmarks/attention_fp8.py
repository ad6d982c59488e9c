"""FP8 attention forward: ours (Mosaic GPU, e4m3) against our bf16 forward and cuDNN's bf16 and
FP8 forwards, in one process, on the forward rows of the FA3 grid (../shared/BENCHMARKS.md).

Implementations, each jit-compiled on bf16 random-normal q, k, v [B, T, N, H]:

* ``fp8-kernel``: ``pallas_attn.mosaic.fp8.attention`` on inputs quantised beforehand (per-token
  Q scales, one K scale per 256 keys after the Hadamard rotation, per-channel V), P through
  SMEM (``fp8_p_registers=False``): the kernel and V's output scaling;
* ``fp8-kernel-preg``: the same with ``Config.fp8_p_registers`` (P as a register operand);
* ``fp8-kernel+field=value+...``: ``fp8-kernel`` with those Config fields changed (a sweep, e.g.
  ``fp8-kernel+fp8_p_registers=True+exp2_poly_cols=32``); ``k_scale_block=1`` there quantises
  K per key instead (before session 25 the only form);
* ``fp8``: ``pallas_attn.flash_attention_fp8`` end to end (the quantisation pass included);
  ``fp8-kb1``: the same with a scale per key; ``fp8-fused`` / ``fp8-xla``: with
  ``fused_quantize`` True / False (Q's and K's quantisation in one Pallas Triton pass each, or
  XLA's passes; the default, None, fuses up to H = 128);
* ``fp8-kv``: ``pallas_attn.flash_attention_fp8_kv`` on K and V quantised once beforehand
  (``quantize_kv``): Q's quantisation and the kernel; ``fp8-kv-fused``: the same with Q's
  fused Pallas Triton pass (``fused_quantize=True``); ``fp8-kv-bskd``: with V kept as
  [B, S, K, H] (transposed to the kernel's layout per call; the default keeps it in that layout);
* ``bf16``: ``pallas_attn.flash_attention(implementation="mosaic")``;
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` in bf16;
* ``cudnn-fp8``: cuDNN's FP8 forward (``jax._src.cudnn.fused_attention_stablehlo`` with
  ``use_fp8=True``; per-tensor scales, e4m3 output), where this jax / cuDNN has it.

Each is checked against a float32 XLA reference on batch 0 and the first heads: the mean
|error| / mean |ref| (FP8's error is ~3% by construction; see tests/pallas_attn/test_fp8.py).
CUPTI kernel time (median), TFLOP/s as BENCHMARKS.md counts them (4·B·N·T·S·H, halved when
causal). Outputs ``DIR/attention_fp8.json`` (rewritten after every measurement) and
``DIR/attention_fp8.png``.

  python3 benchmarks/attention_fp8.py --out /tmp/fp8                   # on the GPU
  python3 benchmarks/attention_fp8.py --out /tmp/fp8 --quick --impls fp8  # tiny rows, any host
  python3 benchmarks/attention_fp8.py --out /tmp/fp8 --rows 4x4096x16x128 \
      --impls fp8-kernel,fp8-kernel+num_stages=3                       # a Config sweep
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(_HERE), _HERE):
  if _path not in sys.path:
    sys.path.insert(0, _path)

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position

import timing  # pylint: disable=wrong-import-position

IMPLS = ("fp8-kernel", "fp8-kernel-preg", "fp8", "fp8-kv", "fp8-kv-fused", "fp8-kv-bskd", "bf16",
         "cudnn", "cudnn-fp8")
ROWS = ((4, 4096, 16, 128), (16, 1024, 16, 128), (1, 16384, 16, 128), (8, 2048, 16, 128),
        (2, 8192, 16, 128), (4, 4096, 32, 64), (4, 4096, 8, 256))
QUICK_ROWS = ((1, 128, 2, 64),)
REF_HEADS = 2


def _cudnn_fp8(causal: bool, scale: float):
  """cuDNN's FP8 forward with per-tensor scales (delayed scaling as Transformer Engine does it:
  here the amax of each input, computed outside the timed call), e4m3 output."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=import-outside-toplevel
  one = jnp.ones((1, 1, 1, 1), jnp.float32)

  def prepare(q, k, v):
    codes, descales = [], []
    for x in (q, k, v):
      s = jnp.max(jnp.abs(x.astype(jnp.float32))) / 448.0
      codes.append((x.astype(jnp.float32) / s).astype(jnp.float8_e4m3fn))
      descales.append(s.reshape(1, 1, 1, 1))
    return codes, descales

  def run(q8, k8, v8, dq, dk, dv):
    params = {key: one for key in fa.fp8_params_keys}
    params.update(descale_q=dq, descale_k=dk, descale_v=dv, scale_s=448.0 * one,
                  descale_s=one / 448.0, scale_o=one)
    out, _, _ = fa.dot_product_attention(
        q8, k8, v8, fp8_params=params, scale=scale, use_fp8=True,
        mask_type=fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK)
    return out
  return prepare, run


def build(impl: str, causal: bool, h: int, q, k, v):
  """(jitted fn, args, output -> float32 [B, T, N, H]) of one implementation."""
  from pallas_attn import flash_attention, fp8  # pylint: disable=import-outside-toplevel
  as_f32 = lambda o: o.astype(jnp.float32)
  scale = h ** -0.5
  if impl == "bf16":
    return jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=causal,
                                                   implementation="mosaic")), (q, k, v), as_f32
  if impl in ("fp8", "fp8-kb1", "fp8-fused", "fp8-xla"):  # end to end; -kb1: a scale per key
    kb = 1 if impl.endswith("kb1") else 256      # (default: per 256); -fused / -xla:
    fused = {"fp8-fused": True, "fp8-xla": False}.get(impl)   # fused_quantize True / False
    return jax.jit(lambda q, k, v: fp8.flash_attention_fp8(
        q, k, v, causal=causal, implementation="mosaic", k_scale_block=kb,
        fused_quantize=fused)), (q, k, v), as_f32
  if impl in ("fp8-kv", "fp8-kv-fused", "fp8-kv-bskd"):   # K, V quantised once, untimed
    layout = "bskd" if impl == "fp8-kv-bskd" else "kernel"
    kv = jax.jit(functools.partial(fp8.quantize_kv, v_layout=layout))(k, v)
    return jax.jit(lambda q, kv: fp8.flash_attention_fp8_kv(
        q, kv, causal=causal, implementation="mosaic",
        fused_quantize=impl == "fp8-kv-fused")), (q, kv), as_f32
  if impl in ("fp8-kernel", "fp8-kernel-preg") or impl.startswith("fp8-kernel+"):
    from mosaic_ab import parse_fields  # pylint: disable=import-outside-toplevel
    from pallas_attn.mosaic import fp8 as mosaic_fp8  # pylint: disable=import-outside-toplevel
    fields = parse_fields(impl.partition("+")[2].replace("+", ","))
    kb = int(fields.pop("k_scale_block", 256))    # not a Config field: the quantisation's
    qf, kf, vf = jax.jit(functools.partial(fp8.quantize_inputs, k_scale_block=kb))(q, k, v)
    fields.setdefault("fp8_p_registers", impl.endswith("preg"))
    config = dataclasses.replace(mosaic_fp8.fp8_default_config(
        head_dim=h, seq_k=q.shape[1], masked=causal), **fields)
    fn = functools.partial(mosaic_fp8.attention, out_dtype=q.dtype, causal=causal, scale=scale,
                           window=None, softcap=None, q_segment_ids=None, kv_segment_ids=None,
                           kv_lengths=None, return_lse=False, config=config,
                           interpret=jax.default_backend() != "gpu", k_scale_block=kb)
    args = (qf.codes, qf.scale, kf.codes, kf.scale, vf.codes, vf.scale)
    return jax.jit(fn), args, lambda o: as_f32(o)[..., :h]
  if impl == "cudnn":
    return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn")), (q, k, v), as_f32
  if impl == "cudnn-fp8":
    prepare, run = _cudnn_fp8(causal, scale)
    (q8, k8, v8), descales = jax.jit(prepare)(q, k, v)
    return jax.jit(run), (q8, k8, v8, *descales), as_f32
  raise ValueError(f"unknown implementation {impl!r}; known: {IMPLS}")


def reference(q, k, v, causal: bool):
  sl = (slice(0, 1), slice(None), slice(0, REF_HEADS), slice(None))
  with jax.default_matmul_precision("highest"):
    out = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="xla"))(
            *(x[sl].astype(jnp.float32) for x in (q, k, v)))
  return np.asarray(out), sl


def run_one(impl: str, row, causal: bool, iterations: int, inputs, ref,
            breakdown: bool = False) -> dict[str, Any]:
  b, t, n, h = row
  fn, args, to_f32 = build(impl, causal, h, *inputs)
  start = time.perf_counter()
  compiled = fn.lower(*args).compile()
  compile_s = time.perf_counter() - start
  out = np.asarray(to_f32(compiled(*args))[ref[1]])
  rel = float(np.abs(out - ref[0]).mean() / np.abs(ref[0]).mean())
  t_ms = timing.measure(compiled, args, iterations)
  flops = timing.attention_flops(b, n, t, t, h, causal=causal, mode="fwd")
  record = dict(ms=t_ms.ms, method=t_ms.method, tflops=timing.tflops(flops, t_ms.ms),
                mean_rel_err=rel, compile_s=compile_s, status="ok")
  if breakdown and t_ms.method == "cupti":      # every kernel of the call, in launch order
    record["kernels"] = timing.kernel_breakdown(compiled, args, iterations)
  return record


def plot(results: list[dict[str, Any]], path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  keys = sorted({(tuple(r["row"]), r["causal"]) for r in results})
  impls = list(dict.fromkeys(r["impl"] for r in results if r.get("tflops")))
  fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(keys)), 4))
  width = 0.8 / max(1, len(impls))
  for i, impl in enumerate(impls):
    vals = [next((r["tflops"] for r in results if r["impl"] == impl and tuple(r["row"]) == row
                  and r["causal"] == c and r.get("tflops")), 0.0) for row, c in keys]
    ax.bar(np.arange(len(keys)) + i * width, vals, width, label=impl)
  ax.set_xticks(np.arange(len(keys)) + 0.4 - width / 2)
  ax.set_xticklabels([f"{'x'.join(map(str, row))}\n{'causal' if c else 'full'}"
                      for row, c in keys], fontsize=7)
  ax.set_ylabel("TFLOP/s (forward)")
  ax.set_title("FP8 attention forward, " + jax.devices()[0].device_kind)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True)
  p.add_argument("--impls", default=",".join(IMPLS))
  p.add_argument("--quick", action="store_true")
  p.add_argument("--causal", default="0,1")
  p.add_argument("--rows", default="", help="BxTxNxH rows, comma-separated (default: the grid)")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--budget-s", type=float, default=480.0)
  p.add_argument("--breakdown", action="store_true",
                 help="also record each kernel's median time (GPU, CUPTI)")
  args = p.parse_args(argv)
  start = time.time()
  impls = args.impls.split(",")
  results: list[dict[str, Any]] = []
  path = os.path.join(args.out, "attention_fp8.json")
  rows = (tuple(tuple(int(d) for d in r.split("x")) for r in args.rows.split(","))
          if args.rows else QUICK_ROWS if args.quick else ROWS)
  for row in rows:
    for causal in (bool(int(c)) for c in args.causal.split(",")):
      if time.time() - start > args.budget_s:
        break
      b, t, n, h = row
      keys = jax.random.split(jax.random.key(0), 3)
      inputs = tuple(jax.random.normal(kk, (b, t, n, h), jnp.bfloat16) for kk in keys)
      ref = reference(*inputs, causal)
      for impl in impls:
        record = dict(impl=impl, row=list(row), causal=causal)
        try:
          record.update(run_one(impl, row, causal, args.iters, inputs, ref, args.breakdown))
        except Exception as e:  # pylint: disable=broad-except
          record.update(status="error", error=f"{type(e).__name__}: {e}"[:2000],
                        trace=traceback.format_exc()[-2000:])
        results.append(record)
        timing.write_json(path, dict(meta=timing.metadata(), results=results))
        tf = record.get("tflops")
        sys.stdout.write(f"{'x'.join(map(str, row))} {'causal' if causal else 'full'} {impl}: "
                         + (f"{record['ms']:.4f} ms {tf:.0f} TFLOP/s err "
                            f"{record['mean_rel_err']:.4f}" if tf else record.get("error", ""))
                         + "\n")
        for kern in record.get("kernels", []):
          sys.stdout.write(f"    {kern['ms']:.4f} ms  {kern['kernel'][:90]}\n")
        sys.stdout.flush()
  try:
    plot(results, os.path.join(args.out, "attention_fp8.png"))
  except Exception as e:  # pylint: disable=broad-except
    sys.stdout.write(f"plot failed: {e}\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())

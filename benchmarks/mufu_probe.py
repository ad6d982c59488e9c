"""How many exponentials a Hopper SM retires per clock: scalar ``ex2.approx`` against the packed
16-bit forms (``ex2.approx.f16x2``, ``ex2.approx.ftz.bf16x2``), and the e4m3 pack.

Why: the FP8 forward's consumer step at head dim 128 spends about as long in ``MUFU.EX2``
(one per score, 16 a clock per SM) as in its FP8 wgmmas (benchmarks/NOTES.md, sessions 24-27).
If the packed forms retire two exponentials per MUFU issue, P could be exponentiated as f16x2
(its error, ~2^-11 relative, far under e4m3's 2^-4) and packed to e4m3 straight from f16x2,
halving the softmax's MUFU time; if the SASS is two scalar MUFU ops per pair (as NVIDIA's
forum reports for sm_86), it gains nothing. Session 12 dropped the idea on that report without
a measurement; this is the measurement.

Each variant runs a dependent chain of 8 ops per asm statement, ``iters`` times, on every
element of a large array (many independent chains per thread, so the unit, not latency, is the
bound): x <- op(-x), which stays in (0, 1]. Results are exponentials (or conversions) per
second and per SM-clock (at the clock given by ``--clock-ghz``).

  python3 benchmarks/mufu_probe.py --out $OUT/mufu        # ~20 s on an H100 / H200
  python3 benchmarks/mufu_probe.py --out $OUT/mufu --ptx $OUT/mufu/t.ptx --variants ex2_f32
  ptxas -arch=sm_90a $OUT/mufu/t.ptx -o t.cubin && nvdisasm -c t.cubin | grep MUFU  # the SASS
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import timing  # noqa: E402  pylint: disable=wrong-import-position

CHAIN = 8                      # ops per asm statement


def _chain(op: str, reg: str, neg: str) -> str:
  body = "".join(f"{neg} t, t; {op} t, t; " for _ in range(CHAIN))
  return f"{{ .reg .{reg} t; mov.{reg} t, $1; {body}mov.{reg} $0, t; }}"


# name: (asm, constraints, pack, dtype, results per element per op)
VARIANTS = {
    "ex2_f32": (_chain("ex2.approx.ftz.f32", "f32", "neg.f32"), "=f,f", 1, jnp.float32),
    "ex2_f16x2": (_chain("ex2.approx.f16x2", "b32", "neg.f16x2"), "=r,r", 2, jnp.float16),
    "ex2_bf16x2": (_chain("ex2.approx.ftz.bf16x2", "b32", "neg.bf16x2"), "=r,r", 2,
                   jnp.bfloat16),
    # one e4m3x2 pack and unpack a step: f16x2 -> e4m3x2 -> f16x2 (FP8 P's conversion)
    "cvt_e4m3x2_f16x2": (
        "{ .reg .b32 t; .reg .b16 e; mov.b32 t, $1; "
        + "".join("cvt.rn.satfinite.e4m3x2.f16x2 e, t; cvt.rn.f16x2.e4m3x2 t, e; "
                  for _ in range(CHAIN)) + "mov.b32 $0, t; }", "=r,r", 2, jnp.float16),
}


def _kernel(x_ref, o_ref, *, asm, constraints, pack, iters):
  def body(_, x):
    return plgpu.elementwise_inline_asm(
        asm, args=[x], constraints=constraints, pack=pack,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])[0]
  o_ref[...] = lax.fori_loop(0, iters, body, x_ref[...])


def build(name: str, *, programs: int, block: int, iters: int, num_warps: int):
  asm, constraints, pack, dtype = VARIANTS[name]
  n = programs * block
  kernel = functools.partial(_kernel, asm=asm, constraints=constraints, pack=pack, iters=iters)
  fn = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((n,), dtype), grid=(programs,),
      in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
      out_specs=pl.BlockSpec((block,), lambda i: (i,)),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1))
  x = jnp.linspace(0.1, 1.0, n, dtype=jnp.float32).astype(dtype)
  return jax.jit(fn), x


def standalone_ptx() -> str:
  """Every variant's asm as its own sm_90a kernel (one load, the chain, one store), for ptxas
  and nvdisasm: the SASS shows how many MUFU instructions a packed ``ex2`` becomes."""
  lines = [".version 8.0", ".target sm_90a", ".address_size 64"]
  for i, (asm, constraints, _, _) in enumerate(VARIANTS.values()):
    reg = "f32" if constraints.startswith("=f") else "b32"
    body = asm.replace("$0", "%r0").replace("$1", "%r1")
    lines.append(f".visible .entry k{i}(.param .u64 p) {{ .reg .{reg} %r<2>; .reg .u64 %a; "
                 f"ld.param.u64 %a, [p]; ld.global.{reg} %r1, [%a]; {body} "
                 f"st.global.{reg} [%a], %r0; ret; }}")
  return "\n".join(lines) + "\n"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="mufu_out")
  p.add_argument("--iters", type=int, default=500)
  p.add_argument("--clock-ghz", type=float, default=1.98)
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--ptx", default="", help="also write standalone_ptx() to this path")
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  if args.ptx:
    with open(args.ptx, "w", encoding="utf-8") as f:
      f.write(standalone_ptx())
  sms = jax.devices()[0].core_count if hasattr(jax.devices()[0], "core_count") else 132
  results = []
  for name in args.variants.split(","):
    pack = VARIANTS[name][2]
    # 32-bit registers a thread: 16 independent chains (8 warps, 4096 registers a program)
    programs, num_warps = sms * 8, 8
    block = 4096 * pack
    rec = dict(variant=name, programs=programs, block=block, iters=args.iters, sms=sms)
    try:
      fn, x = build(name, programs=programs, block=block, iters=args.iters, num_warps=num_warps)
      start = time.perf_counter()
      out = fn(x).block_until_ready()
      rec["compile_s"] = time.perf_counter() - start
      rec["finite"] = bool(jnp.isfinite(out.astype(jnp.float32)).all())
      t = timing.measure(fn, (x,), 10)
      ops = programs * block * args.iters * CHAIN             # results (elements) produced
      rate = ops / (t.ms * 1e-3)
      rec.update(ms=t.ms, method=t.method, results_per_s=rate,
                 results_per_sm_clock=rate / (sms * args.clock_ghz * 1e9), status="ok")
    except Exception as e:  # noqa: BLE001  pylint: disable=broad-exception-caught
      rec.update(status="error", error=f"{type(e).__name__}: {e}"[:1500])
    results.append(rec)
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()
           if k != "error"}, rec.get("error", "")[:300], flush=True)
  timing.write_json(os.path.join(args.out, "mufu_probe.json"),
                    dict(meta=timing.metadata(), results=results))


if __name__ == "__main__":
  main()

"""Which piece hangs the GPU: ``flash_attention_fp8_kv`` with the fused Q pass (session 26).

Seen on an H100 (benchmarks/NOTES.md, session 26): at 16x1024x16x128, unmasked, K and V
quantised once, ``flash_attention_fp8_kv(q, kv, fused_quantize=True)`` ran once, then hung
within the next calls (three tries of three); with XLA's Q pass 200 calls ran. The same
fused pass before the same kernel passed at 4x4096x16x128, 1x16384 and H = 256, and the
one-call ``flash_attention_fp8`` with both passes fused passed at 16x1024.

Each variant runs ``--calls`` calls in its own process under a timeout (a hung GPU context
dies with its process), so one call of this script tells them apart:

* ``kv_xla`` / ``kv_fused``: the control and the hang;
* ``kv_fused_nocmdbuf``: the same with XLA's command buffers (CUDA graphs) off;
* ``kv_fused_nopdl``: with XLA's programmatic dependent launch off (XLA inserts
  ``griddepcontrol`` waits and, since mid-2026, early ``launch_dependents`` into the kernels
  it generates, the Triton ones included, and launches them to overlap their predecessor);
* ``kv_fused_grid``: the kernel launched as a grid instead of persistent;
* ``kv_fused_split``: Q's pass and the attention as two executables (the same kernels);
* ``kv_fused_4x4096``: the row where it passed;
* ``e2e_fused``: ``flash_attention_fp8`` with both passes fused at 16x1024.

  python3 benchmarks/fp8_hang_probe.py --out $OUT/hang        # ~5 minutes at most
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

VARIANTS = ("kv_xla", "kv_fused", "kv_fused_nocmdbuf", "kv_fused_nopdl", "kv_fused_grid",
            "kv_fused_split", "kv_fused_4x4096", "e2e_fused")
# XLA flags a variant runs under (the rest of its name picks the code path)
FLAGS = {"nocmdbuf": "--xla_gpu_enable_command_buffer=",
         "nopdl": "--xla_gpu_enable_pdl=false --xla_gpu_enable_pdl_launch=false"}


def run_variant(name: str, calls: int) -> dict:
  """In this process: build the variant, call it once, then ``calls`` times; wall time."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from pallas_attn import fp8  # pylint: disable=import-outside-toplevel
  from pallas_attn.mosaic import fp8 as mosaic_fp8  # pylint: disable=import-outside-toplevel

  row = (4, 4096, 16, 128) if name.endswith("4x4096") else (16, 1024, 16, 128)
  q, k, v = (jax.random.normal(jax.random.key(i), row, jnp.bfloat16) for i in range(3))
  fused = name != "kv_xla"
  if name == "e2e_fused":
    fn = jax.jit(lambda q, k, v: fp8.flash_attention_fp8(q, k, v, implementation="mosaic",
                                                         fused_quantize=True))
    args = (q, k, v)
  else:
    kv = jax.jit(fp8.quantize_kv)(k, v)
    config = None
    if name == "kv_fused_grid":
      config = dataclasses.replace(mosaic_fp8.fp8_default_config(
          head_dim=row[3], seq_k=row[1], masked=False), persistent=False)
    if name == "kv_fused_split":
      quant = jax.jit(lambda q: fp8._quantize_rows(  # pylint: disable=protected-access
          q, None, rotate=True, d=row[3], block=1, fused=True, interpret=False))
      attend = jax.jit(lambda qf, kv: fp8._attend(  # pylint: disable=protected-access
          qf, kv, out_dtype=jnp.bfloat16, causal=False, scale=None, window=None,
          softcap=None, q_segment_ids=None, kv_segment_ids=None, kv_lengths=None,
          return_lse=False, implementation="mosaic", config=None, interpret=False))
      fn, args = (lambda q, kv: attend(quant(q), kv)), (q, kv)
    else:
      fn = jax.jit(lambda q, kv: fp8.flash_attention_fp8_kv(
          q, kv, implementation="mosaic", fused_quantize=fused, config=config))
      args = (q, kv)
  first = jax.block_until_ready(fn(*args))
  # the first call's output against the xla backend on the same codes (an early start of a
  # kernel that reads what its predecessor writes would show here, hang or not)
  kv_ref = jax.jit(fp8.quantize_kv)(k, v)
  ref = fp8.flash_attention_fp8_kv(q, kv_ref, implementation="xla").astype(jnp.float32)
  rel = float(jnp.abs(first.astype(jnp.float32) - ref).mean() / jnp.abs(ref).mean())
  sys.stdout.write(json.dumps(dict(variant=name, first_call_rel_err=rel)) + "\n")
  sys.stdout.flush()
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return dict(variant=name, status="ok", calls=calls, first_call_rel_err=rel,
              ms_per_call=(time.perf_counter() - start) * 1e3 / calls)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="")
  p.add_argument("--variant", default="", help="run one variant in this process")
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--calls", type=int, default=300)
  p.add_argument("--timeout-s", type=float, default=40.0)
  args = p.parse_args(argv)
  if args.variant:
    sys.stdout.write(json.dumps(run_variant(args.variant, args.calls)) + "\n")
    return 0
  results = []
  for name in args.variants.split(","):
    env = dict(os.environ)
    flags = FLAGS.get(name.rpartition("_")[2])
    if flags:
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    cmd = [sys.executable, os.path.abspath(__file__), "--variant", name,
           "--calls", str(args.calls)]
    try:
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                            timeout=args.timeout_s, check=False)
      lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
      record = (json.loads(lines[-1]) if lines else
                dict(variant=name, status="error", rc=proc.returncode,
                     stderr=proc.stderr[-1500:]))
    except subprocess.TimeoutExpired as e:
      out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
      first = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
      record = dict(variant=name, status="hang", timeout_s=args.timeout_s,
                    **(first[-1] if first else {}))
    results.append(record)
    sys.stdout.write(json.dumps(record)[:300] + "\n")
    sys.stdout.flush()
    if args.out:
      os.makedirs(args.out, exist_ok=True)
      with open(os.path.join(args.out, "fp8_hang_probe.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""A small program for Nsight Compute: runs one of our kernels a few times, nothing else heavy.

ncu replays one launch of the named kernel with the hardware counters on (warp stall reasons,
issue slots, memory throughput); run it under ``ncu`` with a kernel-name filter, e.g.

  ncu --clock-control none --kernel-name regex:w4a16 --launch-skip 2 --launch-count 1 \\
      --section WarpStateStats --section SchedulerStats --section SourceCounters \\
      python3 benchmarks/ncu_target.py w4a16 --m 1 --k 8192 --n 28672

  ncu ... --kernel-name regex:flash_attention_dkdv ... python3 benchmarks/ncu_target.py attention

Targets: ``w4a16`` (the Mosaic W4A16 kernel with its default config, g128 asymmetric, on a
prepared weight), ``attention`` (our Mosaic forward + backward, bf16, one ``jax.vjp``; with
``--implementation cudnn`` cuDNN's, whose launch shape and pipe use ncu then reports) and
``attention_fp8`` (the FP8 forward kernel on inputs quantised beforehand).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_HERE), _HERE):
  if _p not in sys.path:
    sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def _w4a16(args) -> None:
  import quant  # pylint: disable=import-outside-toplevel
  from quant.matmul import layout  # pylint: disable=import-outside-toplevel
  from quant.matmul import mosaic as w4  # pylint: disable=import-outside-toplevel
  w = jax.random.normal(jax.random.key(0), (args.k, args.n), jnp.float32)
  mw = layout.prepare_mosaic(quant.rtn(w, bits=4, group_size=128, sym=False))
  x = jax.random.normal(jax.random.key(1), (args.m, args.k), jnp.bfloat16)
  from quant.matmul.config import default_mosaic_config  # pylint: disable=import-outside-toplevel
  cfg = default_mosaic_config(m=args.m, k=args.k, n=args.n, group_size=128)
  if args.late_zero:
    cfg = dataclasses.replace(cfg, late_zero=True)
  f = jax.jit(lambda x, mw: w4.int4_matmul(x, mw, config=cfg))
  for _ in range(args.calls):
    f(x, mw).block_until_ready()


def _attention(args) -> None:
  from pallas_attn import flash_attention  # pylint: disable=import-outside-toplevel
  b, t, h, d = args.b, args.t, args.heads, args.head_dim
  q, k, v, do = (jax.random.normal(jax.random.key(i), (b, t, h, d), jnp.bfloat16)
                 for i in range(4))

  from mosaic_ab import parse_fields  # pylint: disable=import-outside-toplevel
  from pallas_attn.mosaic.config import default_config  # pylint: disable=import-outside-toplevel
  cfg = dataclasses.replace(default_config(head_dim=d, seq_k=t, masked=args.causal, batch=b),
                            **parse_fields(args.fields))

  def attend(q, k, v):
    if args.implementation == "cudnn":   # the peer, to read its launch shape and pipe use
      return jax.nn.dot_product_attention(q, k, v, is_causal=args.causal, implementation="cudnn")
    return flash_attention(q, k, v, causal=args.causal, implementation="mosaic", config=cfg)

  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(do)
  f = jax.jit(fwd_bwd)
  for _ in range(args.calls):
    jax.block_until_ready(f(q, k, v, do))


def _attention_fp8(args) -> None:
  """The FP8 forward (``pallas_attn.mosaic.fp8.attention``) on inputs quantised beforehand."""
  from mosaic_ab import parse_fields  # pylint: disable=import-outside-toplevel
  from pallas_attn import fp8  # pylint: disable=import-outside-toplevel
  from pallas_attn.mosaic import fp8 as mosaic_fp8  # pylint: disable=import-outside-toplevel
  from pallas_attn.mosaic.config import default_config  # pylint: disable=import-outside-toplevel
  b, t, h, d = args.b, args.t, args.heads, args.head_dim
  q, k, v = (jax.random.normal(jax.random.key(i), (b, t, h, d), jnp.bfloat16) for i in range(3))
  qf, kf, vf = jax.jit(fp8.quantize_inputs)(q, k, v)
  cfg = dataclasses.replace(default_config(head_dim=d, seq_k=t, masked=args.causal),
                            **parse_fields(args.fields))
  f = jax.jit(lambda *a: mosaic_fp8.attention(
      *a, out_dtype=jnp.bfloat16, causal=args.causal, scale=d ** -0.5, window=None,
      softcap=None, q_segment_ids=None, kv_segment_ids=None, kv_lengths=None,
      return_lse=False, config=cfg, interpret=False))
  for _ in range(args.calls):
    jax.block_until_ready(f(qf.codes, qf.scale, kf.codes, kf.scale, vf.codes, vf.scale))


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("target", choices=("w4a16", "attention", "attention_fp8"))
  ap.add_argument("--calls", type=int, default=3)
  ap.add_argument("--m", type=int, default=1)
  ap.add_argument("--k", type=int, default=8192)
  ap.add_argument("--n", type=int, default=28672)
  ap.add_argument("--b", type=int, default=4)
  ap.add_argument("--t", type=int, default=4096)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--late-zero", action="store_true", help="w4a16: MosaicConfig.late_zero")
  ap.add_argument("--fields", default="", help="attention: Config fields, e.g. bwd_pt_smem=True")
  ap.add_argument("--implementation", choices=("mosaic", "cudnn"), default="mosaic",
                  help="attention: ours or cuDNN's (jax.nn.dot_product_attention)")
  args = ap.parse_args()
  {"w4a16": _w4a16, "attention": _attention, "attention_fp8": _attention_fp8}[args.target](args)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

"""The Mosaic GPU kernels of a lowered JAX function as MLIR text, on CPU (no GPU needed).

A compiled Mosaic kernel reaches XLA as a ``mosaic_gpu_v2`` custom call whose payload is the
kernel module, already lowered to the LLVM / NVVM dialects (registers, ``ldmatrix``, the
``wgmma`` inline assembly, barriers). Printing it without debug locations makes two versions
of a kernel comparable: a refactor that must not change a kernel can be checked by hashing the
texts before and after (session 15 did this for the fused-dQ split into ``fused_dq.py``), and
the code around a suspect operand can be read (the register-Q investigation, NOTES.md).

  python3 benchmarks/mosaic_mlir.py --head-dim 128 --config "Config(bwd_dq_lag=True)" \\
      --grad --causal --out /tmp/lag   # writes /tmp/lag_0.mlir, ... and prints their hashes
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(_HERE) not in sys.path:
  sys.path.insert(0, os.path.dirname(_HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src import mesh as mesh_lib  # noqa: E402
from jax._src.interpreters import mlir as jax_mlir  # noqa: E402
from jax._src.lib import mosaic_gpu_dialect  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402
from jax.experimental.mosaic.gpu import core as mosaic_core  # noqa: E402


def kernel_texts(lowered) -> list[str]:
  """The Mosaic GPU kernel modules of ``lowered`` (a ``jax.stages.Lowered``), in program order,
  as MLIR text without debug locations."""
  texts = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          attrs = child.attributes
          if child.operation.name == "stablehlo.custom_call" and "mhlo.backend_config" in attrs:
            config = ir.DictAttr(attrs["mhlo.backend_config"])
            if "module" in config:
              texts.append(_module_text(ir.StringAttr(config["module"]).value_bytes))
          walk(child.operation)
  walk(lowered.compiler_ir("stablehlo").operation)
  return texts


def _module_text(payload: bytes) -> str:
  with jax_mlir.make_ir_context() as ctx, ir.Location.unknown():
    mosaic_gpu_dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    module = mosaic_core._run_serde_pass(ir.Module.parse(payload), serialize=False)
    return module.operation.get_asm(enable_debug_info=False)


def lower_attention(cfg, *, head_dim: int, grad: bool, causal: bool, seq: int = 1024):
  """flash_attention (Mosaic backend, compiled form) on [1, seq, 2, head_dim] bf16, lowered for
  sm90 inside an abstract H200 mesh (the backward's D pre-pass is a Triton kernel)."""
  from pallas_attn.mosaic import ops  # pylint: disable=import-outside-toplevel
  q = jax.ShapeDtypeStruct((1, seq, 2, head_dim), jnp.bfloat16)

  def fwd(q, k, v):
    out, _ = ops._attention(q, k, v, None, None, None, causal, head_dim ** -0.5, None, None,
                            cfg, head_dim, False)
    return out.astype(jnp.float32).sum()
  fn = jax.grad(fwd, argnums=(0, 1, 2)) if grad else fwd
  dev = mesh_lib.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=dev)):
    return jax.jit(fn).trace(q, q, q).lower(lowering_platforms=("cuda",))


def main() -> int:
  from pallas_attn.mosaic import Config  # noqa: F401  pylint: disable=import-outside-toplevel
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="Config()", help="a pallas_attn.mosaic Config expression")
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--grad", action="store_true", help="forward + backward (else forward only)")
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--out", default="", help="prefix for <prefix>_<i>.mlir files")
  args = ap.parse_args()
  cfg = eval(args.config, {"Config": Config})  # pylint: disable=eval-used
  texts = kernel_texts(lower_attention(cfg, head_dim=args.head_dim, grad=args.grad,
                                       causal=args.causal))
  for i, text in enumerate(texts):
    if args.out:
      with open(f"{args.out}_{i}.mlir", "w") as f:
        f.write(text)
    sys.stdout.write(f"kernel {i}: {hashlib.sha1(text.encode()).hexdigest()[:12]} "
                     f"({len(text)} chars)\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

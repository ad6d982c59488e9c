"""Minimal kernel for session 14's wrong outputs with Q as a register wgmma operand.

The FlashAttention forward with Q in registers (``Config.q_regs_cols``) gave wrong outputs
compiled on the H200 in its unmasked loop when block_kv equals the head dim (benchmarks/NOTES.md,
session 14). This strips the loop to its matmuls: one warpgroup, Q / K / V in shared memory,
``iters`` steps of S = Q K_j^T (wgmma, Q from registers or from SMEM), P = bf16(c * S), O += P V_j
(wgmma, P from registers), O carried across a fori_loop. Prints, per (head dim, block_kv), the
register form's and the SMEM form's max |O - reference| (float32 numpy on the same bf16 P
rounding is not reproduced, so compare the two columns). Needs a Hopper GPU:

  python3 benchmarks/repro_register_q.py
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64


def build(h: int, bkv: int, *, regs: bool, iters: int = 8, nblk: int = 2,
          softmax: bool = False):
  tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def body(q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem, o_smem, bar):
    plgpu.copy_gmem_to_smem(q_ref, q_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(k_ref, k_smem, bar.at[1])
    plgpu.copy_gmem_to_smem(v_ref, v_smem, bar.at[2])
    for i in range(3):
      plgpu.barrier_wait(bar.at[i])
    q = q_smem[...] if regs else q_smem

    def step(j, acc):
      slot = lax.rem(j, nblk)

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, q, k_smem.at[slot].transpose((1, 0)))
        return acc_ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((ROWS, bkv), jnp.float32))
      if softmax:       # the forward's online softmax (base 2, folded scale)
        acc, m, l = acc
        m_new = jnp.maximum(m, s.max(axis=1) * 0.1)
        p32 = jnp.exp2(s * 0.1 - lax.broadcast_in_dim(m_new, s.shape, [0]))
        alpha = jnp.exp2(m - m_new)
        l = l * alpha + p32.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p, m = p32.astype(jnp.bfloat16), m_new
      else:
        p = (s * 0.05).astype(jnp.bfloat16)

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, p, v_smem.at[slot])
      acc = pl.run_state(pv)(plgpu.ACC.init(acc))
      return (acc, m, l) if softmax else acc
    acc = plgpu.layout_cast(jnp.full((ROWS, h), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    if softmax:
      row = plgpu.layout_cast(jnp.full((ROWS,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      acc, _, l = lax.fori_loop(0, iters, step, (acc, row - jnp.inf, row))
      acc = acc * lax.broadcast_in_dim(1.0 / l, acc.shape, [0])
    else:
      acc = lax.fori_loop(0, iters, step, acc)
    o_smem[...] = acc.astype(jnp.bfloat16)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref)
    plgpu.wait_smem_to_gmem(0)

  bf = jnp.bfloat16
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((ROWS, h), bf),
      scratch_types=[plgpu.SMEM((ROWS, h), bf, transforms=tiled),
                     plgpu.SMEM((nblk, bkv, h), bf, transforms=tiled),
                     plgpu.SMEM((nblk, bkv, h), bf, transforms=tiled),
                     plgpu.SMEM((ROWS, h), bf, transforms=tiled),
                     plgpu.Barrier(num_barriers=3)],
      kernel_name=f"repro_q_{'regs' if regs else 'smem'}_{h}_{bkv}")


def reference(q, k, v, iters, nblk=2):
  q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
  o = np.zeros((q.shape[0], v.shape[-1]), np.float32)
  for j in range(iters):
    p = np.asarray(jnp.asarray(0.05 * (q @ k[j % nblk].T)).astype(jnp.bfloat16), np.float32)
    o += p @ v[j % nblk]
  return o


def main() -> int:
  lower_only = "--lower" in sys.argv
  for h, bkv in ((64, 64), (64, 128), (128, 64), (128, 128)):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (ROWS, h), jnp.bfloat16)
    k = jax.random.normal(keys[1], (2, bkv, h), jnp.bfloat16)
    v = jax.random.normal(keys[2], (2, bkv, h), jnp.bfloat16)
    if lower_only:
      for regs in (True, False):
        for softmax in (True, False):
          jax.jit(build(h, bkv, regs=regs, softmax=softmax)).trace(q, k, v).lower(
              lowering_platforms=("cuda",))
      print(f"H={h} block_kv={bkv}: lowers")
      continue
    run = lambda **kw: np.asarray(jax.jit(build(h, bkv, softmax=True, **kw))(q, k, v),
                                  np.float32)
    soft = np.max(np.abs(run(regs=True) - run(regs=False)))
    print(f"H={h} block_kv={bkv}: with the softmax, max |registers - SMEM| {soft:.3e}",
          flush=True)
    ref = reference(q, k, v, 8)
    err = {regs: float(np.max(np.abs(np.asarray(jax.jit(build(h, bkv, regs=regs))(q, k, v),
                                                 np.float32) - ref)))
           for regs in (True, False)}
    print(f"H={h} block_kv={bkv}: max |O - ref| registers {err[True]:.3e}, SMEM {err[False]:.3e}"
          f" (max |ref| {np.max(np.abs(ref)):.3e})", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

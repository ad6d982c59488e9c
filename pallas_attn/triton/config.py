"""Tuning knobs of the Triton FlashAttention-2 kernels: one frozen Config, pure heuristics."""
from __future__ import annotations

import dataclasses

_POW2 = (16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class Config:
  """Block sizes and launch parameters; hashable so it can be a static jit argument.

  Attributes:
    block_q, block_k: forward tile (queries per program, keys per inner step).
    num_warps, num_stages: forward launch (warps per program, software-pipeline depth).
    block_q_dkv, block_k_dkv: dK/dV kernel tile (the program owns block_k_dkv keys).
    block_q_dq, block_k_dq: dQ kernel tile (the program owns block_q_dq queries).
    bwd_num_warps, bwd_num_stages: launch parameters of both backward kernels.
  """
  block_q: int = 128
  block_k: int = 128
  num_warps: int = 8
  num_stages: int = 3
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  block_q_dq: int = 64
  block_k_dq: int = 64
  bwd_num_warps: int = 4
  bwd_num_stages: int = 2

  def __post_init__(self):
    for f in ("block_q", "block_k", "block_q_dkv", "block_k_dkv", "block_q_dq", "block_k_dq"):
      val = getattr(self, f)
      if val not in _POW2:
        raise ValueError(f"Config.{f} must be a power of two in {_POW2}, got {val}")
    for f in ("num_warps", "bwd_num_warps"):
      if getattr(self, f) not in (1, 2, 4, 8, 16):
        raise ValueError(f"Config.{f} must be 1, 2, 4, 8 or 16, got {getattr(self, f)}")
    for f in ("num_stages", "bwd_num_stages"):
      if not 1 <= getattr(self, f) <= 8:
        raise ValueError(f"Config.{f} must be in [1, 8], got {getattr(self, f)}")


def _pow2_at_least(n: int, floor: int = 16) -> int:
  p = floor
  while p < n:
    p *= 2
  return p


def default_config(*, head_dim: int, seq_q: int, seq_k: int, itemsize: int = 2) -> Config:
  """Heuristic Config for a head dim (padded to a power of two) and sequence lengths.

  Tiles shrink for short sequences (no point in a 128-row tile for 3 queries) and for large head
  dims (registers: the fp32 accumulator is block_q x head_dim per program).
  """
  hp = _pow2_at_least(head_dim)
  if hp <= 64:
    # H200 sweep (results/*triton_sweep_h64.json, 4x4096x32x64): 64x64 tiles lead both passes.
    cfg = Config(block_q=64, block_k=64, num_warps=4, num_stages=3,
                 block_q_dkv=64, block_k_dkv=64, block_q_dq=64, block_k_dq=64,
                 bwd_num_warps=4, bwd_num_stages=3)
  elif hp <= 128:
    # H200 sweep 2026-12-02 (benchmarks/results/*triton_sweep_h128.json): 128x128 tiles with 8
    # warps lead the forward (454 TFLOP/s full, 381 causal at 4x4096x16x128); 64x64 backward tiles
    # with 4 warps lead fwd+bwd (387 / 343) by a wide margin over 128-wide ones (spills).
    cfg = Config(block_q=128, block_k=128, num_warps=8, num_stages=3,
                 block_q_dkv=64, block_k_dkv=64, block_q_dq=64, block_k_dq=64,
                 bwd_num_warps=4, bwd_num_stages=2)
  else:
    # H=256 (results/*triton_sweep_h256_fwd.json): 128x64 tiles, 8 warps, 2 stages (192 KB of
    # shared memory; 3 stages would exceed the 227 KB limit).
    # Backward: the dK/dV program keeps two fp32 [block_k, 256] accumulators in registers, so
    # 8 warps share them (128 registers a thread at block_k=64); one stage leaves smem to tiles.
    cfg = Config(block_q=128, block_k=64, num_warps=8, num_stages=2,
                 block_q_dkv=32, block_k_dkv=64, block_q_dq=64, block_k_dq=32,
                 bwd_num_warps=8, bwd_num_stages=1)
  cfg = fit_to_lengths(cfg, seq_q=seq_q, seq_k=seq_k)
  # float32 inputs double the tiles' bytes: shed pipeline stages, then tile size, until they fit.
  while forward_smem_bytes(cfg, head_dim=head_dim, itemsize=itemsize) > SMEM_LIMIT_BYTES:
    if cfg.num_stages > 2:
      cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    elif cfg.block_k > 32:
      cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    else:
      cfg = dataclasses.replace(cfg, block_q=cfg.block_q // 2)
  # The same for the backward (untested on the GPU for float32 at the time of writing: a guess
  # from the tile arithmetic, not a measurement).
  while backward_smem_bytes(cfg, head_dim=head_dim, itemsize=itemsize) > BWD_SMEM_BUDGET_BYTES:
    if cfg.bwd_num_stages > 1:
      cfg = dataclasses.replace(cfg, bwd_num_stages=cfg.bwd_num_stages - 1)
    elif cfg.block_k_dkv > 16:
      cfg = dataclasses.replace(cfg, block_k_dkv=cfg.block_k_dkv // 2,
                                block_k_dq=max(16, cfg.block_k_dq // 2))
    else:
      break
  return cfg


SMEM_LIMIT_BYTES = 227 * 1024   # Hopper: 227 KB of shared memory per block


def forward_smem_bytes(cfg: Config, *, head_dim: int, itemsize: int = 2) -> int:
  """Shared memory the forward asks for: the Q tile plus ``num_stages`` buffered K and V tiles."""
  hp = _pow2_at_least(head_dim)
  return (cfg.block_q + 2 * cfg.num_stages * cfg.block_k) * hp * itemsize


BWD_SMEM_BUDGET_BYTES = 160 * 1024   # leaves room for Triton's dot-operand layout conversions


def backward_smem_bytes(cfg: Config, *, head_dim: int, itemsize: int = 2) -> int:
  """Rough shared memory of the dK/dV kernel: its K and V tiles plus staged Q and dO tiles."""
  hp = _pow2_at_least(head_dim)
  return (2 * cfg.block_k_dkv + 2 * cfg.bwd_num_stages * cfg.block_q_dkv) * hp * itemsize


def fit_to_lengths(cfg: Config, *, seq_q: int, seq_k: int) -> Config:
  """Clamp tiles to the (power-of-two rounded) sequence lengths, never below 16."""
  tq, tk = _pow2_at_least(seq_q), _pow2_at_least(seq_k)
  return dataclasses.replace(
      cfg,
      block_q=min(cfg.block_q, tq), block_k=min(cfg.block_k, tk),
      block_q_dkv=min(cfg.block_q_dkv, tq), block_k_dkv=min(cfg.block_k_dkv, tk),
      block_q_dq=min(cfg.block_q_dq, tq), block_k_dq=min(cfg.block_k_dq, tk))

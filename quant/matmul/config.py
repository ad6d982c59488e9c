"""Tuning knobs of the Triton W4A16 kernel: one frozen Config, a pure heuristic and a shape fit.

A program of the kernel owns a ``block_m x block_n`` tile of the output and one of ``split_k``
contiguous slices of K; it walks its slice ``block_k`` rows at a time. Constraints (checked by
``fit_config``, which raises NotImplementedError for a valid call it cannot serve):

* Triton tiles are powers of two and a dot needs at least 16 rows on every side, so the kernel
  computes 16 rows even for M = 1 (masked loads and stores keep the padding out of memory).
* The scale is applied after the dot (exact, see ``triton.py``), so every dot covers rows of one
  quantization group: ``block_k`` divides ``group_size`` or is a multiple of it (then one step
  does ``block_k / group_size`` dots), and each split of K holds whole groups.

Example:
  >>> cfg = default_config(m=1, k=8192, n=28672, group_size=128)
  >>> cfg.block_m, cfg.split_k, cfg.unpack
  (16, 4, 'strided')
"""
from __future__ import annotations

import dataclasses

from quant.matmul import layout as mosaic_layout

_BLOCKS = (16, 32, 64, 128, 256, 512)
NUM_SMS = 132          # H200
MIN_DOT = 16           # Triton's smallest dot extent
UNPACK_MODES = ("interleave", "strided")
DECODE_UNPACK = "strided"   # default_config's unpack for 16-row tiles (see Config.unpack)


@dataclasses.dataclass(frozen=True)
class Config:
  """Tile and launch parameters; hashable, so it can be a static jit argument.

  Attributes:
    block_m: rows of x per program (>= 16; decode uses 16).
    block_n: output columns per program.
    block_k: rows of the weight consumed per loop step.
    split_k: number of programs sharing one output tile along K; their float32 partial sums
      ``[split_k, M, N]`` are added by XLA afterwards (deterministic, no atomics).
    num_warps, num_stages: Triton launch (warps per program, software-pipeline depth).
    unpack: how nibbles meet the dot. "interleave": one dot per group over the rows in natural
      order (nibbles stacked and reshaped); "strided": eight dots per group, nibble ``i`` against
      x's columns ``i, i+8, ...`` (no reshape; needs >= 128 rows per dot).
  """
  block_m: int = 16
  block_n: int = 128
  block_k: int = 128
  split_k: int = 1
  num_warps: int = 4
  num_stages: int = 4
  unpack: str = "interleave"

  def __post_init__(self):
    for f in ("block_m", "block_n", "block_k"):
      val = getattr(self, f)
      if val not in _BLOCKS or (f == "block_m" and val > 256):
        raise ValueError(f"Config.{f} must be a power of two in {_BLOCKS}, got {val!r}")
    if not isinstance(self.split_k, int) or isinstance(self.split_k, bool) or not (
        1 <= self.split_k <= 64):
      raise ValueError(f"Config.split_k must be an int in [1, 64], got {self.split_k!r}")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"Config.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
    if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
      raise ValueError(f"Config.num_stages must be in [1, 8], got {self.num_stages!r}")
    if self.unpack not in UNPACK_MODES:
      raise ValueError(f"Config.unpack must be one of {UNPACK_MODES}, got {self.unpack!r}")


def pow2_at_least(n: int, floor: int = MIN_DOT) -> int:
  p = floor
  while p < n:
    p *= 2
  return p


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def check_shape(cfg: Config, *, k: int, group_size: int) -> None:
  """Raises NotImplementedError when ``cfg`` cannot tile K for this group size."""
  per_channel = group_size >= k
  rows_per_dot = min(cfg.block_k, k // cfg.split_k if per_channel else group_size)
  if cfg.unpack == "strided" and rows_per_dot < 8 * MIN_DOT:
    raise NotImplementedError(f"unpack='strided' needs >= {8 * MIN_DOT} rows per dot (block_k and "
                              f"group), got {rows_per_dot}")
  if k % cfg.split_k:
    raise NotImplementedError(f"split_k={cfg.split_k} does not divide K={k}")
  ks = k // cfg.split_k
  if per_channel:
    if cfg.split_k > 1 and ks % cfg.block_k:
      raise NotImplementedError(f"per-channel split_k={cfg.split_k} needs K/split_k={ks} to be a "
                                f"multiple of block_k={cfg.block_k}")
    return
  if ks % group_size:
    raise NotImplementedError(f"K/split_k={ks} must hold whole groups of {group_size}")
  bk = cfg.block_k
  if bk <= group_size:
    if group_size % bk:
      raise NotImplementedError(f"block_k={bk} must divide group_size={group_size}")
  elif bk % group_size or ks % bk:
    raise NotImplementedError(f"block_k={bk} > group_size={group_size} needs both block_k to be a "
                              f"multiple of the group and K/split_k={ks} a multiple of block_k")


def fit_config(cfg: Config, *, m: int, k: int, n: int, group_size: int) -> Config:
  """Clamps tiles to the problem (never below 16) and fixes block_k to the group structure.

  block_m / block_n shrink to the power of two covering M / N; block_k halves until it fits the
  groups (down to 16). Raises NotImplementedError when no block_k works (groups of fewer than 16
  rows, or a split that cuts a group).
  """
  bk = min(cfg.block_k, pow2_at_least(k))
  cfg = dataclasses.replace(cfg, block_m=min(cfg.block_m, pow2_at_least(m)),
                            block_n=min(cfg.block_n, pow2_at_least(n)), block_k=bk)
  while True:
    try:
      check_shape(cfg, k=k, group_size=group_size)
      return cfg
    except NotImplementedError:
      if cfg.block_k <= MIN_DOT:
        raise
      cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)


def default_config(*, m: int, k: int, n: int, group_size: int, num_sms: int = NUM_SMS) -> Config:
  """Heuristic Config for ``[m, k] @ [k, n]`` with groups of ``group_size`` rows (K: per-channel).

  From the H200 sweeps (benchmarks/results/w4a16/2026-12-02_h200_w4a16.json, g128, three
  Llama-sized layers):

  * M <= 16 (decode) streams the int4 weight: 16-row tiles, the "strided" unpack (eight plain
    dots, no reshape: 1.7-1.9x faster than "interleave" at every decode row) and ``split_k``
    doubled until there are about six programs per SM (s4 beat s2 by 16% at 8192x28672, s16
    beat s8 by 14% at 28672x8192), while each split keeps >= 1024 rows of K.
  * 16 < M <= 64: 32/64-row tiles, "interleave" (strided lost by 25-30% at M = 64), about two
    programs per SM.
  * M > 64: 64-row tiles with 4 warps and 4 stages (1.45-3.4x faster than 128-row tiles with
    8 warps at M = 256), K split only when there are fewer tiles than SMs.
  """
  if m <= 16:
    cfg = Config(block_m=16, block_n=128, block_k=256, num_warps=4, num_stages=4)
  elif m <= 32:
    cfg = Config(block_m=32, block_n=128, block_k=256, num_warps=4, num_stages=4)
  else:
    cfg = Config(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4)
  cfg = fit_config(cfg, m=m, k=k, n=n, group_size=group_size)
  programs = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
  target = (6 if m <= 16 else 2 if m <= 64 else 1) * num_sms
  split = 1
  while programs * split < target and k // (2 * split) >= 1024:
    trial = dataclasses.replace(cfg, split_k=2 * split)
    try:
      check_shape(trial, k=k, group_size=group_size)
    except NotImplementedError:
      break
    split *= 2
  cfg = dataclasses.replace(cfg, split_k=split)
  if cfg.block_m <= MIN_DOT:
    try:
      check_shape(dataclasses.replace(cfg, unpack=DECODE_UNPACK), k=k, group_size=group_size)
      cfg = dataclasses.replace(cfg, unpack=DECODE_UNPACK)
    except NotImplementedError:
      pass            # too few rows per dot for "strided" (groups < 128): keep "interleave"
  return cfg


# ----------------------------------------------------------------------------------------------
# Mosaic GPU (Hopper wgmma) backend: ``quant/matmul/mosaic.py``
# ----------------------------------------------------------------------------------------------

# K rows per pipeline step = MOSAIC_PLANES planes of block_k / 4 columns (layout.prepare_mosaic)
MOSAIC_BLOCK_K = mosaic_layout.BLOCK_K
MOSAIC_PLANES = mosaic_layout.PLANES
MOSAIC_MAX_M = 128                 # rows of x one kernel call serves (a prepared weight: chunks)
MOSAIC_SCALED_MAX_M = 256          # the same with ``MosaicConfig.scaled_acc`` (one accumulator)
MOSAIC_WIDE_M = 64                 # above this, two warpgroups at most (the register budget)
MOSAIC_ACC_COLUMNS = 64            # grid kernel's default ``acc_columns`` (0 = automatic)
SMEM_BYTES = 227 * 1024            # opt-in shared memory per block on sm90
SM_SMEM_BYTES = 228 * 1024         # shared memory of one SM (all its resident CTAs)


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiles of the Mosaic GPU W4A16 kernel (frozen, hashable: a static jit argument).

  A CTA owns ``block_n`` output features, 64 per warpgroup (wgmma's M side; the warpgroups share
  one copy of x's slice, so x is read from L2 once per ``block_n`` features), and one of
  ``split_k`` contiguous slices of K, which it walks ``block_k`` rows per step through a ring of
  ``num_stages`` SMEM buffers filled by TMA. ``block_k / 4`` is also the width of one wgmma
  operand (one nibble plane), so it fixes the swizzle (16 -> 32 B, 32 -> 64 B, 64 and 128 ->
  128 B) and the planar weight layout (``layout.prepare_mosaic(qw, block_k=...)``).
  ``registers_a``: the dequantized planes are wgmma's A operand straight from registers
  (compiled only; the Mosaic interpreter cannot run register operands, so interpret mode stages
  them through SMEM, as does ``registers_a=False``).
  ``fold_zero`` (with ``registers_a``, compiled only; 1.6-1.8x slower on the H200, off): leave the plane as
  ``B + q`` and let the tensor cores subtract: a second wgmma per plane with the constant
  operand ``-(B + z)`` (same accumulator), instead of one packed 16-bit subtract per two weights
  on the ALU. The tensor cores are nearly idle at decode (N = m_pad <= 64); the accumulator then
  holds sums ~(B + q) / (q - z) ~ 20-140x larger before they cancel, so its float32 rounding
  matters more (to be checked against the 1e-3 error bar on the GPU).
  ``pipeline`` (with ``registers_a``, compiled only; 7-60% slower on the H200, off): keep one step of
  wgmmas in flight: step t's planes are dequantized and issued while step t - 1's run, then
  t - 1 is retired (two sets of group accumulators, even and odd steps). Ignored where those
  float32 tiles would not fit the register budget (``(4 groups per step + 1) * m_pad / 2 <=
  96`` registers a thread: m_pad 8 at block_k 512 and g128, up to 16 at block_k 256). In the
  stream-K form it works per group instead of per step (two accumulators, any m_pad; an even
  number of groups per step, else ignored): group g + 1 is issued before group g is retired.
  H200 (session 19): correct, but 8-27% slower at 16-64 rows of 8192 x 28672 (not diagnosed).
  ``direct_io``: the kernel's TMA reads x as ``[M, K]`` (one box per plane, rows >= M and
  columns >= K zero-filled) and, with one K split and no bias, writes y ``[M, N]`` in x's
  dtype, instead of XLA padding / plane-transposing x before the launch and slicing /
  transposing / casting the float32 partials after it (two small kernels).
  ``direct_x``: the x half of ``direct_io`` alone (x read as ``[M, K]`` by the TMA; the
  float32 partials leave as usual, with ``out_registers`` from registers), for 65..128 rows,
  where XLA's plane transpose of x took 2.6-5.8 us of a 38-110 us call (H200, session 21)
  and ``direct_io``'s output tile would halve block_n. Grid kernel only (ignored with
  ``stream_ctas``), M <= 8 or a multiple of 8, K a multiple of 64.
  ``stream_ctas`` (0 = off; H200, sessions 8 and 10: -3..-4% at 1x8192x28672 with 264, -6..-7%
  at M=16 with 132, +15..17% at 8192x8192, so ``default_mosaic_config`` turns it on only for
  many tiles and no K split): launch that many persistent
  CTAs (e.g. 2 per SM) that share the ``tiles x K-steps`` work units equally, one TMA ring
  across tile boundaries, partial sums per K segment added by XLA (``mosaic_stream.py``);
  replaces ``split_k`` and the one-CTA-per-(tile, split) grid; ``fold_zero`` and
  ``direct_io`` are ignored with it (``pipeline`` works per group there, above).
  ``late_zero``: the wgmma takes ``B + q`` straight from the bit operations, and each group's
  float32 partial is corrected afterwards by the rank-1 ``(B + z_g[n]) X_g[m]``, ``X_g`` the
  sum of x's columns over the group (computed by XLA): since ``sum_k (B + q) x = sum_k (q - z)
  x + (B + z) sum_k x``, this drops the packed 16-bit subtract (one instruction per two weights,
  17% of the kernel's instructions in Nsight Compute, session 9) for ~m_pad / 2 FMAs a thread
  per group. The accumulator then holds sums ~(B + q) / |q - z| ~ 30x larger before the
  correction cancels them, so float32 rounding of the partial grows by as much (still ~1e-5
  of the output for activations without a large common offset). Ignored with ``pipeline`` or
  ``fold_zero``.
  ``mma_sync`` (with ``registers_a``): at M <= 16 (x padded to 8 or 16 rows) multiply each
  dequantized plane by x with warp-level ``mma.sync.m16n8k16`` (N = 8 native: Marlin's
  instruction; two chains at 16 rows) instead of ``m64 nN k16`` wgmmas, x's planes stored in
  fragment order by XLA (``mma_sync.py``; interpret mode emulates the product from the same
  buffer). For block_k
  256 / 512; ignored with ``registers_a=False`` (the planes then go through SMEM to a
  wgmma), ``pipeline``, ``fold_zero``, ``direct_io`` or more than 16 rows, so that
  ``dataclasses.replace(default, registers_a=False)`` stays a valid config.
  Why: on the H200 the N = 8 wgmma runs at 241-281 TFLOP/s and mma.sync at 641-649
  (``benchmarks/wgmma_probe.py``, session 18). Measured: 1 x 8192 x 28672 (stream-K, 512-row
  steps) 0.0411 -> 0.0377 ms, 8 x 8192 x 28672 0.0410 -> 0.0385; but with 256-row steps
  (the grid shapes 8192 x 8192 and 28672 x 8192) 15-20% slower, and at 16 rows 2-5% slower
  (N = 16 wgmmas run at 464-603 TFLOP/s), so ``default_mosaic_config`` turns it on only for
  x's 8 rows on 512-row stream-K steps (benchmarks/NOTES.md, session 18).
  ``out_registers``: each warpgroup stores its float32 partial ``[64, m_pad]`` straight from
  registers to HBM (each thread two adjacent columns, 8 bytes, of 4 rows: full 32-byte sectors)
  instead of through an output tile in SMEM and a TMA store. The tile is ``block_n * m_pad * 4``
  bytes, 32 KB at 64 rows with 128 features: what keeps a second 101 KB ring stage of 512-row
  steps out of the SMEM, and so what forces 64-feature CTAs at M = 57..64, which read x's
  planes from L2 twice as often. H200 (session 19): the stores alone cost 3% (same CTAs), the
  128-feature CTAs they allow save 24% at 64 x 8192 x 28672, so ``default_mosaic_config`` uses
  it there only. Ignored where the kernel writes y itself (``direct_io``; its tile is then
  counted anyway).
  ``acc_columns``: how many float32 columns of group accumulators (``m_pad`` each, so
  ``acc_columns / 2`` registers a thread) one wgmma scope keeps live. A step's groups share a
  scope, and so one ``wgmma_wait``, up to that budget: the dequant of a group's plane then
  runs while the previous group's wgmmas do, instead of after a wait per group. 0 (the
  default): 64 in the grid kernel (4 groups at 16 rows, 1 at 64), one group per scope in the
  stream-K kernel. H200 (session 19): one scope for a 512-row step's 4 groups was 4% slower at
  16 x 8192 x 28672 (four warpgroups, 128 registers a thread) than a scope per group, level at
  32 rows; 2 groups a scope at 64 rows 0.5-1.4% faster, 4 there up to 22% slower.
  ``x_slots`` (0 = off): x's planes in a TMA ring of their own, ``x_slots`` slots of one
  plane (``m_pad * block_k / 4 * 2`` bytes), refilled plane by plane, while codes, scales and
  zeros keep the step ring (``mosaic_xring.py``; grid and stream-K kernels). By default a
  slot of the step ring holds a whole step of x, 128 KB at 128 rows of 512-row steps, so two
  stages do not fit there; with four x slots they take 128 KB in all. Needs at least twice
  the planes one wgmma scope reads (1 for g128 on 512-row steps above 64 rows; 4 for groups
  as long as a step). ``pipeline`` and ``mma_sync`` are ignored with it. H200 (session 21):
  1.6x slower than the step ring where both fit at 128 rows, so the heuristic never takes it.
  ``step_parts`` (1, 2 or 4; not with ``x_slots``; ``pipeline`` and ``mma_sync`` ignored): the
  ring walks parts of layout steps, ``block_k / step_parts`` K rows each. A slot holds that part of
  the step's x planes and scale rows but the step's whole code tile, of which the warpgroup
  dequantizes the nibbles (planes) of its part, so the code tile crosses from L2
  ``step_parts`` times (the later reads L2 hits; at 128 rows and 2 parts +25% of the ring's
  L2 -> SMEM bytes). What it buys: a slot of a 512-row layout at 128 rows holds 64 KB of x
  instead of 128, so two stages fit (195 KB) and one call serves 65..128 rows on that layout
  without x's per-plane ring; each slot's barrier is waited once per part, as on a 256-row
  layout, which ran 128 x 8192 x 28672 in 0.118 ms against 0.153 for 64-row chunks (H200,
  session 21). At 129..256 rows (``scaled_acc``) 2 parts of 256-row steps, 4 of 512-row ones.
  Groups longer than a part but shorter than a layout step need ``scaled_acc``.
  ``carry_codes`` (with ``step_parts`` > 1, else ignored): the code tile is copied into the
  ring at a layout step's first part only and the later parts reuse its registers (32 a
  thread at 512-row steps, live across the parts): the ring's L2 -> SMEM bytes at 256 rows and
  4 parts drop by a third. Opt-in until timed: the registers may not be free.
  ``scaled_acc`` (the wgmma forms of both kernels; ignored with ``pipeline``, ``mma_sync``,
  ``x_slots``; ``late_zero`` and ``fold_zero`` ignored with it): one float32 accumulator holds
  the running total in units of the current group's scale. Before group g's wgmmas it is
  multiplied by ``s_{g-1} / s_g`` (a per-feature row; FlashAttention's rescaling of its output
  when the row maximum moves), so ``acc * s_last`` is the total at the end. The usual form keeps the total
  beside a fresh accumulator per group (``m_pad / 2`` registers a thread each), so this frees
  ``m_pad / 2`` registers: what lets one call take 129..256 rows (wgmma N = 256, a 128-register
  accumulator). The rescale is one multiply per element per group where the usual form has
  one FMA, and rounds once per group (relative 2^-24: ~1e-6 over 64 groups). A zero scale keeps
  the previous unit (``layout.prepare_mosaic`` stores q = z in such a group).
  """
  block_n: int = 128
  block_k: int = 512
  num_stages: int = 4
  split_k: int = 1
  registers_a: bool = True
  fold_zero: bool = False
  pipeline: bool = False
  direct_io: bool = False
  direct_x: bool = False
  stream_ctas: int = 0
  late_zero: bool = False
  mma_sync: bool = False
  out_registers: bool = False
  acc_columns: int = 0
  x_slots: int = 0
  step_parts: int = 1
  scaled_acc: bool = False
  carry_codes: bool = False

  def __post_init__(self):
    if self.block_n not in (64, 128, 256):
      raise ValueError(f"MosaicConfig.block_n must be 64, 128 or 256 (1, 2 or 4 warpgroups), "
                       f"got {self.block_n!r}")
    if self.block_k not in MOSAIC_BLOCK_K:
      raise ValueError(f"MosaicConfig.block_k must be one of {MOSAIC_BLOCK_K}, "
                       f"got {self.block_k!r}")
    if not isinstance(self.num_stages, int) or not 2 <= self.num_stages <= 8:
      raise ValueError(f"MosaicConfig.num_stages must be in [2, 8], got {self.num_stages!r}")
    if not isinstance(self.split_k, int) or isinstance(self.split_k, bool) or not (
        1 <= self.split_k <= 64):
      raise ValueError(f"MosaicConfig.split_k must be an int in [1, 64], got {self.split_k!r}")
    if not isinstance(self.acc_columns, int) or isinstance(self.acc_columns, bool) or not (
        self.acc_columns == 0 or 8 <= self.acc_columns <= 256):
      raise ValueError(f"MosaicConfig.acc_columns must be 0 (automatic) or an int in [8, 256], "
                       f"got {self.acc_columns!r}")
    if not isinstance(self.stream_ctas, int) or isinstance(self.stream_ctas, bool) or (
        self.stream_ctas < 0):
      raise ValueError(f"MosaicConfig.stream_ctas must be an int >= 0, got {self.stream_ctas!r}")
    if self.step_parts not in (1, 2, 4) or isinstance(self.step_parts, bool):
      raise ValueError(f"MosaicConfig.step_parts must be 1, 2 or 4, got {self.step_parts!r}")
    if not isinstance(self.x_slots, int) or isinstance(self.x_slots, bool) or not (
        self.x_slots == 0 or 2 <= self.x_slots <= 16):
      raise ValueError(f"MosaicConfig.x_slots must be 0 (off) or an int in [2, 16], "
                       f"got {self.x_slots!r}")


def mosaic_m_pad(m: int) -> int:
  """Rows of x the kernel computes: wgmma's N side, a multiple of 8 (at least 8)."""
  return max(8, -(-m // 8) * 8)


def mosaic_smem_bytes(cfg: MosaicConfig, *, m: int, asym: bool) -> int:
  """Shared memory of one CTA: the TMA ring, the output tile (none with ``out_registers``),
  x's own ring (``x_slots``) and, when the dequantized planes are staged through SMEM
  (``registers_a=False``), two of them."""
  span2, mp, bn = cfg.block_k // MOSAIC_PLANES, mosaic_m_pad(m), cfg.block_n
  # int16 weight tile, the planes of x, scale rows (at most one group per plane, float32 scales
  # at worst) and bf16 zero points; with step parts, a part of the planes and the scale rows.
  x_plane = mp * span2 * 2
  planes_a_step = MOSAIC_PLANES // cfg.step_parts
  per_stage = (bn * span2 * 2 + (0 if cfg.x_slots else planes_a_step * x_plane)
               + planes_a_step * bn * (4 + (2 if asym else 0)))
  planes = 0 if cfg.registers_a else 2 * bn * span2 * 2
  if cfg.mma_sync and cfg.registers_a and not cfg.x_slots:   # x rows padded by 32 elements
    per_stage += MOSAIC_PLANES * mp * 32 * 2
  planes += cfg.x_slots * x_plane                # x's own ring (mosaic_xring.py)
  out_tile = 0 if cfg.out_registers and not cfg.direct_io else bn * mp * 4
  return cfg.num_stages * per_stage + planes + out_tile + 1024


def check_mosaic_shape(cfg: MosaicConfig, *, m: int, k: int, group_size: int,
                       asym: bool = True) -> None:
  """Raises NotImplementedError when ``cfg`` cannot serve ``[m, k]`` with these groups."""
  if m > (MOSAIC_SCALED_MAX_M if cfg.scaled_acc else MOSAIC_MAX_M):
    raise NotImplementedError(
        f"mosaic int4_matmul takes M <= {MOSAIC_MAX_M} (M <= {MOSAIC_SCALED_MAX_M} with "
        f"scaled_acc); M={m} runs in chunks on a prepared weight")
  if mosaic_m_pad(m) > MOSAIC_WIDE_M and cfg.block_n > 128:
    # Each thread holds a group accumulator and the running total, m_pad / 2 registers each:
    # at 65..128 rows four warpgroups (512 threads) would need more than 128 registers apiece.
    raise NotImplementedError(f"block_n={cfg.block_n} (four warpgroups) at M={m} > "
                              f"{MOSAIC_WIDE_M} would exceed the register file")
  bk, span2 = cfg.block_k, cfg.block_k // MOSAIC_PLANES
  per_channel = group_size >= k
  if cfg.step_parts > 1 and cfg.x_slots:
    raise NotImplementedError("MosaicConfig.step_parts walks the step ring: not with x_slots")
  if (cfg.step_parts > 1 and not cfg.scaled_acc and not per_channel
      and bk // cfg.step_parts < group_size < bk):
    raise NotImplementedError(f"groups of {group_size} rows span parts of a {bk}-row step "
                              f"(step_parts={cfg.step_parts}) but not whole steps: needs "
                              f"scaled_acc")
  if not mosaic_layout.mosaic_tiles_groups(bk, k, group_size):
    raise NotImplementedError(f"block_k={bk} cannot tile groups of {group_size} rows (planes of "
                              f"{span2} rows must lie in one group)")
  unit = bk if per_channel else max(bk, group_size)
  kp = -(-k // unit) * unit
  if kp % cfg.split_k or (kp // cfg.split_k) % unit:
    raise NotImplementedError(f"split_k={cfg.split_k} does not cut K={kp} (padded) into whole "
                              f"blocks of {unit} rows")
  if cfg.x_slots and cfg.x_slots < 2 * mosaic_scope_planes(cfg, m=m, k=k, group_size=group_size):
    raise NotImplementedError(f"x_slots={cfg.x_slots} needs at least twice the "
                              f"{mosaic_scope_planes(cfg, m=m, k=k, group_size=group_size)} "
                              f"planes one wgmma scope reads")
  smem = mosaic_smem_bytes(cfg, m=m, asym=asym)
  if smem > SMEM_BYTES:
    raise NotImplementedError(f"config needs {smem} bytes of shared memory (> {SMEM_BYTES})")


def mosaic_scope_planes(cfg: MosaicConfig, *, m: int, k: int, group_size: int) -> int:
  """The most planes one wgmma scope reads (``Statics.scope_planes``): a step's groups share a
  scope while their accumulators fit ``acc_columns`` float32 columns."""
  bk = cfg.block_k
  unit = bk if group_size >= k else max(bk, group_size)
  ks = -(-k // unit) * unit // cfg.split_k               # K rows of one split (padded)
  seg = ks if group_size >= k else min(group_size, ks)  # rows sharing one scale
  if seg >= bk:
    return MOSAIC_PLANES                                 # one group a step: one scope
  gps = bk // seg
  # automatic acc_columns: the grid kernel's budget; one group a scope in stream-K
  acc = cfg.acc_columns or (8 if cfg.stream_ctas else MOSAIC_ACC_COLUMNS)
  per_scope = max(1, min(gps, acc // mosaic_m_pad(m)))
  return per_scope * (MOSAIC_PLANES // gps)


def fit_mosaic_config(cfg: MosaicConfig, *, m: int, k: int, group_size: int,
                      asym: bool = True, n: int | None = None) -> MosaicConfig:
  """Halves block_n until it divides N (padded to 64) and, above 64 rows, to at most 128 (two
  warpgroups); lowers num_stages (to 2), then block_n, until the CTA fits in SMEM; then checks
  the shape (NotImplementedError)."""
  if n is not None:
    tiles = -(-n // 64)
    while tiles % (cfg.block_n // 64):
      cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
  if mosaic_m_pad(m) > MOSAIC_WIDE_M and cfg.block_n > 128:
    cfg = dataclasses.replace(cfg, block_n=128)   # see check_mosaic_shape
  while mosaic_smem_bytes(cfg, m=m, asym=asym) > SMEM_BYTES:
    if cfg.num_stages > 2:
      cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    elif cfg.block_n > 64:
      cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    else:
      break                                        # check_mosaic_shape raises
  check_mosaic_shape(cfg, m=m, k=k, group_size=group_size, asym=asym)
  return cfg


def resolve_mosaic_config(config, *, m: int, k: int, n: int, group_size: int,
                          asym: bool) -> MosaicConfig:
  """The MosaicConfig for a call: the heuristic for None, else ``config`` fitted to the shape
  (NotImplementedError for a config of another backend or one that cannot serve the shape)."""
  if config is None:
    return default_mosaic_config(m=m, k=k, n=n, group_size=group_size, asym=asym)
  if not isinstance(config, MosaicConfig):
    raise NotImplementedError(f"config of type {type(config).__name__} is not a "
                              f"quant.matmul.config.MosaicConfig")
  return fit_mosaic_config(config, m=m, k=k, group_size=group_size, asym=asym, n=n)


def default_mosaic_config(*, m: int, k: int, n: int, group_size: int, asym: bool = True,
                          num_sms: int = NUM_SMS, block_k: int | None = None,
                          one_call: bool | None = None) -> MosaicConfig:
  """Heuristic MosaicConfig: widest plane the groups allow, two warpgroups sharing x, a 3-deep
  ring, K split for the SMs. (A guess until it is timed on an H200: see benchmarks/w4a16.py.)

  block_k = 512 (planes of 128 rows, 128-byte swizzle, 16 KiB of int4 per 64 features per
  step) unless the groups are shorter than a plane (groups of 64: 256, 32: 128, 16: 64) or the
  weight has at most 8192 x 8192 elements (256: ``layout.default_block_k``, the layout's own
  default, so that a weight prepared with defaults matches this config).
  block_n = 128 halves the L2 -> SMEM traffic of x (for M <= 8, x padded to 8 rows is half the
  weight's bytes per 64 features). Decode streams the weight once, so the grid should hold about
  two warpgroups per SM: ``split_k`` doubles while there are fewer than ``2 * num_sms``
  64-feature tiles and each split keeps at least 1024 rows of K (partial sums are reduced by
  XLA); above 16 rows, where x's planes make the CTAs large, only while the CTAs fit one
  wave. Without a K split and with more 64/128-feature tiles than one wave of CTAs holds, the
  stream-K form (``stream_ctas``: as many persistent CTAs as fit at once) replaces the grid.
  65..128 rows: two stages, no SMEM output tile, at most two warpgroups; where x's planes of
  a step do not fit two stages (512-row steps above 72 rows) NotImplementedError
  (``mosaic.int4_matmul`` then runs a prepared weight in 64-row chunks; x's own ring of
  planes, ``x_slots``, fits there but measured slower than the chunks). ``block_k``: the K
  step of a prepared weight
  (``MosaicWeight.block_k``), else the layout's default.
  ``one_call`` (None: on for group-wise scales, the measured case; off for per-channel ones,
  which keep their 64-row chunks on 512-row steps): serve 65..256 rows in one call: the
  fewest ``step_parts`` whose two stages fit 128-feature CTAs; ``scaled_acc`` wherever a step
  is split in parts or above 128 rows (the separate total spills beside a part's code tile);
  above 128 rows also ``carry_codes``; grid kernel, K split by the wave rule. Measured in one
  process (H100, session 24; results/w4a16/2026-12-05_s24_*.json): 256 x 8192 x 28672
  0.3064 ms in four 64-row calls -> 0.2265 in one, 0.2054 with the codes carried (XLA bf16
  0.1901); 128 x 8192 x 28672 0.1542 in two 64-row calls -> 0.1306 in one with
  ``scaled_acc`` (0.2072 with the separate total). ``one_call=False``: the earlier heuristic
  (NotImplementedError where it needs chunks).
  """
  per_channel = group_size >= k
  one_call = not per_channel if one_call is None else one_call
  bk = block_k or mosaic_layout.default_block_k(k, n, group_size)
  # M <= 8 (x is one 8-row wgmma N tile): 64 features and a 4-deep ring per CTA measured 4-10%
  # faster than 128 features and 3 stages on the H200 (benchmarks/results/w4a16/); at M = 16
  # the wider CTA wins by 10-20% (x's slice is shared by two warpgroups).
  narrow = mosaic_m_pad(m) <= 8
  # 65..128 rows: x's planes are 32-64 KB a step per 128 rows, so two warpgroups share them over
  # two stages with no SMEM output tile (``out_registers``); 512-row steps do not fit at all
  # (128 KB of x a stage), so a prepared weight of that layout runs 64-row chunks instead.
  wide = mosaic_m_pad(m) > MOSAIC_WIDE_M
  base = MosaicConfig(block_n=64 if narrow else 128, block_k=bk,
                      num_stages=4 if narrow else 2 if wide else 3, out_registers=wide)
  if one_call and wide:
    # The fewest parts of a step whose two stages fit 128-feature CTAs (x is 32-64 KB a part at
    # 128 rows, 64 KB at 256); the one accumulator where a separate total would not fit.
    many = mosaic_m_pad(m) > MOSAIC_MAX_M
    base = dataclasses.replace(base, scaled_acc=many)
    for parts in (1, 2, 4):
      cand = dataclasses.replace(base, step_parts=parts)
      if mosaic_smem_bytes(cand, m=m, asym=asym) <= SMEM_BYTES:
        base = dataclasses.replace(cand, scaled_acc=many or parts > 1,
                                   carry_codes=many and parts > 1)
        break
  # 512-row steps above 72 rows do not fit the step ring: NotImplementedError here, so a
  # prepared weight runs 64-row chunks (``chunk_rows``). x's own ring of planes
  # (``x_slots = 4``) would fit, but it measured 1.6x slower than the step ring on the H200
  # (session 21, results/w4a16/2026-12-05_s21_call1_m128.json: 128 x 28672 x 8192 0.168 vs
  # 0.106 ms; 128 x 8192 x 28672 0.178 ms against ~0.145 for two 64-row calls): opt-in only.
  cfg = fit_mosaic_config(base, m=m, k=k, group_size=group_size, asym=asym, n=n)
  tiles = -(-n // 64)              # warpgroup tiles: the grid should give each SM about two
  unit = bk if per_channel else max(bk, group_size)
  kp = -(-k // unit) * unit
  per_sm = lambda c: max(1, min(2, SM_SMEM_BYTES // mosaic_smem_bytes(c, m=m, asym=asym)))
  # Above 16 rows x's planes make the CTAs large (often one per SM): split K only while the
  # CTAs still fit one wave. H200, session 18 (results/w4a16/2026-12-04_s18_probe_split_m32_64
  # .json): 28672 x 8192 at M = 64 / 32 0.0761 -> 0.0726 / 0.0615 -> 0.0585 ms and 8192 x 8192
  # 0.0269 -> 0.0246 / 0.0225 -> 0.0203 with a split of 2 instead of 4.
  wave = -(-n // cfg.block_n) if mosaic_m_pad(m) > 16 else None
  split = 1
  while (tiles * split < 2 * num_sms if wave is None
         else wave * 2 * split <= per_sm(cfg) * num_sms) and kp // (2 * split) >= 1024:
    try:
      check_mosaic_shape(dataclasses.replace(cfg, split_k=2 * split), m=m, k=k,
                         group_size=group_size, asym=asym)
    except NotImplementedError:
      break
    split *= 2
  cfg = dataclasses.replace(cfg, split_k=split)
  # Stream-K (mosaic_stream.py) where the grid would run more than one wave of CTAs without a K
  # split: the last partial wave leaves SMs idle, while stream-K CTAs share the tiles x steps
  # work units equally. H200, g128 (results/w4a16/2026-12-03_s10_probe.json, s8 likewise):
  # 1x8192x28672 (448 tiles, 264 CTAs) -3%, 16x8192x28672 (224 tiles of 128, 132 CTAs) -7%;
  # where the grid already splits K to fill the SMs (8192x8192) it was 17% slower, so those
  # keep the grid. M = 17..64 (one CTA per SM: x's planes fill the SMEM): 64x8192x28672
  # 0.1069 -> 0.0952 ms, 32x8192x28672 0.0584 -> 0.0527 (session 18, results/w4a16/
  # 2026-12-04_s18_probe_m32_64.json).
  if split == 1 and (-(-n // cfg.block_n) > per_sm(cfg) * num_sms) and not (
      cfg.step_parts > 1 or cfg.scaled_acc):        # (one_call keeps the grid until timed)
    if not narrow and mosaic_m_pad(m) <= 16:
      # M = 9..16: four warpgroups sharing x's slice, two stages (one CTA per SM either way):
      # 0.0470 -> 0.0441 ms at 16x8192x28672 (H200, session 10; at M = 1 it was 7% slower).
      wide = fit_mosaic_config(dataclasses.replace(cfg, block_n=256, num_stages=2), m=m, k=k,
                               group_size=group_size, asym=asym, n=n)
      cfg = wide if wide.block_n == 256 else cfg
    # M = 57..64 on 512-row steps: the output tile in SMEM is what leaves room for 64-feature
    # CTAs only (x's planes then read from L2 once per 64 features); with the partials stored
    # from registers two warpgroups share x over two stages. H200, session 19 (results/w4a16/
    # 2026-12-04_s19_call1_m64_stream.json): 64 x 8192 x 28672 0.0951 -> 0.0727 ms, though the
    # register stores alone cost 3% (0.0951 -> 0.0980 with the same 64-feature CTAs).
    if mosaic_m_pad(m) > 16 and cfg.block_n == 64:
      wide = fit_mosaic_config(dataclasses.replace(cfg, block_n=128, num_stages=2,
                                                   out_registers=True),
                               m=m, k=k, group_size=group_size, asym=asym, n=n)
      cfg = wide if wide.block_n == 128 else cfg
    cfg = dataclasses.replace(cfg, stream_ctas=per_sm(cfg) * num_sms)
    # mma.sync for x's 8 rows where its steps are 512 rows (above); the ring it pads must still
    # fit as many CTAs per SM.
    if narrow and cfg.block_k == 512:
      fast = dataclasses.replace(cfg, mma_sync=True)
      cfg = fast if per_sm(fast) * num_sms == cfg.stream_ctas else cfg
  return cfg


def chunk_rows(m: int, mw: "mosaic_layout.MosaicWeight",
               config: MosaicConfig | None = None) -> int:
  """Rows of x per kernel call on a prepared weight: all ``m`` when one call can serve them,
  else equal chunks of the most rows ``config`` (None: the heuristic) fits on the weight's K
  step: at most ``MOSAIC_SCALED_MAX_M`` (``scaled_acc``), else ``MOSAIC_MAX_M``, else
  ``MOSAIC_WIDE_M`` (the heuristic on 512-row steps above 72 rows). Equal chunks pad x the
  least: 200 rows are two calls of 100 (or four of 50), not 128 + 72 padded to 256."""
  def rows_under(limit: int) -> int:
    return -(-m // -(-m // limit))                 # ceil(m / number of chunks)

  k, n = mw.shape

  def fits(rows: int) -> bool:
    try:
      if config is None:
        default_mosaic_config(m=rows, k=k, n=n, group_size=mw.group_size, asym=not mw.sym,
                              block_k=mw.block_k)
      else:
        resolve_mosaic_config(config, m=rows, k=k, n=n, group_size=mw.group_size,
                              asym=not mw.sym)
      return True
    except NotImplementedError:
      return False

  for limit in (MOSAIC_SCALED_MAX_M, MOSAIC_MAX_M):
    rows = rows_under(limit)
    if rows <= MOSAIC_WIDE_M or fits(rows):
      return rows
  return rows_under(MOSAIC_WIDE_M)

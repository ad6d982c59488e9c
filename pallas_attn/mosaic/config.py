"""Tuning knobs of the Mosaic GPU FlashAttention-3 forward kernel: one frozen Config."""
from __future__ import annotations

import dataclasses

BACKWARDS = ("mosaic", "triton")
HEAD_DIMS = (64, 128, 192, 256)    # native head dims (multiples of 64: one 128-byte swizzle row)
EARLY_STATS = ("", "lse", "lse_pre", "lse+delta", "lse+delta_early", "lse_pre+delta_early",
               "lse_pre+delta_acc")


@dataclasses.dataclass(frozen=True)
class Config:
  """Tile sizes of the forward kernel; hashable so it can be a static jit argument.

  Attributes:
    block_q: query rows per consumer warpgroup (a CTA holds two: 2 * block_q rows). wgmma's M is
      64 per warpgroup, so 64 or 128.
    block_kv: keys per pipeline step (wgmma N of S = Q K^T, K of O += P V): a multiple of 16
      in [64, 256]. Multiples of 64 keep every buffer on 128-byte swizzle rows; others (FA3's
      80 at head dim 256, 176 at 128) put the V ring and P on 64- or 32-byte rows
      (``operands.pv_swizzle``), since P V's K steps come in groups one swizzle row wide.
    num_stages: depth of the K/V shared-memory ring the producer warpgroup fills with TMA.
    v_stages: forward: depth of the V ring where it differs from the K ring's ``num_stages`` (0:
      the same). K is read first in a step (S = Q K^T) and V only after the softmax, so a
      deeper K ring fetches K further ahead for the same shared memory: at H = 256 three
      64-key K slots and two V slots (224 KB of tiles with Q) instead of two of each. Not
      served with ``overlap`` (its loop keeps one slot index for both rings). H200 (session
      17), forward: 4x4096x8x256 full 0.793 -> 0.838 ms (3 K + 2 V), 0.822 (2 + 3), 0.997
      (2 + 1); 4x4096x16x128 0.801 -> 0.840 (3 + 2): every five-slot ring 4-6% slower, one V
      slot far worse. Off (0); kept, tested, for the rings' next experiments.
    bwd_block_q, bwd_block_kv: backward tiles (dQ: block_q rows per consumer, block_kv keys per
      step; dK/dV: block_kv keys per consumer, block_q queries per step). 64 each by default: a
      dK/dV consumer holds two fp32 [block_kv, H] accumulators.
    bwd_dkdv_block_q: queries per step of the dK/dV kernel when it should differ from the dQ
      kernel's ``bwd_block_q`` rows (0: the same). At H = 64 a dK/dV step of 64 queries is
      four 64x64x64 wgmmas a consumer, so the step's fixed costs (ring waits and releases,
      the lse / D reads, two wgmma waits) weigh twice what they do at H = 128: the dK/dV
      kernel runs at ~560 TFLOP/s there against ~740 at H = 128 (H100, session 31). 128
      queries a step halves them; ptxas (offline) spills nothing at H = 64 without
      ``bwd_early_stats`` and 16 B with "lse" at 240 registers, where the dQ kernel with
      128-row blocks would spill and serialise its wgmmas (C7512). 128 by default at H = 64
      from 512 keys, causal calls with key masks from 1024 (default_config; dK/dV 12% faster
      unmasked, 2-3% causal, H100 session 32; with a window or a causal mask together with
      ``bwd_masked_halves``, session 35).
    bwd_num_stages: depth of the backward's TMA rings (dK/dV: Q, dO and row stats per step;
      dQ: K and V per step, shallower where it would not fit in shared memory).
    bwd_dq_block_kv: keys per step of the dQ kernel (it holds one fp32 accumulator, so it can
      take 128 where the dK/dV kernel, with two, cannot). 128 by default at H = 64 from 512
      keys without a window, as ``bwd_dkdv_block_q`` (the dQ kernel 4-7% faster at
      4x4096x32x64, H100 session 32; with a window it spills, session 35).
    bwd_fused_dq: dQ from the dK/dV kernel (FA3 Section 3.3) instead of a separate dQ kernel
      that recomputes S and dP: 5 matmuls per block instead of 7, paid for with a float32 dQ
      partial per (Q block, K/V tile) added into a global accumulator by TMA reductions.
      Head dims 128/256 (padded), no shard_map-varying operands; otherwise the two kernels.
      Floating-point addition order then varies from run to run (not bitwise deterministic).
      Off: on the H200 it was 3-17% slower fwd+bwd than the two kernels (the consumers'
      per-step rendezvous over dS^T serialises the ping-pong; benchmarks/NOTES.md, session 6).
      With ``bwd_registers=240`` (session 15): 0.7-1.3% faster than the two kernels at
      4x4096x16x128 full, 1-8% slower at T = 1024 and on causal rows.
    bwd_defer_wait: compiled backward (both kernels): a step's last wgmma (dQ += dS K; dK +=
      dS^T Q, with dV before it) is not waited at the end of the step but by the next step's
      first accumulator load, after that step's S and dP are issued, so the tensor cores get the
      next matmuls while it finishes; its ring slots are released there (and after the loop).
      Not with the fused dQ (its rendezvous waits for everything). Interpret mode ignores it
      (the staged form waits every product). H200 (session 8): bitwise equal to the default but
      slower, dK/dV +4-12%, dQ +11-25% (fwd+bwd 0.89 -> 0.79x cuDNN at 4x4096): off.
    bwd_registers: registers a consumer thread of the backward kernels takes (``setmaxnreg``):
      232 (producer 40) or 240 (producer 24, FA3's split for two consumer warpgroups). Nsight
      Compute (session 9): at 232 the dK/dV consumer spills ~12 registers per step.
      ``default_config`` takes 240 at H > 128 and on the H = 128 grid kernels (session 29:
      dK/dV 0.6-3% faster in both timing orders), 232 on the persistent ones and at H = 64.
    bwd_dq_registers: the dQ kernel's consumer registers when they should differ from
      ``bwd_registers`` (0: the same). The causal H = 64 dQ kernel with 128-key steps spills
      76 B at 232 (ptxas, offline) and none at 240, where the dK/dV kernel is 1-2% slower.
    bwd_pt_smem: compiled dK/dV kernel: dV += P^T dO takes P^T from shared memory (one 8 KiB
      store per step and consumer) instead of registers, freeing their 16 registers a thread
      while dS^T is formed. H200 (session 9): fewer spill requests (29.7 M -> 21.1 M at
      4x4096x16x128) but the kernel slower (1.69 -> 1.75 ms under Nsight Compute): off.
    bwd_dq_writer: the fused dQ (as ``bwd_fused_dq``, which it implies) with the dQ products on
      the producer warpgroup: each consumer hands its dS^T to a double-buffered SMEM slot and
      the producer, between refills of the Q/dO ring, computes dQ_i = scale * dS_i K in
      64-column chunks and TMA-reduces them into the float32 accumulator, so the consumers
      never meet. Head dims 64 and 128 (padded); not bitwise deterministic. H200 (session 13):
      correct, but the dK/dV kernel 3.4x slower: ptxas cannot give the producer the registers
      its accumulator needs, ignores the setmaxnreg split (C7507) and serialises every wgmma
      (C7512). Off.
    bwd_dq_lag: the fused dQ (as ``bwd_fused_dq``, which it implies) without its per-step
      rendezvous: at step s each consumer hands its dS^T to a double-buffered slot and computes
      its half of dQ for step s - 1, so neither waits for the other unless it is a whole step
      ahead; dK += dS^T Q runs while the fp32 partial is stored and TMA-reduced. Not bitwise
      deterministic (reduction order): off. H200 (session 15, ``named_free``, 240 registers;
      at 232 it spills and is 27-40% slower): fwd+bwd 3.603 -> 3.498 ms at 4x4096x16x128
      full, 1-10% slower at T = 1024 and causal. H100 (session 39): its one kernel 2.570 ms
      against the two kernels' 2.587, but fwd+bwd 4.4% slower (D, the float32 accumulator's
      zeros and its conversion: 162 us outside it).
    bwd_split_dkdv: head dims whose dK/dV tiles do not fit one consumer (H = 256): the two
      consumers of a dK/dV CTA share its keys and split the work by role (``backward_split.py``:
      one computes S^T, P^T and dV, the other dP^T, dS^T and dK, P^T handed over in float16),
      instead of the Triton FA2 backward; its dQ kernel runs two K slots and one V slot
      (``ops._backward_statics``). H200 (session 16), 4x4096x8x256 fwd+bwd with
      ``bwd_dq_serial``, no ``bwd_dq_regs`` and 240 registers: 11.99 -> 4.007 ms full (0.35 ->
      1.043x cuDNN), 6.27 -> 2.265 ms causal (1.019x); compiled tests pass. On by default for
      padded head dims over 128 (``default_config``); ignored where the two-consumer tiles fit.
    backward: "mosaic" (the wgmma dQ and dK/dV kernels of ``backward.py``) or "triton" (the
      FA2 kernels of the Triton backend on the same residuals; also used whenever the Mosaic
      dK/dV tiles do not fit in shared memory: head dims over 128 without ``bwd_split_dkdv``).
    overlap: intra-warpgroup overlap of the forward (FA3 Section 3.2): the softmax of block j+1
      runs while the tensor cores compute P_j V_j. Compiled only (interpret mode runs the plain
      loop: the Mosaic GPU interpreter has no register operands for wgmma). Correct but measured
      1.1-1.9x slower than the plain loop on the H200 (register pressure; benchmarks/NOTES.md),
      so off by default. The FP8 forward takes it with ``fp8_p_registers`` (the FP8 step is
      latency-bound on the softmax: Nsight Compute, session 24); there it is correct but
      18-31% slower (H200, session 25): ptxas serialises every wgmma of that kernel (C7513:
      P's e4m3 registers are written while the next S wgmma is in flight; found with
      ``benchmarks/offline_ptxas.py``, session 28). The bf16 overlap draws no such code.
    fold_scale: keep the logits unscaled until the softmax: the row max is taken on q.k and
      2^(c q.k - m) is one FMA per element instead of a multiply and a subtract (exact maths,
      different rounding; FA3 Section 3.1 on the non-matmul FLOPs). Ignored for scale <= 0.
      H200: +1-5% on every forward row of the grid (benchmarks/NOTES.md, session 4).
    named_barriers: the consumers' ping-pong on two hardware named barriers (``bar.arrive`` to
      hand the tensor cores over, ``bar.sync`` to take them) instead of an mbarrier rendezvous.
      Compiled only (PTX); interpret mode keeps the mbarrier. With ``overlap`` too (its turns
      then follow the same protocol; that form has not run on a GPU yet: session 11).
      H200: +1-3% alone, +4-7% together with ``fold_scale``.
    early_k_wait: wait for the next K block inside the P V wgmma scope, while P V runs.
      H200 (with no_auto_barriers): -2% to +3% depending on the row, so off.
    pin_softmax: an ``optimization_barrier`` on (rescaled O, P, m, l) before the consumer
      takes its tensor-core turn, so that no softmax work (row sum, O's rescale) is scheduled
      after the barrier, inside the turn (tokamax's sm90 forward pins its row sum the same way).
      Compiled only. H200 (session 6, 16x1024x16x128): +1.2% forward causal, +0.4% full; on
      by default for masked calls (with ``named_free``).
    named_free: the consumers release K/V ring slots on hardware named barriers (``bar.arrive``;
      the producer ``bar.sync``s before refilling) instead of mbarriers, on which all 128
      threads of a warpgroup arrive with a shared-memory atomic each (tokamax's sm90 forward
      signals "consumed" the same way); also the backward's rings and the fused-dQ rendezvous.
      Compiled only, not with ``overlap``. H200 (session 6, 16x1024x16x128): forward +1.1%
      causal, -1.6% full; fwd+bwd +0.5% full, +1.0% causal. On by default for masked calls.
    no_auto_barriers: ``CompilerParams(unsafe_no_auto_barriers=True)``: no warpgroup barrier
      around SMEM stores and TMA issues (the kernel never reads and writes a region from the
      same thread, the condition that makes this safe). Compiled only.
    computed_ranges: for position-only masks (causal / window, or just S off the K/V block; no
      kv_lengths, no segment ids) compute each CTA's K/V block range from its tile index in the
      kernel instead of TMA-loading a per-tile record first (one dependent global load less per
      CTA). H200: within +-2% alone; on by default because the persistent launch needs it.
    persistent: launch one CTA per SM, each looping over (batch, head, query tile) tiles: the
      producer streams the next tile's K/V while the consumers finish the current one, and the
      next Q is loaded while O is written. Served when no per-tile metadata is needed (no mask,
      or ``computed_ranges``), without segment ids or ``overlap``, and when Q and O buffers fit
      in SMEM next to the ring (where a whole O buffer does not, e.g. H = 256, O is stored 64
      columns at a time through two slots); otherwise the one-CTA-per-tile grid runs. With
      ``block_kv = 256`` the grid runs too: that persistent loop hangs compiled on the H200
      (H = 64, session 8); unmasked H = 64 with 128-key blocks measured no faster than the grid
      with 256, while causal H = 64 with the tile counter and 128-key blocks is 7% faster (the
      default there, session 12).
    stream_tail: with ``persistent`` and no mask (no kv_lengths, segment ids or key padding,
      T a whole number of 2 * block_q tiles), cut the tiles of the last partial wave along
      the keys: every H = 128 row of the issue table has 2048 tiles on 132 SMs (15.5 waves),
      so 64 SMs idle through the sixteenth tile time. The first R rounds stay whole; the r
      tail tiles' K/V blocks are dealt evenly (Stream-K), each CTA's one or two parts written
      with their own lse and merged by XLA in key order (``stream_tail.py``: deterministic,
      two bf16 roundings of a tail row). On by default for unmasked calls from 4096 keys
      (``default_config``).
    stream_tail_merge: how ``stream_tail``'s parts are merged: "xla" (``stream_tail.merge``:
      a weights fusion and two scatters, 7.5 us on the H200 at 68 tail tiles, session 38) or
      "pallas" (``stream_merge.py``: one Triton program per tail tile writing O and lse in
      place; bitwise the same sums in interpret mode; inside shard_map the XLA merge serves).
      H100 (session 39): 5.8-5.9 us against the XLA merge's 5.7 there, no faster: "xla" stays.
    bwd_stream_tail: ``stream_tail`` for the unmasked grid backward kernels: the dK/dV
      launch runs the first R * SMs (K/V head, K/V tile, batch) tiles (the rest exit at once),
      then a persistent launch runs the tail tiles' Q blocks dealt evenly, one or two parts a
      CTA; the dQ kernel likewise over its (head, Q tile, batch) tiles and K/V blocks (the
      parts of a CTA one after the other). Float32 partials added by XLA in query / key order
      (deterministic). Not with the persistent, self-fed, fused-dQ or split forms, masks or
      ``seq_major``. Off: fwd+bwd 2-3% slower (H200 session 38, H100 session 39).
    dynamic_schedule: with ``persistent`` and a causal / window mask, each CTA claims its next
      tile from a global atomic counter, heaviest tiles first (``schedule.py``), instead of a
      static deal. Compiled only for the atomic (interpret mode publishes the round-robin
      successor through the same hand-over). Not under shard_map-varying operands (the
      one-CTA-per-tile grid runs there). Tiles are numbered as the grid launches them
      (batch slowest, heaviest rank first, head fastest) for L2 reuse; on the H200 that made
      causal forwards 6-18% faster than the grid at T = 1024 / 4096 (benchmarks/NOTES.md,
      session 7), so ``default_config`` turns it on for masked calls up to 4096 keys.
    consumers: forward consumer warpgroups per CTA, 2 (default) or 3: a CTA then holds
      ``3 * block_q`` query rows (FA3's 192-row tile at head dim 64), so every K/V block that
      crosses the ring feeds 50% more matmul, and the three take turns on the tensor cores
      (named barriers in a ring). Registers per thread 160 (consumers) / 32 (producer) instead
      of 232 / 40: S, P and O of a 64-row tile must fit in 160, so 128-key blocks at most at
      head dim 64. Not with ``overlap`` or ``persistent`` (the grid runs). The backward keeps
      two. H200 (session 10, 4x4096x32x64): 1.2079 ms with 128-key blocks against the
      default's 1.2021 (two consumers, 256 keys), 0.84x cuDNN causal against 0.94x: off.
    exp2_poly_cols: forward: in blocks with no masked score, the first this many key columns
      take 2^x from a degree-3 polynomial on the FMA pipe (``fastexp.exp2_poly``, relative error
      < 8e-5, below P's bf16 rounding) instead of the MUFU unit. That unit's 16 results per clock
      per SM make the exponentials as long as the matmuls at head dim 64 (Nsight Compute,
      session 9: XU and tensor pipes each ~48% busy). FlashAttention-4 splits its exponentials
      between the two units the same way. A multiple of 8 (a register tile of the wgmma layout);
      0 (off) by default. H200 (session 11): 1-7% slower at head dims 64, 128 and 256, so off.
    sum_in_pv: forward: P's row sum (one FADD per score, ~1 of the softmax's ~4.8 instructions
      per score at head dim 64) is computed after the P V wgmma is issued, inside its scope, so
      it runs under the matmul instead of before the consumer's tensor-core turn (the order of
      tokamax's sm90 step). Same sum of the same float32 P: bitwise the same output in
      interpret mode (tests; compiled, not yet compared). Not with ``overlap`` (its own loop).
      Not yet measured: off.
    lazy_rescale: forward: FlashAttention-4's conditional rescaling, with threshold ``tau``
      (log2 units; 0.0 = off). The online softmax rescales O by alpha = 2^(m_old - m_new) each
      time a row's running max grows (FA2 Alg. 1 line 10): at H = 256 that is 128 FMULs a
      thread per step, ahead of the P V wgmma that accumulates into O. Here the warpgroup
      keeps its stale maxima while no row's max grew by more than ``tau`` since it was taken:
      P = 2^(c s - m_stale) <= 2^tau, O and l accumulate as before, and the rescale (with the
      new maxima) runs only on the steps where some row's max grew by more. The result is the
      same softmax (l and O use the same maxima, and lse = m + log2 l), up to float32
      rounding; P in bf16 keeps its relative precision up to 2^tau. One cross-warp max per
      step decides (a warpgroup-uniform branch). 8.0 is FA4's choice; values above ~100 would
      risk overflow of l and O in float32. Not with ``overlap`` (its own loop) nor
      ``sum_in_pv``. Written in session 16 for the H = 256 forward (0.93x cuDNN there, where
      tokamax runs a rescale threshold too). H200 (session 17), forward, tau 8: causal
      4x4096x8x256 0.4362 -> 0.4248 ms (1.03 -> 1.06x cuDNN; ``default_config`` turns it on
      for masked calls at head dims over 128); full 4x4096x8x256 0.8016 -> 0.8062, and the
      H = 128 full rows 5-6% slower. Its kernels keep Pallas's 2 KB cross-warp reduction
      scratch (the max crosses warps); ignored where that does not fit (H = 256 with 80-key
      blocks, the persistent launch's O chunks or 3 K + 2 V slots).
    q_regs_cols: forward (compiled): the first this many columns of Q (a multiple of 64; values
      above the head dim take all of it) are the A operand of S = Q K^T from registers, loaded
      once per tile, instead of from shared memory. With both operands in SMEM an m64 n64 k16
      wgmma reads 128 B per tensor-core cycle, all the SM's SMEM bandwidth, and K/V's TMA
      writes need it too (NOTES, session 12); Q in registers takes H / 2 registers a thread, so
      at H = 256 (O alone is 128) only a part fits. Interpret mode ignores it (no register
      wgmma operands there); not with ``overlap`` (its own loop keeps Q in SMEM); nor in the
      unmasked loop when ``block_kv`` equals the head dim (``operands.register_q_cols``: wrong
      outputs compiled at H = 128 / 128 keys and H = 64 / 64 keys, cause not located).
      H200 (session 14): H = 64 +4% (full and causal 4x4096x32x64, now the default there);
      H = 128 causal and H = 256 within +-1.5%. 0 (off) elsewhere.
    bwd_dq_regs: the compiled dQ kernel takes Q and dO (the same for every K/V block of its
      tile) as register A operands of S = Q K^T and dP = dO V^T: its SMEM reads per step drop
      from 80 to 48 KB a consumer at H = 128, for 64 more registers a thread (dQ 64 + S 32 +
      dP 32 + Q 32 + dO 32 at 64-key steps). Interpret mode ignores it. H200 (session 14):
      bitwise the same gradients, the dQ kernel 0.5% (full) to 3% (causal) faster at
      4x4096x16x128, no spills: on by default (``default_config``; the field's own default
      stays False so that ``Config()`` is the plain kernel).
    bwd_dq_serial: the compiled dQ kernel waits for S = Q K^T and computes P before it issues
      dP = dO V^T (default: both issued back to back, P computed while dP runs, FA3 Section
      3.3). One [block_q, block_kv] float32 accumulator fewer in flight per consumer, for the
      head dims where dQ's own accumulator is large (128 registers a thread at H = 256, where
      the dQ kernel spills 460-492 bytes at 232-240 registers, session 16); the other consumer
      keeps the tensor cores busy meanwhile. Same products in the same order: the same
      gradients. Interpret mode has no async form (ignored there). H200 (session 16), H = 256
      dQ kernel: 1.598 ms (232 registers) / 1.414 ms (240) against 1.563 (240, overlapped) at
      4x4096x8x256 full; causal 0.954 / 0.880 against 0.955 (ptxas: 340-380 bytes of spills
      either way, from 460-492 with one K/V slot). Default for head dims over 128 only.
    bwd_delta_in_dq: D = rowsum(dO * O) (FA2 Algorithm 2, line 4) computed by the dQ kernel's
      consumers for their own rows (O loaded once per CTA beside Q and dO) and handed to the
      dK/dV kernel in the [B, N, 2, T] row record the dQ kernel writes, instead of a separate
      pre-pass kernel over dO and O (~0.04 ms per 2^25 elements each: 3-5% of fwd+bwd at
      16x1024x16x128). Served where the O buffer fits in the dQ kernel's shared memory next to
      its full rings (H <= 128) and the two-kernel backward runs; else the pre-pass. Summation
      order differs from the pre-pass (D to ~1 ulp). Default at H <= 128 (``default_config``;
      H100, session 28: fwd+bwd -2.7% at 16x1024x16x128 full, -4.5% causal).
    bwd_persistent: the dK/dV and dQ kernels as persistent launches (one CTA per SM looping
      over the tiles round-robin; the kernels' ``num_ctas``): the producer's ring (Q/dO;
      K/V) runs on across tiles and each consumer double-buffers its own tile (K/V; Q, dO,
      L2/D), so a tile's start and end (its loads, its dK/dV or dQ stores) overlap the
      neighbouring tiles' work instead of leaving the SM idle between CTAs. Unmasked calls (no
      mask, kv_lengths or segment ids, S a multiple of the CTA's keys) without the fused dQ or
      the split backward, each kernel where its second buffers fit (H <= 128; the dQ kernel
      not with ``bwd_delta_in_dq`` at H = 128); else the grid. Same products in the same
      order: bitwise the grid kernels' gradients. At 16x1024x16x128 the grid kernels run
      14-18% below their 4x4096 efficiency (short CTAs). H100 (session 28): 16x1024 full
      fwd+bwd -3.4% (dK/dV -3.5%, dQ -6%), 8x2048 even, 4x4096 +3% (both kernels slower):
      ``default_config`` takes it for unmasked rows up to ``PERSISTENT_BWD_KEYS`` keys. With
      its tiles numbered tiles-first (session 38) still slower at 4x4096 / 2x8192: fwd+bwd
      +1.3% / +2.0% (H100, session 46; Nsight Compute: the tile-boundary code it saves comes
      back as its consumers' waits for Q / dO).
    exit_read_only: every attention kernel (forward, dQ, dK/dV; compiled) ends by waiting until
      its last TMA stores have read shared memory (``cp.async.bulk.wait_group.read``) instead
      of until their writes have landed: the CTA leaves, and the next one starts on its SM,
      one global-write latency earlier. The writes still complete before the next kernel
      reads them (the kernel boundary), as CUTLASS's ``tma_store_wait`` and tokamax's sm90
      kernels rely on. Matters where CTAs are short and many (16x1024: ~2048 CTAs a kernel,
      ~15 waves). H100: within 0.2% at 16x1024x16x128 (session 28) and 0.1% at 4x4096 /
      2x8192 full (session 46), fwd+bwd: off.
    bwd_turns: the two consumers of the compiled grid dK/dV kernel issue each step's S^T and
      dP^T in turn on a pair of hardware barriers, as the forward's ping-pong does (FA3
      Section 3.1), so one consumer's softmax overlaps the other's products. Not with the
      fused dQ, the self-fed ring or ``bwd_masked_halves``; bitwise the same gradients.
      Default on unmasked H = 128 rows from 4096 keys (masked calls: opt-in, untimed).
    bwd_dkdv_regs: the compiled dK/dV kernel's consumer holds its K ("k"), V ("v") or both
      ("kv") tiles in registers as the A operand of S^T = K Q^T / dP^T = V dO^T: 16 KB less of
      SMEM reads per step and tile (at H = 128), 32 registers a thread each next to dK and dV's
      128 (the kernel already spills ~50 bytes at 232). Interpret mode ignores it. H200
      (session 14): bitwise the same gradients but the dK/dV kernel 9-17% slower ("k": 1.675
      -> 1.835 ms at 4x4096x16x128 full; "v": 1.853) with 312 bytes of spills. "" (off).
    bwd_early_stats: when the compiled dK/dV kernel reads a step's lse and D (16 registers a
      thread each) from the stats ring. Read after the wgmma waits, each shared-memory load sat
      in front of its first use, queued behind the products' SMEM operand reads, and the
      softmax's FFMAs waited on it (19% of the consumers' stall samples, Nsight Compute,
      session 30). "": after the waits; "lse" / "lse+delta": while S^T = K Q^T and
      dP^T = V dO^T run; "lse+delta_early": D before dV's wgmma is issued; "lse_pre": lse
      before S^T and dP^T are issued (ptxas keeps its loads ahead of the first wgmma);
      "lse_pre+delta_early": both; "lse_pre+delta_acc": lse as "lse_pre", and -D written into
      dP^T's accumulator before its issue, so that the wgmma returns dP^T - D (no FADD waits
      on D; dK moves by float32 rounding). Unmasked steps only; the split kernel (H > 128)
      reads what the name contains before its products; interpret mode ignores it. Default:
      "lse_pre" at H = 128 (fwd+bwd 0.93-0.96x the time of the earlier defaults causal,
      0.98-1.00x full, H100, session 43), "lse+delta" elsewhere (``default_config``). Each
      form's measurements: benchmarks/NOTES.md, sessions 30-32 and 42-43.
    bwd_dq_delta_acc: the compiled dQ kernel starts each step's dP accumulator from -D (D is
      held in registers across the loop), so the wgmma returns dP - D and dS = P (dP - D)
      needs no subtraction after dP's wait. In the causal mask-free loop the -D write replaces
      dP's 32 zeroing MOVs: 275 -> 244 instructions a step (offline SASS, session 43). dQ
      moves by float32 rounding. Default at H = 64 and 128 (fwd+bwd 0.98-0.99x causal, 0.99x
      full, H100, session 44); off at H = 256 (the split backward's dQ kernel, untimed).
    bwd_masked_halves: with 128-query dK/dV steps (``bwd_dkdv_block_q`` or ``bwd_block_q``
      128), each masked step (the diagonal of a causal or windowed call, key / segment masks)
      runs as two 64-query halves, the 64-wide step twice: S^T and dP^T are [block_kv, 64]
      tiles, so the masked steps need no more registers than the 64-wide kernel while the
      mask-free steps stay 128 wide. ptxas (offline, causal 1x4096x2x64, 240 registers): the
      dK/dV kernel spills 368 B with masked 128-query steps and 0 B with the masked steps
      removed altogether (session 34). Not with the fused dQ, ``bwd_defer_wait`` or
      ``bwd_pt_smem`` (ignored there). Default for causal and windowed H = 64 calls from 512
      keys without key masks (session 35, ``default_config``).
    bwd_free_first: the grid dK/dV kernel visits a tile's mask-free Q blocks first, then the
      masked ones (the ring order rotated, producer and consumers alike). In the causal kernel's
      SASS the mask-free loop, coming second, zeroes dP^T's accumulator with 32 moves a step
      and starts its first wgmma ~50 instructions later than the unmasked kernel's loop; emitted
      first, it starts from zero through the wgmma's own flag like the unmasked loop (offline,
      1x4096x2x128, session 41). dK, dV change by float32 summation order. Not with the fused
      dQ or the persistent form (ignored there). Off until timed.
    bwd_self_fed: the grid dK/dV kernel is launched with its two consumer warpgroups only, and
      consumer 0 fills the Q / dO / stats ring itself (``backward.dkdv_kernel``): without the
      producer's share of the register file, ptxas may give each consumer thread up to 255
      registers instead of 240. Offline (1x4096x2x128, session 30), 248-256 registers a
      consumer remove the spills at H = 128 and let ``bwd_defer_wait`` (a step's dK wgmma
      waited by the next step, so the tensor cores get the next S^T and dP^T while it
      finishes) compile without C7512, which serialises every wgmma at 240. Not with the
      persistent, fused-dQ or split forms or ``named_free`` (ignored there). Off until timed.
    bwd_fold_batch: the unmasked grid dK/dV kernel sees K, V, dK and dV as one [1, B * S]
      sequence, its tile axis running over every batch's K/V tiles, so only its producer (the
      Q / dO fetch) derives the batch. Its consumers' step loop is then the one ptxas builds
      for a single sequence (offline SASS), yet no faster: H100 (session 45), with 232
      registers, fwd+bwd 0.997-0.999 of the default's time at 4x4096, 2x8192 and 8x2048
      x16x128, bitwise the same results. Off. Not with masks, persistent, split, self-fed or
      stream-K forms.
    bwd_joint: the dQ and dK/dV grid kernels in one launch, dQ CTAs first, each dK/dV CTA
      waiting on a GMEM semaphore for its heads' D records (``backward_joint.py``), so the
      dK/dV CTAs fill the SMs the dQ kernel's last partial wave leaves idle. Unmasked calls
      with D in the dQ kernel and neither persistent, stream-K, fold nor self-fed forms;
      bitwise the two launches' gradients (interpret and compiled). Off: slower fwd+bwd than
      two launches on the H100 (session 48: 1.3-2.5% paired, 1.0-2.4% even unsynchronised).
    seq_major: the grids of the forward (not persistent), dQ and dK/dV kernels are laid out
      (tiles, heads, batch) instead of (heads, tiles, batch). Mosaic GPU launches the last
      grid axis fastest, so the default launches batch, then tiles, then heads (one head's
      tiles resident together, sharing its K / V or Q / dO in L2) and ``seq_major`` batch,
      then heads, then tiles (the resident CTAs span every head: at 1x16384x16x128 that is 16
      heads x 8 MB of K and V, more than the L2). Same work per CTA, the same results. H200
      (session 19): slower everywhere, most at 1x16384x16x128 full (forward +12%, dK/dV +10%,
      dQ +7%), 2-8% per backward kernel at 4x4096. (Session 19 described the two orders the
      other way round; corrected in session 38.) Off.
    fp8_p_registers: FP8 forward (``pallas_attn.flash_attention_fp8``, compiled): P stays in
      registers as P V's e4m3 A operand instead of going through shared memory. The 8-bit
      operand layout gives a thread 4 consecutive keys of a 16-key group where the f32
      accumulator gives it keys {2q, 2q+1, 8+2q, 9+2q}, so V's keys are permuted within each
      group to match (``fp8_layout.to_fp8_key_order``, before the kernel) and P's registers are
      regrouped without moving data (``operands.p_as_8bit_operand``). On by default: 7% faster
      than P through SMEM at 4x4096x16x128 full (0.858 against 0.927 ms, H100) and 2.2x at
      4x4096x8x256 (0.842 against 1.817, H200), where the defaults' 64-key blocks make the
      SMEM round trip dominate (each pair in one process, session 24; benchmarks/NOTES.md).
      Ignored by the bf16 kernels.
  """
  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  v_stages: int = 0
  bwd_block_q: int = 64
  bwd_block_kv: int = 64
  bwd_dkdv_block_q: int = 0
  bwd_num_stages: int = 2
  bwd_dq_block_kv: int = 64
  bwd_fused_dq: bool = False
  bwd_defer_wait: bool = False
  bwd_registers: int = 232
  bwd_dq_registers: int = 0
  bwd_pt_smem: bool = False
  bwd_dq_writer: bool = False
  bwd_dq_lag: bool = False
  bwd_split_dkdv: bool = False
  backward: str = "mosaic"
  overlap: bool = False
  fold_scale: bool = True
  named_barriers: bool = True
  early_k_wait: bool = False
  pin_softmax: bool = False
  named_free: bool = False
  no_auto_barriers: bool = False
  computed_ranges: bool = True
  persistent: bool = False
  dynamic_schedule: bool = False
  stream_tail: bool = False
  stream_tail_merge: str = "xla"
  bwd_stream_tail: bool = False
  consumers: int = 2
  exp2_poly_cols: int = 0
  sum_in_pv: bool = False
  lazy_rescale: float = 0.0
  q_regs_cols: int = 0
  bwd_dq_regs: bool = False
  bwd_dq_serial: bool = False
  bwd_dq_delta_acc: bool = False
  bwd_dkdv_regs: str = ""
  bwd_early_stats: str = ""
  bwd_masked_halves: bool = False
  bwd_free_first: bool = False
  bwd_self_fed: bool = False
  bwd_fold_batch: bool = False
  bwd_joint: bool = False
  bwd_delta_in_dq: bool = False
  exit_read_only: bool = False
  bwd_turns: bool = False
  bwd_persistent: bool = False
  seq_major: bool = False
  fp8_p_registers: bool = True

  def __post_init__(self):
    if self.block_q not in (64, 128):
      raise ValueError(f"Config.block_q must be 64 or 128, got {self.block_q}")
    if self.block_kv % 16 or not 64 <= self.block_kv <= 256:
      raise ValueError(f"Config.block_kv must be a multiple of 16 in [64, 256], got "
                       f"{self.block_kv}")
    for f in ("bwd_block_q", "bwd_block_kv", "bwd_dq_block_kv"):
      if getattr(self, f) not in (64, 128):
        raise ValueError(f"Config.{f} must be 64 or 128, got {getattr(self, f)}")
    if self.bwd_dkdv_block_q not in (0, 64, 128):
      raise ValueError("Config.bwd_dkdv_block_q must be 0 (bwd_block_q), 64 or 128, got "
                       f"{self.bwd_dkdv_block_q!r}")
    if self.consumers not in (2, 3):
      raise ValueError(f"Config.consumers must be 2 or 3, got {self.consumers!r}")
    if self.exp2_poly_cols < 0 or self.exp2_poly_cols % 8:
      raise ValueError("Config.exp2_poly_cols must be a non-negative multiple of 8, got "
                       f"{self.exp2_poly_cols!r}")
    if self.q_regs_cols < 0 or self.q_regs_cols % 64:
      raise ValueError("Config.q_regs_cols must be a non-negative multiple of 64, got "
                       f"{self.q_regs_cols!r}")
    if self.stream_tail_merge not in ("xla", "pallas"):
      raise ValueError("Config.stream_tail_merge must be 'xla' or 'pallas', got "
                       f"{self.stream_tail_merge!r}")
    if self.bwd_early_stats not in EARLY_STATS:
      raise ValueError(f"Config.bwd_early_stats must be one of {EARLY_STATS}, "
                       f"got {self.bwd_early_stats!r}")
    if self.bwd_dkdv_regs not in ("", "k", "v", "kv"):
      raise ValueError("Config.bwd_dkdv_regs must be '', 'k', 'v' or 'kv', got "
                       f"{self.bwd_dkdv_regs!r}")
    if self.bwd_registers not in (224, 232, 240):
      raise ValueError(f"Config.bwd_registers must be 224, 232 or 240, got {self.bwd_registers!r}")
    if self.bwd_dq_registers not in (0, 224, 232, 240):
      raise ValueError("Config.bwd_dq_registers must be 0 (bwd_registers), 224, 232 or 240, "
                       f"got {self.bwd_dq_registers!r}")
    if not 0.0 <= self.lazy_rescale <= 100.0:
      raise ValueError("Config.lazy_rescale must be in [0, 100] (log2 units; 0 = off), got "
                       f"{self.lazy_rescale!r}")
    if self.lazy_rescale and (self.overlap or self.sum_in_pv):
      raise ValueError("Config.lazy_rescale is not served with overlap or sum_in_pv")
    if self.v_stages and not 1 <= self.v_stages <= 4:
      raise ValueError(f"Config.v_stages must be 0 (same as num_stages) or in [1, 4], got "
                       f"{self.v_stages!r}")
    if self.v_stages and self.overlap:
      raise ValueError("Config.v_stages is not served with overlap (one slot index for K and V)")
    if self.bwd_dq_lag and self.bwd_dq_writer:
      raise ValueError("Config.bwd_dq_lag and Config.bwd_dq_writer are two forms of the fused dQ;"
                       " choose one")
    if self.backward not in BACKWARDS:
      raise ValueError(f"Config.backward must be one of {BACKWARDS}, got {self.backward!r}")
    for f in ("num_stages", "bwd_num_stages"):
      if not 2 <= getattr(self, f) <= 4:
        raise ValueError(f"Config.{f} must be in [2, 4], got {getattr(self, f)}")


def padded_head_dim(head_dim: int) -> int:
  """Smallest native head dim >= head_dim (the rest is zero padding)."""
  for h in HEAD_DIMS:
    if head_dim <= h:
      return h
  raise NotImplementedError(f"mosaic backend supports head_dim <= {HEAD_DIMS[-1]}, got {head_dim}")


# Key count from which unmasked head-dim-128 rows take three forward consumers (default_config).
PERSISTENT_BWD_KEYS = 1024     # default_config: persistent backward kernels up to this many keys
LONG_ROW_THREE_CONSUMERS = 16384


def default_config(*, head_dim: int, seq_k: int, masked: bool = False,
                   key_masks: bool = False, windowed: bool = False,
                   batch: int | None = None) -> Config:
  """Heuristic defaults, checked against an H200 sweep (benchmarks/mosaic_tune.py, NOTES.md).

  ``masked``: a causal / windowed call. Without such a mask the persistent launch made rows
  0-15% faster on the H200 (T = 16384 to T = 1024). With one, a static deal of tiles of very
  different lengths leaves SMs idle (5-50% slower), so masked calls take the persistent launch
  only with the dynamic tile counter (``dynamic_schedule``): 6-18% faster than one CTA per tile
  up to 4096 keys, 1-1.5% at 8192-16384 keys (H = 128; at H = 64 it is 1% slower there, so
  causal H = 64 calls over 4096 keys keep the grid, windowed ones do not). Only at head dims
  64 and 128 (see the comments below).

  ``key_masks``: the call carries segment ids or ``kv_lengths`` (the H = 64 backward then
  gives both kernels 240 registers for the compares); ``windowed``: it has a window (and is
  then ``masked`` too; the H = 64 dQ kernel then keeps 64-key steps). ``batch``: the call's
  batch size where known (one sequence compiles the backward's index arithmetic to another
  step loop, which takes other registers best; None: as for several).

  The consumer holds S [block_q, block_kv] and O [block_q, H] in fp32 registers (64-row wgmma
  tiles spread over 128 threads: block_kv / 2 + H / 2 registers each); at H = 256 a 128-key block
  would not fit next to O, so the K/V step shrinks to 64 keys. Short key sequences take 64-key
  blocks so the padding stays small.
  """
  hp = padded_head_dim(head_dim)
  if hp <= 64 and seq_k > 128:
    block_kv = 256        # H200 sweep at H=64: 256 keys per step beat 128 by 5-9%
  else:
    block_kv = 64 if hp > 128 or seq_k <= 64 else 128
  # The Mosaic wgmma backward (register reallocation, async wgmma): fwd+bwd 1.10-1.23x faster than
  # with the Triton FA2 backward on every H=128 row of the H200 A/B (benchmarks/NOTES.md,
  # session 5). Head dims whose dK/dV tiles overflow shared memory fall back to Triton anyway.
  # Masked calls: softmax pinned before the P V turn and K/V slots released on hardware
  # barriers: 2.1% faster forward and 1.0% faster fwd+bwd on causal 16x1024x16x128 (H200,
  # session 6; the unmasked row was 0.8% slower forward with both, so they stay off there).
  # Masked calls up to 4096 keys: persistent with the dynamic tile counter (schedule.py), tiles
  # numbered batch slowest, heaviest rank first, head fastest: causal
  # forward 0.1707 -> 0.1442 ms at 16x1024x16x128 and 0.4535 -> 0.4281 at 4x4096x16x128 (cuDNN
  # 0.1524 / 0.4632; H200, session 7). Longer causal rows were 1.4% slower with the counter in
  # the older, L2-hostile order; re-measured in session 34 (below).
  # Other head dims keep one CTA per tile, with H = 64 the exception. The persistent loop with
  # 256-key blocks hangs compiled with named-barrier turns (H = 64, session 8; ops._forward
  # runs the grid then). On the causal 4x4096x32x64 row, 128-key blocks with the dynamic tile
  # counter made the forward 0.6708 -> 0.6222 ms (cuDNN 0.6295, 1.012x; H200, session 12).
  # At H = 256 a persistent request now runs, with O stored in 64-column chunks (ops._forward;
  # before session 12 it ran the grid); it has not been measured, so it is not a default there.
  # Session 34 (H100, one config per process, cuDNN's forward on the same inputs) took the
  # persistent H = 64 forms down to 129 keys, where the grid's CTAs of one or two steps spent
  # more on their launch, Q load and pipeline fill than on the product: causal forward
  # 0.2752 -> 0.2021 ms at 16x1024x32x64 (0.72 -> 0.97x cuDNN), 0.2294 -> 0.1408 at 32x512
  # (0.56 -> 0.91x), 0.1801 -> 0.1084 at 64x256 (0.53 -> 0.88x). Over 4096 keys the counter
  # form was 1% slower at H = 64 (1x16384x32x64 causal 2.2043 -> 2.2272 ms) and 1.1-1.5%
  # faster at H = 128 (1x16384x16x128 causal 1.6452 -> 1.6205, 2x8192 0.8500 -> 0.8408; H100,
  # session 34), so masked H = 128 calls take it at every length. Windowed H = 64 calls take
  # it over 4096 keys too: at 1x16384x32x64 window (1024, 0) the grid's 256-key blocks cost a
  # 128-query tile 5-6 blocks with masked edges over its band of 1152 keys, 128-key blocks 10
  # narrower ones: forward 0.4782 -> 0.3851 ms (0.86 -> 1.07x cuDNN's 0.4134), fwd+bwd 1.5988
  # -> 1.5066 (0.97 -> 1.03x; H100, session 36). The static deal measured 0.3809 (a window's
  # tiles are of near-equal length); the counter is kept for windows as wide as the row.
  causal_h64 = hp == 64 and masked and 128 < seq_k and (seq_k <= 4096 or windowed)
  if causal_h64:
    block_kv = 128
  # Unmasked H = 64 rows over 1024 keys: the persistent loop with 256-key blocks and the
  # consumers' turns on mbarriers (on named barriers that form hangs, see ops._forward):
  # 4x4096x32x64 1.2016 -> 1.1514 ms (cuDNN 1.1384: 0.948 -> 0.989x; H200, session 13); at
  # 8x2048 0.5705 ms against 0.6386 with 128-key blocks; 1x16384x32x64 4.4652 -> 4.2804 ms
  # (0.99 -> 1.03x cuDNN; H100, session 34).
  full_h64 = hp == 64 and not masked and seq_k > 1024
  # Unmasked with 129-1024 keys: 128-key blocks, persistent, named-barrier turns, Q in
  # registers (H100, session 34): 16x1024x32x64 0.3701 -> 0.3187 ms (0.84 -> 0.97x cuDNN; the
  # 256-key form above 0.3180), 32x512 0.2388 -> 0.1826 (0.72 -> 0.95x; 256-key form 0.1885),
  # 64x256 0.1679 -> 0.1160 (0.61 -> 0.88x). With mbarrier turns the 128-key form was 6% slower.
  short_h64 = hp == 64 and not masked and 128 < seq_k <= PERSISTENT_BWD_KEYS
  if short_h64:
    block_kv = 128
  persistent_ok = hp == 128 or causal_h64 or full_h64 or short_h64
  # Q in registers (q_regs_cols) on those two H = 64 rows: full 1.1488 -> 1.1051 ms (0.989 ->
  # 1.030x cuDNN), causal 0.6225 -> 0.6079 (1.011 -> 1.041x; H200, session 14). At H = 128 /
  # 256 it measured within +-1.5% (and the unmasked H = 128 form is not served, see
  # operands.register_q_cols). The dQ kernel's Q and dO in registers (bwd_dq_regs): bitwise the
  # same gradients, its kernel 0.5-3% faster at H = 128 (session 14).
  # Head dims over 128: the split dK/dV kernel and the dQ kernel with S waited for before dP
  # (bwd_dq_serial), without Q / dO in registers (128 more registers next to dQ's 128: the
  # causal dQ kernel 1.33 -> 1.83 ms with them) and at 240 registers: fwd+bwd 1.043x / 1.019x
  # cuDNN at 4x4096x8x256 full / causal, against 0.35x with the Triton FA2 backward (H200,
  # session 16; the serial order and 240 registers took the dQ kernel 1.563 -> 1.414 ms full).
  # Masked calls at head dims over 128: FA4's conditional rescaling (lazy_rescale, tau = 8):
  # causal 4x4096x8x256 forward 0.4362 -> 0.4248 ms (1.03 -> 1.06x cuDNN; twice, H200, session
  # 17). Unmasked it measured +0.6% at H = 256 and +5-6% at H = 128 (its per-step cross-warp
  # max costs more than the multiply it skips), so those rows keep rescaling every step.
  # Three consumer warpgroups (the grid launch; the persistent one is written for two) on long
  # unmasked H = 128 rows: 1x16384x16x128 forward 3.1576 -> 3.1314 ms (cuDNN 3.1383: 0.994 ->
  # 1.002x; H200, session 27) and 3.157 -> 3.126 on an H100 (session 26). At 4096 keys it was
  # 13% slower (session 26), so it starts at LONG_ROW_THREE_CONSUMERS keys.
  three = hp == 128 and not masked and seq_k >= LONG_ROW_THREE_CONSUMERS
  wide = hp > 128
  # Backward (H100, session 28, cuDNN in the same process): D formed in the dQ kernel instead
  # of a pre-pass kernel (bwd_delta_in_dq: the dQ kernel +0.024 ms, the 0.052 ms pre-pass
  # gone at 2^25 elements; 16x1024x16x128 fwd+bwd 1.0653 -> 1.0361 ms full, 0.7420 -> 0.7086
  # causal; 8x2048 full 1.8878 -> 1.8598), served at H <= 128. And on unmasked rows up to
  # PERSISTENT_BWD_KEYS keys the persistent dK/dV kernel (bwd_persistent; the dQ kernel keeps
  # the grid next to D's O buffer at H = 128): 16x1024 full dK/dV 0.4658 -> 0.4526 ms, fwd+bwd
  # 1.0342 -> 1.0239 (1.009x cuDNN); at 2048 keys even, at 4096 3.6% slower (tiles of 64
  # steps gain nothing at their ends and lose L2 order).
  # 240 registers a backward consumer (producer 24) at H = 128 on the grid kernels (H100,
  # session 29, both timing orders, cuDNN in the same process): dK/dV -1.5..-3% at 16x1024 and
  # 8x2048, -0.6..-1.1% at 4x4096, causal and full (dQ within +-0.4%); the persistent dK/dV
  # kernel was 0.6-2% slower with it, so rows that take it keep 232.
  bwd_persistent = not masked and seq_k <= PERSISTENT_BWD_KEYS
  registers = 240 if wide or (hp == 128 and not bwd_persistent) else 232
  # One sequence (batch 1) at H = 128, unmasked, no key masks: the batch index is a constant,
  # and ptxas builds another dK/dV step loop (319 instructions at 232 registers, 1 local load a
  # step, against 330 with 4 local loads and stores for batch >= 2: offline SASS, identical
  # at every length). That loop at 232 registers beats 240 by 13% in the dK/dV kernel's cycles
  # (Nsight Compute, no clock control, 1x16384x16x128: 9.74 M against 11.23 M); paired fwd+bwd
  # against 240, both orders: 1x16384x16x128 0.961 / 0.962 (twice), 1x32768x8x128 0.960 (H100,
  # session 42). With batch >= 2, 232 is 4-6% slower (8x2048 to 2x8192), so they keep 240.
  # With "lse_pre" (below, session 43) the batch-1 pair ties (1x16384: 1.000) and 232 stays
  # 4.7% / 4.1% slower at 4x4096 / 2x8192 full.
  if hp == 128 and not masked and not key_masks and not bwd_persistent and batch == 1:
    registers = 232
  # A step's lse and D read while S^T / dP^T run (bwd_early_stats; H100, session 31, both
  # timing orders at H = 128, one at H = 64 / 256; gradients bitwise the same): the dK/dV
  # kernel with "lse+delta" 11.5% / 16% faster at 4x4096x32x64 full / causal, 11% / 10% at
  # 4x4096x8x256, 5% at 16x1024x16x128 full (persistent), 1% at 4x4096x16x128 causal. On
  # the unmasked H = 128 grid kernel "lse" alone: 4x4096 full 1.620 -> 1.496 ms, against
  # 1.650 with both (there ptxas put D's loads between dV's register-operand wgmmas; its spill
  # traffic stays outside the step loop with either: offline SASS, see "lse+delta_early";
  # reading D before dV's wgmmas, "lse+delta_early", measured no better: session 32).
  # H = 128: "lse_pre", lse read before S^T / dP^T are issued, so that its shared-memory
  # loads do not queue behind the wgmmas' operand reads (the first softmax FFMA waited on them:
  # 8-18% of the step loop's stall samples, Nsight Compute, session 42). Paired fwd+bwd
  # against the rules above ("lse" full, "lse+delta" causal / persistent), both orders, H100,
  # session 43, variant ms / default ms: causal 0.928 (2x8192) to 0.964 (16x1024); full
  # 0.977 (8x2048) to 0.996 (1x16384, batch-1 232 registers). Gradients bitwise the same.
  early_stats = "lse_pre" if hp == 128 else "lse+delta"
  # -D as the dQ kernel's starting dP accumulator (bwd_dq_delta_acc), paired fwd+bwd against
  # the rules above, both orders, H100, session 44: causal 0.979 (4x4096x32x64) to 0.991
  # (1x16384x16x128), full 0.993-0.995 (16x1024 to 2x8192 at H = 128, 4x4096x32x64).
  # H = 64 backward over 1024 keys (the grid dK/dV kernel), 128-wide steps in both kernels:
  # 128 queries a dK/dV step (bwd_dkdv_block_q; halves the step's fixed costs, see Config)
  # without early stats, 128 keys a dQ step. H100, session 32, both timing orders, cuDNN in
  # the same process, 4x4096x32x64:
  # - full: dK/dV 1.972 -> 1.741-1.754 ms, dQ 1.397 -> 1.304-1.312, fwd+bwd 4.466 ->
  #   4.137-4.163 (0.921 -> 0.991-0.995x cuDNN). 128-query steps with "lse+delta" spill and
  #   doubled the kernel's time; with "lse" at 240 registers fwd+bwd was 4% slower.
  # - causal: the dQ kernel at 240 registers (bwd_dq_registers; 76 B spilled at 232, 0 at
  #   240; the dK/dV kernel was 1-2% slower at 240) 0.832 / 0.835 -> 0.790 / 0.797 ms; dK/dV
  #   1.082 / 1.074 -> 1.057 / 1.040 although ptxas spills ~480 B there (mostly in the masked
  #   diagonal steps; 10 local loads / stores a step in the mask-free loop; at 240 a tie);
  #   fwd+bwd 2.499 / 2.485 -> 2.472 / 2.435 (0.98 -> 0.99-1.00x).
  # - unmasked with key masks (segment ids, kv_lengths; or keys padded to 128, which mask like
  #   kv_lengths): at 232 registers ~100 B spilled in the dK/dV step loop, at 240 (both
  #   kernels) 0 B (ptxas offline, session 33). 4x4096x32x64 with kv_lengths (odd rows 75% of
  #   the keys; cuDNN given the same lengths), both orders: fwd+bwd 4.364 / 4.366 -> 4.034 /
  #   4.035 ms (0.913 -> 0.987-0.989x cuDNN); 4x4000x32x64 (keys padded): 5.154 / 5.096 ->
  #   4.858 / 4.813 (H100, session 33).
  # - causal with key masks, both kernels at 240 (at 232 the dQ kernel spills 344 B; offline):
  #   4x4096x32x64 with kv_lengths 2.653 / 2.639 -> 2.511 / 2.494 ms, 0.96 -> 1.02x cuDNN
  #   (H100, session 33, both orders; the dQ kernel alone at 240: 2.611 / 2.605).
  # - 1024 keys (the unmasked dK/dV kernel persistent), both kernels at 240 (at 232 the dK/dV
  #   kernel spills 48 B unmasked, the dQ kernel 76 B causal; 0 B at 240, offline).
  #   16x1024x32x64, both orders, gradients bitwise the same: full 1.381 / 1.368 -> 1.208 /
  #   1.208 ms (0.93 -> 1.07x cuDNN; dK/dV 0.58 -> 0.46, dQ 0.43 -> 0.38), causal 1.006 /
  #   1.005 -> 0.982 / 0.982 (0.93 -> 0.95x; with the dQ kernel alone at 240: 0.997). Shorter
  #   rows are not timed and keep the 64-wide steps (H100, session 33).
  # - 512 keys unmasked, both kernels at 240 (0 B spilled offline), the dK/dV kernel
  #   persistent: 32x512x32x64 0.806 / 0.803 -> 0.704 / 0.705 ms (1.06 -> 1.21x cuDNN; in the
  #   grid 0.821). Causal at 512 keys the pair alone measured 1-2% slower (its masked diagonal
  #   steps spill 368 B; H100, session 34); with the halves below it is faster.
  # - causal and windowed calls from 512 keys: the masked 128-query dK/dV steps as two
  #   64-query halves (bwd_masked_halves; offline the causal dK/dV kernel then spills 0 B at 240
  #   against 368 B whole, 484 B at 232), both kernels at 240. fwd+bwd ms (cuDNN), both orders
  #   where two are given: causal 4x4096x32x64 2.480 / 2.457 -> 2.408 / 2.417 (0.98-0.99 ->
  #   1.01x; dK/dV 1.054 -> 0.996), 1x16384x32x64 9.222 / 9.046 -> 8.381 / 8.385 (0.95 ->
  #   1.03-1.04x; dK/dV 3.92 -> 3.42), 16x1024x32x64 0.918 -> 0.895 (1.02 -> 1.05x),
  #   32x512x32x64 (64-wide steps before) 0.697 / 0.691 -> 0.680 / 0.682 (1.00-1.01 -> 1.02x,
  #   gradients bitwise the same). The halves at 232 registers: 2.52-2.54 ms at 4x4096, slower
  #   than without them (H100, session 35).
  # - windowed calls: the same dK/dV form with 64-key dQ steps (128-key ones spill 208 B):
  #   1x16384x32x64 window (1024, 0) 1.716 -> 1.575 ms (0.90 -> 0.98x cuDNN; H100, session 35).
  # - causal with key masks (no window) keeps session 33's form, the pair without halves from
  #   1024 keys: with them 1.0-1.1% slower at 4x4096x32x64 with kv_lengths (2.507 / 2.494 ->
  #   2.521 / 2.520, both orders; session 35); under 1024 keys 64-wide steps (the pair alone
  #   was slower at 512 causal keys, sessions 34-35).
  causal_keyed = masked and key_masks and not windowed
  h64_wide = hp == 64 and (seq_k >= PERSISTENT_BWD_KEYS or (seq_k >= 512 and not causal_keyed))
  if h64_wide:
    early_stats = ""
    if masked or key_masks or seq_k % 128 or seq_k <= PERSISTENT_BWD_KEYS:
      registers = 240
  halves = h64_wide and masked and not causal_keyed
  # The last partial wave of the persistent unmasked forward cut along the keys (stream_tail;
  # H100, session 37, forward incl. the merge's XLA kernels, one config per process, cuDNN on
  # the same inputs): 4x4096x16x128 0.8023 -> 0.7911 ms (0.999 -> 1.015x), 2x8192 1.5783 ->
  # 1.5517 (1.002 -> 1.020x), 4x4096x32x64 1.0933 -> 1.0725 (1.021 -> 1.041x), 1x16384x32x64
  # 4.2251 -> 4.1240 (1.031 -> 1.066x); at 8x2048 a tie (the kernel 4.3 us faster, the merge
  # 4.8 us), at 16x1024 3.5% slower: from 4096 keys. (1x16384x16x128 keeps three consumers on
  # the grid: two persistent with the tail cut measured 3.0700 / 3.0806 against 3.0887.)
  tail = not masked and seq_k >= 4096 and hp in (64, 128)
  # The grid dK/dV kernel's consumers issue S^T / dP^T in turn (bwd_turns; H100, session 46,
  # paired, both orders, bitwise): its kernel 1.674 -> 1.659 / 1.641 -> 1.625 ms at
  # 4x4096x16x128 full, -0.3 / -0.4% at 1x16384; the dQ kernel +0.2-1.3% and the persistent
  # dK/dV kernel +2% with the same turns, H = 64 +3%: unmasked H = 128 grid rows only, from
  # 4096 keys (2048, also the grid, was not timed with it).
  turns = hp == 128 and not masked and seq_k >= 4096
  return Config(block_q=64, block_kv=block_kv, num_stages=2, backward="mosaic",
                stream_tail=tail,
                bwd_delta_in_dq=not wide, bwd_persistent=bwd_persistent,
                consumers=3 if three else 2,
                bwd_split_dkdv=wide, bwd_dq_serial=wide, bwd_registers=registers,
                bwd_dq_delta_acc=not wide,
                persistent=persistent_ok and not three,
                dynamic_schedule=persistent_ok and masked,
                pin_softmax=masked, named_free=masked, named_barriers=not full_h64,
                q_regs_cols=64 if (full_h64 or causal_h64 or short_h64) else 0,
                bwd_dq_regs=not wide,
                lazy_rescale=8.0 if wide and masked else 0.0, bwd_early_stats=early_stats,
                bwd_dkdv_block_q=128 if h64_wide else 0,
                bwd_dq_block_kv=128 if h64_wide and not windowed else 64,
                bwd_masked_halves=halves, bwd_turns=turns)

"""GPTQ benchmark: our jit-compiled ``quant.gptq`` against the IST-DASLab algorithm in PyTorch.

For each layer (out x in) of ../shared/BENCHMARKS.md (4096 x 4096, 11008 x 4096, 4096 x 11008),
with 262,144 calibration tokens (128 batches of 2048, random normal activations with uneven
channel scales and a shared low-rank component, so the Hessian is realistic rather than ~I):

* Hessian accumulation, ours: ``quant.calibration.update`` batch by batch + ``hessian``, from
  float32 activations (full float32 matmul) and from bf16 activations (exact products, float32
  sums); peer: ``add_batch`` of the reference (running average of ``2/n x x^T`` in float32).
* The quantize step after the Hessian, 4-bit asymmetric, group 128 and group -1, block 128,
  damp 0.01: ours = the public ``quant.gptq`` (jit-compiled, compile excluded, block_until_ready,
  median of ``--iters``), once with each block running as one Pallas Triton kernel
  (``implementation="triton"``, what ``quant.gptq`` picks on a GPU) and once as pure XLA lax
  loops (``"xla"``); ``ours_s`` / ``speedup`` refer to the first that works; peer = ``fasterquant`` re-implemented below in PyTorch (median of
  ``--peer-iters`` after one untimed warm-up; the first call is reported too).
* Agreement: both quantize the same weight with the same Hessian; we record the fraction of
  identical dequantized weights and both proxy output errors ``tr(D^T H D)``.

Everything is wall-clock time with device synchronisation (GPTQ is a sequential program of many
kernels; its latency, not a kernel's time, is what a user waits for). One call writes
``OUT/gptq.json`` (rewritten after every measurement) and prints a table.

  PYTHONPATH=$PWD python3 benchmarks/gptq.py --out $OUT             # the H200 run (< 5 min)
  PYTHONPATH=$PWD python3 benchmarks/gptq.py --out /tmp/g --small   # tiny shapes, CPU check
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import traceback
from typing import Any

# JAX would preallocate 75% of the GPU; leave room for the PyTorch peer in the same process.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (os.path.dirname(_HERE), _HERE):
  if _path not in sys.path:
    sys.path.insert(0, _path)

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position


def _shim_optional_deps() -> list[str]:
  """The GPU machine may lack jaxtyping and tqdm, which ``quant`` uses only for annotations and
  progress bars (never on the timed path): give it minimal stand-ins. Returns what was shimmed."""
  import types  # pylint: disable=import-outside-toplevel
  shimmed = []
  try:
    import jaxtyping  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    class _Ann:
      def __getitem__(self, item):
        return item[0] if isinstance(item, tuple) else item
    mod = types.ModuleType("jaxtyping")
    mod.Array = jax.Array
    mod.Float = mod.Int = mod.Bool = mod.Shaped = _Ann()
    sys.modules["jaxtyping"] = mod
    shimmed.append("jaxtyping")
  try:
    import tqdm.auto  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    class _Bar:
      def __init__(self, *args, **kwargs):
        del args, kwargs

      def __enter__(self):
        return self

      def __exit__(self, *exc):
        return False

      def update(self, *args):
        del args

      def set_postfix_str(self, *args):
        del args
    top, auto = types.ModuleType("tqdm"), types.ModuleType("tqdm.auto")
    top.tqdm = auto.tqdm = _Bar
    top.auto = auto
    sys.modules["tqdm"], sys.modules["tqdm.auto"] = top, auto
    shimmed.append("tqdm")
  return shimmed


SHIMMED = _shim_optional_deps()

import quant  # pylint: disable=wrong-import-position
from quant.gptq import quantize_error  # pylint: disable=wrong-import-position
import timing  # pylint: disable=wrong-import-position

LAYERS = ((4096, 4096), (11008, 4096), (4096, 11008))      # (out, in) like BENCHMARKS.md
SMALL_LAYERS = ((256, 256), (384, 256), (256, 384))
GROUPS = (128, -1)
BITS = 4


# ----------------------------------------------------------------------------------------------
# The peer: IST-DASLab GPTQ (``gptq.py``: ``add_batch`` and ``fasterquant``), written for this
# benchmark in PyTorch from the paper's Algorithm 1 and the reference's structure: Python loops
# over blocks of 128 columns and over the columns of a block, lazy batch updates, the same
# min/max quantizer, dead columns, damping 0.01 * mean(diag H). Weights are torch's [out, in].
# ----------------------------------------------------------------------------------------------

class PeerGPTQ:
  """Hessian accumulation and ``fasterquant`` of the reference implementation, in PyTorch."""

  def __init__(self, torch, columns: int, device):
    self.torch = torch
    self.H = torch.zeros((columns, columns), device=device, dtype=torch.float32)
    self.nsamples = 0

  def add_batch(self, inp):
    """inp: [tokens, in]. H <- running mean of 2 x x^T (reference ``add_batch`` for Linear)."""
    tmp = inp.shape[0]
    inp = inp.t().float()
    self.H *= self.nsamples / (self.nsamples + tmp)
    self.nsamples += tmp
    inp = (2 / self.nsamples) ** 0.5 * inp
    self.H += inp.matmul(inp.t())

  @staticmethod
  def find_params(torch, x, *, maxq: int, sym: bool):
    """Per-row min/max quantizer of ``x [rows, cols]`` (reference ``Quantizer.find_params``)."""
    zero_t = torch.zeros(x.shape[0], device=x.device)
    xmin = torch.minimum(x.min(1).values, zero_t)
    xmax = torch.maximum(x.max(1).values, zero_t)
    if sym:
      xmax = torch.maximum(torch.abs(xmin), xmax)
      tmp = xmin < 0
      if torch.any(tmp):
        xmin[tmp] = -xmax[tmp]
    tmp = (xmin == 0) & (xmax == 0)
    xmin[tmp] = -1
    xmax[tmp] = +1
    scale = (xmax - xmin) / maxq
    if sym:
      zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
      zero = torch.round(-xmin / scale)
    return scale.unsqueeze(1), zero.unsqueeze(1)

  @staticmethod
  def quantize(torch, x, scale, zero, maxq):
    q = torch.clamp(torch.round(x / scale) + zero, 0, maxq)
    return scale * (q - zero)

  def fasterquant(self, weight, *, bits=4, groupsize=-1, blocksize=128, percdamp=0.01, sym=False):
    """Returns the dequantized weight [out, in] and per-element losses, like the reference."""
    torch = self.torch
    maxq = 2 ** bits - 1
    W = weight.clone().float()
    columns = W.shape[1]
    H = self.H.clone()
    scale, zero = self.find_params(torch, W, maxq=maxq, sym=sym)

    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    Losses = torch.zeros_like(W)
    Q = torch.zeros_like(W)
    damp = percdamp * torch.mean(torch.diag(H))
    diag = torch.arange(columns, device=W.device)
    H[diag, diag] += damp
    H = torch.linalg.cholesky(H)
    H = torch.cholesky_inverse(H)
    H = torch.linalg.cholesky(H, upper=True)
    Hinv = H

    for i1 in range(0, columns, blocksize):
      i2 = min(i1 + blocksize, columns)
      count = i2 - i1
      W1 = W[:, i1:i2].clone()
      Q1 = torch.zeros_like(W1)
      Err1 = torch.zeros_like(W1)
      Losses1 = torch.zeros_like(W1)
      Hinv1 = Hinv[i1:i2, i1:i2]
      for i in range(count):
        w = W1[:, i]
        d = Hinv1[i, i]
        if groupsize != -1 and (i1 + i) % groupsize == 0:
          scale, zero = self.find_params(torch, W[:, (i1 + i):(i1 + i + groupsize)], maxq=maxq,
                                         sym=sym)
        q = self.quantize(torch, w.unsqueeze(1), scale, zero, maxq).flatten()
        Q1[:, i] = q
        Losses1[:, i] = (w - q) ** 2 / d ** 2
        err1 = (w - q) / d
        W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
        Err1[:, i] = err1
      Q[:, i1:i2] = Q1
      Losses[:, i1:i2] = Losses1 / 2
      W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    if W.is_cuda:
      torch.cuda.synchronize()
    return Q, Losses


# ----------------------------------------------------------------------------------------------
# Measurement helpers
# ----------------------------------------------------------------------------------------------

def _activations(key, tokens: int, k: int, dtype):
  """Random normal activations with per-channel scales and a shared rank-16 component."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  scales = jnp.exp(0.5 * jax.random.normal(k1, (k,)))
  low = jax.random.normal(k2, (tokens, 16)) @ jax.random.normal(k3, (16, k)) * 0.5
  x = (jax.random.normal(k4, (tokens, k)) + low) * scales
  return x.astype(dtype)


def _wall(fn, iters: int) -> tuple[float, list[float]]:
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def _ours_hessian(batches) -> jax.Array:
  stats = quant.calibration.init(int(batches[0].shape[-1]))
  for xb in batches:
    stats = quant.calibration.update(stats, xb)
  return jax.block_until_ready(quant.calibration.hessian(stats))


def _torch():
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except Exception as e:  # pylint: disable=broad-except
    return None, f"{type(e).__name__}: {e}"
  return torch, ""


def _to_torch(torch, x, device):
  """jax array -> torch tensor on ``device`` (zero-copy through DLPack when possible)."""
  try:
    t = torch.utils.dlpack.from_dlpack(x)
    return t.to(device)
  except Exception:  # pylint: disable=broad-except
    return torch.from_numpy(np.asarray(x)).to(device)


def entry_of(record) -> dict[str, Any]:
  return record(None, None)


def _run_ours(w, h, group, impl):
  return jax.block_until_ready(quant.gptq(w, h, bits=BITS, group_size=group, block_size=128,
                                          damp=0.01, implementation=impl))


def run_layer(out_f: int, in_f: int, *, tokens: int, batch: int, iters: int, peer_iters: int,
              torch, device, record, impls=("triton", "xla")) -> None:
  """Measures one layer; ``record(key, value)`` stores results as they come."""
  key = jax.random.key(out_f * 7 + in_f)
  x32 = _activations(key, tokens, in_f, jnp.float32)
  w = (jax.random.normal(jax.random.fold_in(key, 1), (in_f, out_f), jnp.float32) * 0.02)
  nb = tokens // batch
  b32 = [x32[i * batch:(i + 1) * batch] for i in range(nb)]
  jax.block_until_ready(b32)

  _ours_hessian(b32[:2])                                   # compile
  t_h32, _ = _wall(lambda: _ours_hessian(b32), 2)
  record("hessian_ours_f32_s", t_h32)
  b16 = [b.astype(jnp.bfloat16) for b in b32]
  _ours_hessian(b16[:2])
  t_h16, _ = _wall(lambda: _ours_hessian(b16), 2)
  record("hessian_ours_bf16_s", t_h16)
  del b16
  h = _ours_hessian(b32)

  peer = None
  if torch is not None:
    try:
      xt = _to_torch(torch, x32, device)

      def peer_hessian():
        p = PeerGPTQ(torch, in_f, device)
        for i in range(nb):
          p.add_batch(xt[i * batch:(i + 1) * batch])
        if device.type == "cuda":
          torch.cuda.synchronize()
        return p
      peer_hessian()
      t_ph, _ = _wall(peer_hessian, 2)
      record("hessian_peer_s", t_ph)
      peer = PeerGPTQ(torch, in_f, device)
      peer.H = _to_torch(torch, h, device).clone()          # the same Hessian for both
      peer.nsamples = tokens
      del xt
    except Exception as e:  # pylint: disable=broad-except
      record("peer_error", f"{type(e).__name__}: {e}")
      peer = None
  del b32, x32

  for group in GROUPS:
    g = f"g{group}"
    res = t_ours = None
    for impl in impls:      # the Pallas block kernel and the pure-XLA loop, both jit-compiled
      try:
        run = functools.partial(_run_ours, w, h, group, impl)
        t0 = time.perf_counter()
        r = run()
        record(f"{g}.ours_{impl}_compile_and_first_s", time.perf_counter() - t0)
        t_impl, all_impl = _wall(run, iters)
        record(f"{g}.ours_{impl}_s", t_impl)
        record(f"{g}.ours_{impl}_all_s", all_impl)
        if t_ours is None:                 # the first that works is what quant.gptq picks
          res, t_ours = r, t_impl
          record(f"{g}.ours_s", t_impl)
          record(f"{g}.ours_impl", impl)
      except Exception as e:  # pylint: disable=broad-except
        record(f"{g}.ours_{impl}_error_msg",
               f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
    if res is None:
      continue
    w_ours = quant.dequantize(res.qweight)
    err_ours = float(quantize_error(w, w_ours, h))
    record(f"{g}.ours_error", err_ours)
    record(f"{g}.ours_damp", float(res.damp))
    w_rtn = quant.dequantize(quant.rtn(w, bits=BITS, group_size=group))
    record(f"{g}.rtn_error", float(quantize_error(w, w_rtn, h)))
    if peer is None:
      continue
    try:
      wt = _to_torch(torch, w.T, device).contiguous()        # torch layout [out, in]
      t0 = time.perf_counter()
      q_peer, _ = peer.fasterquant(wt, bits=BITS, groupsize=group, blocksize=128, percdamp=0.01)
      record(f"{g}.peer_first_s", time.perf_counter() - t0)
      t_peer, all_peer = _wall(lambda: peer.fasterquant(wt, bits=BITS, groupsize=group,
                                                        blocksize=128, percdamp=0.01), peer_iters)
      record(f"{g}.peer_s", t_peer)
      record(f"{g}.peer_all_s", all_peer)
      record(f"{g}.speedup", t_peer / t_ours)
      for impl in impls:
        if f"{g}.ours_{impl}_s" in entry_of(record):
          record(f"{g}.speedup_{impl}", t_peer / entry_of(record)[f"{g}.ours_{impl}_s"])
      w_peer = jnp.asarray(q_peer.t().contiguous().cpu().numpy())
      record(f"{g}.peer_error", float(quantize_error(w, w_peer, h)))
      record(f"{g}.frac_equal_weights",
             float(jnp.mean(jnp.abs(w_peer - w_ours) <= 1e-6 * jnp.abs(w_ours).max())))
    except Exception as e:  # pylint: disable=broad-except
      record(f"{g}.peer_error_msg", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")


def main(argv=None) -> dict[str, Any]:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="directory for gptq.json")
  ap.add_argument("--small", action="store_true", help="tiny shapes (CPU check of the script)")
  ap.add_argument("--iters", type=int, default=None, help="timed runs of ours (median)")
  ap.add_argument("--peer-iters", type=int, default=None, help="timed runs of the peer (median)")
  ap.add_argument("--no-peer", action="store_true", help="skip the PyTorch peer")
  ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting layers after this")
  ap.add_argument("--impls", default="triton,xla",
                  help="our implementations to time (quant.gptq(implementation=...))")
  ap.add_argument("--layers", default=None,
                  help="comma-separated OUTxIN layers to run (default: all of the grid)")
  args = ap.parse_args(argv)

  layers = SMALL_LAYERS if args.small else LAYERS
  if args.layers:
    wanted = {tuple(int(d) for d in item.split("x")) for item in args.layers.split(",")}
    unknown = wanted - set(layers)
    if unknown:
      ap.error(f"--layers: {sorted(unknown)} not in the grid {layers}")
    layers = tuple(layer for layer in layers if layer in wanted)
  tokens, batch = (4096, 1024) if args.small else (262_144, 2048)
  iters = args.iters or (2 if args.small else 5)
  peer_iters = args.peer_iters or (1 if args.small else 3)
  torch, why = (None, "disabled by --no-peer") if args.no_peer else _torch()
  device = None
  if torch is not None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False     # the reference's default: float32 matmuls
    torch.backends.cudnn.allow_tf32 = False

  path = os.path.join(args.out, "gptq.json")
  payload: dict[str, Any] = dict(
      benchmark="gptq", meta=timing.metadata(), small=args.small, tokens=tokens, batch=batch,
      bits=BITS, block_size=128, damp=0.01, iters=iters, peer_iters=peer_iters,
      torch=getattr(torch, "__version__", None), peer_device=str(device) if device else None,
      peer_unavailable=why or None, shimmed_modules=SHIMMED, layers={})
  start = time.perf_counter()
  for out_f, in_f in layers:
    name = f"{out_f}x{in_f}"
    if time.perf_counter() - start > args.budget_s:
      payload["layers"][name] = {"skipped": "time budget"}
      continue
    entry: dict[str, Any] = {"out": out_f, "in": in_f}
    payload["layers"][name] = entry

    def record(key, value, entry=entry):
      if key is None:
        return entry
      entry[key] = value
      timing.write_json(path, payload)
      if not key.endswith("_all_s"):
        print(f"{name:>12} {key:<28} {value if isinstance(value, str) else f'{value:.4g}'}",
              flush=True)

    try:
      run_layer(out_f, in_f, tokens=tokens, batch=batch, iters=iters, peer_iters=peer_iters,
                torch=torch, device=device, record=record, impls=tuple(args.impls.split(",")))
    except Exception as e:  # pylint: disable=broad-except
      record("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
  payload["total_s"] = time.perf_counter() - start
  timing.write_json(path, payload)
  _table(payload)
  return payload


def _table(payload) -> None:
  print("\nlayer (out x in) | group | ours (s) | peer (s) | speedup | err ours / peer / rtn")
  for name, e in payload["layers"].items():
    for group in GROUPS:
      g = f"g{group}"
      if f"{g}.ours_s" not in e:
        continue
      peer = e.get(f"{g}.peer_s")
      peer_s = "-" if peer is None else f"{peer:.3f}"
      speedup = "-" if peer is None else f"{e[g + '.speedup']:.1f}x"
      errors = (f"{e[g + '.ours_error']:.4g} / {e.get(g + '.peer_error', float('nan')):.4g} / "
                f"{e[g + '.rtn_error']:.4g}")
      print(f"{name} | {group} | {e[g + '.ours_s']:.4f} | {peer_s} | {speedup} | {errors}")

if __name__ == "__main__":
  main()

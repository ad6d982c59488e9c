"""Flax NNX integration: ``QuantLinear`` and layer-by-layer ``quantize_model``.

``quantize_model`` works on any NNX model built from ``nnx.Linear`` layers. It runs the model
eagerly on the calibration batches with light wrappers around the layers to learn the execution
order and which layers share one input (e.g. q, k, v after a norm), then quantizes the layers stage
by stage in that order (true-sequential, as in GPTQ's ``--true-sequential``): the statistics of a
stage are collected with every earlier stage already quantized, so each layer compensates for the
errors upstream of it. The forward pass of a stage stops as soon as its inputs are captured.

AWQ scales of layers that share an input are searched jointly. When that input is the output of
an ``nnx.RMSNorm`` / ``nnx.LayerNorm`` (with a scale) feeding only these layers, ``1/s`` is folded
into the norm's scale (and bias), so the model is unchanged before quantization; otherwise the
``QuantLinear`` multiplies its input by ``1/s`` explicitly (like llm-awq's ``ScaledActivation``).

Example:
  >>> qmodel, report = quant.nnx.quantize_model(model, batches, method="gptq", bits=4,
  ...                                           group_size=128)
  >>> logits = qmodel(tokens)
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float
from tqdm.auto import tqdm

from quant import calibration, formats
from quant.awq import awq as _awq
from quant.gptq import gptq as _gptq, quantize_error
from quant.matmul import int4_matmul, layout, mosaic_io
from quant.rtn import rtn as _rtn

log = logging.getLogger(__name__)

METHODS = ("gptq", "awq", "rtn")


class QuantState(nnx.Variable):
  """Packed quantization arrays (not trained; ``nnx.Param`` filters skip them)."""


class QuantLinear(nnx.Module):
  """A linear layer ``y = (x * input_scale) @ dequantize(qweight) + bias`` on a packed weight.

  The matmul goes through ``quant.int4_matmul`` (the fused kernel on GPU when available).
  ``input_scale`` is AWQ's ``1/s`` when it could not be folded into the previous operation.

  ``mosaic`` picks how the weight is stored. True (or a ``layout.MosaicWeight`` as ``qweight``):
  in the Mosaic GPU decode kernel's layout (``layout.prepare_mosaic``, done once here). On Hopper,
  calls with at most 128 rows then run that kernel once, larger ones on equal chunks
  (``mosaic.chunk_rows``). False: our
  packed format, which the compiled Mosaic kernel does not read (dispatch runs Triton). None (the
  default): the Mosaic layout when the first device is a Hopper GPU and the layer can use it
  (codes of <= 4 bits in groups the layout tiles; ``implementation`` None or "mosaic";
  ``dtype`` None, bf16 or f16), else the packed format. On an H200, g128 asymmetric, the Mosaic
  layout measured faster at every M tried: 2.5-2.7x bf16 at M <= 16 against Triton's 1.0-1.2x,
  and 0.45 / 0.32 ms against 0.48 / 0.48 ms at M = 256 (8192x28672 / 28672x8192;
  benchmarks/NOTES.md, session 11). With the Mosaic layout the sharding names apply to the
  transposed ``[N, K/4]`` int16 codes as ``(out, in)``; ``quantized_weight`` converts back.

  Example:
    >>> layer = QuantLinear(quant.rtn(w, bits=4, group_size=128), mosaic=True)
    >>> y = layer(x)                       # x: [..., K] bf16
  """

  def __init__(self, qweight: formats.QuantizedWeight | layout.MosaicWeight, *,
               bias: jax.Array | None = None, input_scale: jax.Array | None = None,
               dtype: Any = None, implementation: str | None = None,
               sharding: Sequence[str | None] | None = None, mosaic: bool | None = None):
    if isinstance(qweight, layout.MosaicWeight):
      mosaic = True
    else:
      formats.check_quantized(qweight)
      if mosaic is None:
        prepared = _auto_mosaic(qweight, implementation=implementation, dtype=dtype)
        mosaic = prepared is not None
        qweight = prepared if mosaic else qweight
      elif mosaic:
        qweight = layout.prepare_mosaic(qweight)
    if mosaic:
      qweight = layout.to_row_major(qweight)     # 2-D arrays, so the sharding names apply
    k, n = qweight.shape
    if bias is not None and bias.shape != (n,):
      raise ValueError(f"bias must have shape {(n,)}, got {bias.shape}")
    if input_scale is not None and input_scale.shape != (k,):
      raise ValueError(f"input_scale must have shape {(k,)}, got {input_scale.shape}")
    meta = {}
    if sharding is not None:      # the logical axes of the original kernel [in, out]
      names = tuple(sharding)[::-1] if mosaic else tuple(sharding)   # Mosaic codes: [N, K/4]
      meta = dict(out_sharding=names, eager_sharding=False)
    col = dict(out_sharding=(None, sharding[1]), eager_sharding=False) if sharding else {}
    self.qweight = QuantState(qweight.qweight, **meta)
    self.scales = QuantState(qweight.scales, **col)
    self.zeros = QuantState(qweight.zeros, **col) if qweight.zeros is not None else None
    self.perm = QuantState(qweight.perm) if qweight.perm is not None else None
    self.bias = nnx.Param(bias) if bias is not None else None
    self.input_scale = QuantState(input_scale) if input_scale is not None else None
    self.bits, self.group_size, self.sym = qweight.bits, qweight.group_size, qweight.sym
    self.in_features, self.out_features = k, n
    self.dtype = dtype
    self.implementation = implementation
    self.mosaic_block_k = qweight.block_k if mosaic else None

  @property
  def mosaic(self) -> bool:
    """Whether the weight is stored in the Mosaic GPU decode kernel's layout."""
    return self.mosaic_block_k is not None

  @property
  def weight(self) -> formats.QuantizedWeight | layout.MosaicWeight:
    """The stored weight: a ``layout.MosaicWeight`` with ``mosaic=True``, else a
    ``QuantizedWeight``."""
    arrays = dict(qweight=self.qweight[...], scales=self.scales[...],
                  zeros=None if self.zeros is None else self.zeros[...],
                  perm=None if self.perm is None else self.perm[...], bits=self.bits,
                  group_size=self.group_size, sym=self.sym,
                  shape=(self.in_features, self.out_features))
    if self.mosaic_block_k is not None:
      return layout.MosaicWeight(**arrays, block_k=self.mosaic_block_k)
    return formats.QuantizedWeight(**arrays)

  @property
  def quantized_weight(self) -> formats.QuantizedWeight:
    """The weight in our packed format (unpacked from the Mosaic layout when stored so)."""
    w = self.weight
    return layout.to_quantized(w) if isinstance(w, layout.MosaicWeight) else w

  def __call__(self, x: Float[Array, "... K"]) -> Float[Array, "... N"]:
    if self.input_scale is not None:
      x = x * self.input_scale[...].astype(x.dtype)
    if self.dtype is not None:
      x = x.astype(self.dtype)
    bias = None if self.bias is None else self.bias[...]
    return int4_matmul(x, self.weight, bias=bias, implementation=self.implementation)

  @classmethod
  def from_linear(cls, linear: nnx.Linear, qweight: formats.QuantizedWeight, *,
                  input_scale: jax.Array | None = None, implementation: str | None = None,
                  mosaic: bool | None = None) -> "QuantLinear":
    """Wraps ``qweight`` with the bias, dtype and sharding names of ``linear``."""
    if qweight.shape != tuple(linear.kernel.shape):
      raise ValueError(f"qweight shape {qweight.shape} != kernel shape {linear.kernel.shape}")
    bias = None if linear.bias is None else linear.bias[...]
    names = linear.kernel.get_metadata().get("out_sharding")
    return cls(qweight, bias=bias, input_scale=input_scale, dtype=linear.dtype,
               implementation=implementation, sharding=names, mosaic=mosaic)


def _auto_mosaic(qweight: formats.QuantizedWeight, *, implementation: str | None,
                 dtype: Any) -> layout.MosaicWeight | None:
  """``QuantLinear(mosaic=None)``: the prepared weight when the Mosaic layout serves this layer
  on this machine (a Hopper GPU, no other backend requested, a 16-bit activation dtype, and a
  weight the layout can hold), else None (our packed format)."""
  if implementation not in (None, "mosaic") or not mosaic_io.on_hopper():
    return None
  if dtype is not None and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return None
  try:
    return layout.prepare_mosaic(qweight)
  except NotImplementedError:          # codes over 4 bits, groups the layout cannot tile
    return None


@dataclasses.dataclass(frozen=True)
class LayerReport:
  """What ``quantize_model`` did to one layer.

  error: proxy output error ``tr(D^T H D)`` (= 2/n ||X D||^2, D = W - W_hat) on the calibration
    inputs of the layer; rtn_error: the same for plain RTN, for comparison.
  """
  path: str
  method: str
  shape: tuple[int, int]
  bits: int
  group_size: int
  tokens: int
  error: float
  rtn_error: float
  seconds: float
  damp: float | None = None          # GPTQ: relative dampening actually used
  alpha: float | None = None         # AWQ: chosen exponent
  folded_into: str | None = None     # AWQ: where 1/s went (None: kept as input_scale)


# ----------------------------------------------------------------------------------------------
# Graph surgery helpers
# ----------------------------------------------------------------------------------------------

def _get(model, path):
  node = model
  for p in path:
    node = node[p] if isinstance(p, int) else getattr(node, p)
  return node


def _set(model, path, value):
  parent = _get(model, path[:-1])
  if isinstance(path[-1], int):
    parent[path[-1]] = value
  else:
    setattr(parent, path[-1], value)


def _name(path) -> str:
  return ".".join(str(p) for p in path)


class _Stop(Exception):
  """Ends a calibration forward pass once the inputs of the current stage are captured."""


class _Tap(nnx.Module):
  """Calls ``hook(path, x, y)`` around a wrapped module (eager use only)."""

  def __init__(self, inner, path, hook):
    self.inner = inner
    self.path = path
    self.hook = hook

  def __call__(self, x, *args, **kwargs):
    self.hook("in", self.path, x)
    y = self.inner(x, *args, **kwargs)
    self.hook("out", self.path, y)
    return y


def _tapped(model, paths, hook):
  """Context: wraps the modules at ``paths`` with ``_Tap`` and restores them afterwards."""
  class _Ctx:
    def __enter__(self):
      self.orig = {p: _get(model, p) for p in paths}
      for p, m in self.orig.items():
        _set(model, p, _Tap(m, p, hook))

    def __exit__(self, *exc):
      for p, m in self.orig.items():
        _set(model, p, m)
      return False
  return _Ctx()


def _plan(model, batch, forward, linears, norms):
  """Stages: groups of linears sharing one input object, in order of first call."""
  calls, outs, keep = [], {}, []

  def hook(kind, path, x):
    keep.append(x)                     # hold references so ids stay unique during the pass
    if kind == "in" and path in linears:
      calls.append((path, id(x)))
    elif kind == "out" and path in norms:
      outs[id(x)] = path

  with _tapped(model, list(linears) + list(norms), hook):
    forward(model, batch)
  stages = []
  for path, xid in calls:
    if any(path in s for s, _ in stages):
      continue
    for group, gid in stages:
      if gid == xid:
        group.append(path)
        break
    else:
      stages.append(([path], xid))
  missing = [p for p in linears if not any(p in s for s, _ in stages)]
  if missing:
    log.warning("layers never called by the forward pass were left as they are: %s",
                [_name(p) for p in missing])
  return [(group, outs.get(xid)) for group, xid in stages]


def _collect(model, batches, forward, group):
  """Calibration statistics of the (shared) input of ``group``, stopping each pass early."""
  stats = None
  remaining = set()

  def hook(kind, path, x):
    nonlocal stats
    if kind != "in":
      return
    if path == group[0]:
      stats = calibration.update(stats if stats is not None else calibration.init(x.shape[-1]), x)
    remaining.discard(path)
    if not remaining:
      raise _Stop

  with _tapped(model, group, hook):
    for batch in batches:
      remaining.update(group)
      try:
        forward(model, batch)
      except _Stop:
        pass
  if stats is None:
    raise ValueError("no calibration batches were given")
  return stats


def _columns(qw: formats.QuantizedWeight, a: int, b: int) -> formats.QuantizedWeight:
  return formats.QuantizedWeight.from_codes(
      qw.codes[:, a:b], qw.scales[:, a:b], None if qw.zeros is None else qw.zeros[:, a:b],
      bits=qw.bits, group_size=qw.group_size, perm=qw.perm)


def _default_forward(model, batch):
  return model(batch)


def quantize_model(model: nnx.Module, calibration_batches: Iterable[Any], *, method: str = "gptq",
                   bits: int = 4, group_size: int | None = 128, sym: bool = False,
                   act_order: bool = False, static_groups: bool = False, damp: float = 0.01,
                   block_size: int = 128, awq_options: dict | None = None,
                   awq_no_clip: Sequence[str] = ("q", "k", "q_proj", "k_proj", "query", "key"),
                   exclude: Sequence[str] = ("head", "lm_head"),
                   forward: Callable[[nnx.Module, Any], Any] | None = None,
                   implementation: str | None = None, mosaic: bool | None = None,
                   progress: bool = True) -> tuple[nnx.Module, list[LayerReport]]:
  """Quantizes every ``nnx.Linear`` of a copy of ``model``, layer by layer.

  Args:
    model: an NNX module (left unchanged; a clone is quantized and returned).
    calibration_batches: a re-iterable collection of model inputs (e.g. token arrays).
    method: "gptq" | "awq" | "rtn".
    bits, group_size, sym: the format. act_order, static_groups, damp, block_size: GPTQ options.
    awq_options: extra keyword arguments of ``quant.awq`` (n_grid, duo_scaling, clip, ...).
    awq_no_clip: layer names whose AWQ group skips the clipping search (llm-awq does not clip
      query/key projections: their errors are amplified by the q k^T product).
    exclude: layer names (last path element or full dotted path) kept in full precision.
    forward: ``forward(model, batch)``; default ``model(batch)``.
    implementation: int4_matmul backend of the new layers (None: automatic).
    mosaic: store the new layers' weights in the Mosaic GPU decode kernel's layout (True), in
      our packed format (False), or pick per layer (None: the Mosaic layout on Hopper where the
      layer can use it; see ``QuantLinear``).
    progress: show a tqdm progress bar.

  Returns:
    ``(quantized_model, report)`` with one ``LayerReport`` per quantized layer.
  """
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  formats._check_bits(bits)
  batches = list(calibration_batches)
  if not batches:
    raise ValueError("calibration_batches is empty")
  forward = forward or _default_forward
  model = nnx.clone(model)
  linears, norms = [], []
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Linear) and _name(path) not in exclude and path[-1] not in exclude:
      linears.append(tuple(path))
    elif isinstance(node, (nnx.RMSNorm, nnx.LayerNorm)):
      norms.append(tuple(path))
  if not linears:
    raise ValueError("the model has no nnx.Linear layer to quantize")
  stages = _plan(model, batches[0], forward, linears, norms)
  report = []
  n_layers = sum(len(g) for g, _ in stages)
  with tqdm(total=n_layers, desc=f"{method} {bits}-bit", disable=not progress) as bar:
    for group, norm_path in stages:
      t0 = time.perf_counter()
      stats = _collect(model, batches, forward, group)
      h = calibration.hessian(stats)
      layers = [_get(model, p) for p in group]
      weights = [lin.kernel[...] for lin in layers]
      options = dict(awq_options or {})
      if method == "awq" and any(p[-1] in awq_no_clip for p in group):
        options["clip"] = False
      new, extra = _quantize_group(weights, h, stats, layers, norm_path, model, method=method,
                                   bits=bits, group_size=group_size, sym=sym, act_order=act_order,
                                   static_groups=static_groups, damp=damp, block_size=block_size,
                                   awq_options=options)
      secs = (time.perf_counter() - t0) / len(group)
      for path, lin, w, (qw, w_hat, in_scale, info) in zip(group, layers, weights, new):
        _set(model, path, QuantLinear.from_linear(lin, qw, input_scale=in_scale,
                                                  implementation=implementation, mosaic=mosaic))
        w32 = w.astype(jnp.float32)
        err = float(quantize_error(w32, w_hat, h))
        rtn_err = float(quantize_error(w32, formats.dequantize(
            _rtn(w32, bits=bits, group_size=group_size, sym=sym), dtype=jnp.float32), h))
        rep = LayerReport(path=_name(path), method=method, shape=tuple(w.shape), bits=bits,
                          group_size=qw.group_size, tokens=int(stats.count), error=err,
                          rtn_error=rtn_err, seconds=secs, **info, **extra)
        report.append(rep)
        log.info("%s %s: error %.4g (rtn %.4g)", method, rep.path, err, rtn_err)
        bar.set_postfix_str(f"{rep.path} err/rtn={err / max(rtn_err, 1e-30):.2f}")
        bar.update(1)
  return model, report


def _quantize_group(weights, h, stats, layers, norm_path, model, *, method, bits, group_size,
                    sym, act_order, static_groups, damp, block_size, awq_options):
  """Quantizes the layers of one stage; returns [(qw, w_hat_in_original_units, in_scale, info)]."""
  out = []
  if method == "rtn":
    for w in weights:
      qw = _rtn(w, bits=bits, group_size=group_size, sym=sym)
      out.append((qw, formats.dequantize(qw, dtype=jnp.float32), None, {}))
    return out, {}
  if method == "gptq":
    for w in weights:
      res = _gptq(w, h, bits=bits, group_size=group_size, sym=sym, act_order=act_order,
                  static_groups=static_groups, block_size=block_size, damp=damp)
      out.append((res.qweight, formats.dequantize(res.qweight, dtype=jnp.float32), None,
                  dict(damp=float(res.damp))))
    return out, {}
  # AWQ: one scale search for all layers sharing this input.
  sizes = [w.shape[1] for w in weights]
  w_cat = jnp.concatenate([w.astype(jnp.float32) for w in weights], axis=1)
  res = _awq(w_cat, h, calibration.mean_abs(stats), bits=bits, group_size=group_size, sym=sym,
             **awq_options)
  s = res.scale
  folded = _fold(model, norm_path, s) if norm_path is not None else None
  in_scale = None if folded else (1.0 / s)
  a = 0
  for w, n in zip(weights, sizes):
    qw = _columns(res.qweight, a, a + n)
    a += n
    w_hat = formats.dequantize(qw, dtype=jnp.float32) / s[:, None]
    out.append((qw, w_hat, in_scale, dict(alpha=float(res.alpha))))
  return out, dict(folded_into=folded)


def _fold(model, norm_path, s) -> str | None:
  """Divides the norm's output by ``s`` through its scale (and bias); None if impossible."""
  norm = _get(model, norm_path)
  if getattr(norm, "scale", None) is None:
    return None
  norm.scale[...] = (norm.scale[...] / s).astype(norm.scale[...].dtype)
  if getattr(norm, "bias", None) is not None:
    norm.bias[...] = (norm.bias[...] / s).astype(norm.bias[...].dtype)
  return _name(norm_path)


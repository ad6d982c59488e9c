"""safetensors import / export in the GPTQ (AutoGPTQ / GPTQModel) and AWQ (AutoAWQ GEMM) layouts.

A checkpoint is one ``.safetensors`` file. Every quantized layer ``name`` becomes the tensors

    GPTQ: name.qweight int32 [K*bits/32, N], name.qzeros int32 [G, N*bits/32],
          name.scales f16 [G, N], name.g_idx int32 [K]           (+ name.bias)
    AWQ:  name.qweight int32 [K, N/8], name.qzeros int32 [G, N/8], name.scales f16 [G, N]

(see ``quant.formats`` for the bit layouts), and the file's metadata holds the
``quantization_config`` JSON that transformers / AutoGPTQ / AutoAWQ read::

    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false, "sym": false,
     "checkpoint_format": "gptq"}                                   # or "gptq_v2"
    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": true, "version": "gemm"}

Other tensors (embeddings, norms, unquantized layers, AWQ ``input_scale``) are stored as they
are. ``export_model`` / ``import_model`` do this for a Flax NNX model with ``QuantLinear`` layers,
naming tensors by the dotted NNX path (``blocks.0.attn.q.qweight``, ``blocks.0.ln1.scale``, ...).

Example:
  >>> quant.hf.save_checkpoint("model.safetensors", {"layer": qw}, format="gptq")
  >>> layers, others, config = quant.hf.load_checkpoint("model.safetensors")
"""
from __future__ import annotations

import json
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from quant import formats

FORMATS = ("gptq", "gptq_v2", "awq")
_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


def _safetensors():
  try:
    from safetensors import numpy as st   # the "test" extra installs it
  except ImportError as e:                 # pragma: no cover - depends on the environment
    raise ImportError("quant.hf needs the `safetensors` package (pip install safetensors)") from e
  return st


def _config(layers: Mapping[str, formats.QuantizedWeight], fmt: str) -> dict[str, Any]:
  first = next(iter(layers.values()))
  for name, qw in layers.items():
    if (qw.bits, qw.sym) != (first.bits, first.sym):
      raise ValueError(f"layer {name!r} has bits/sym {(qw.bits, qw.sym)}, "
                       f"expected {(first.bits, first.sym)} like the other layers")
  # A layer with one group over all of K (g == K) fits any config group size >= K.
  sizes = {qw.group_size for qw in layers.values() if qw.group_size != qw.shape[0]}
  if len(sizes) > 1:
    raise ValueError(f"all layers of one checkpoint must share a group size, got {sorted(sizes)}")
  group = sizes.pop() if sizes else -1
  for name, qw in layers.items():
    if group != -1 and qw.group_size == qw.shape[0] and qw.shape[0] > group:
      raise ValueError(f"layer {name!r} has one group over K={qw.shape[0]} but the other layers "
                       f"use group_size={group}")
  if fmt == "awq":
    return dict(quant_method="awq", bits=first.bits, group_size=group, zero_point=True,
                version="gemm")
  return dict(quant_method="gptq", bits=first.bits, group_size=group,
              desc_act=any(qw.perm is not None for qw in layers.values()), sym=first.sym,
              checkpoint_format="gptq" if fmt == "gptq" else "gptq_v2")


def save_checkpoint(path: str, layers: Mapping[str, formats.QuantizedWeight], *,
                    format: str = "gptq", tensors: Mapping[str, Any] | None = None,
                    scale_dtype: Any = np.float16) -> dict[str, Any]:
  """Writes quantized ``layers`` (name -> QuantizedWeight) and extra ``tensors`` to ``path``.

  ``format``: "gptq" (v1, zero - 1), "gptq_v2" or "awq". Scales are cast to ``scale_dtype``
  (float16, what the PyTorch kernels expect). Returns the ``quantization_config`` written.
  """
  if format not in FORMATS:
    raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
  if not layers:
    raise ValueError("layers is empty")
  config = _config(layers, format)
  out: dict[str, np.ndarray] = {}
  for name, qw in layers.items():
    t = formats.to_awq(qw) if format == "awq" else formats.to_gptq(
        qw, version=1 if format == "gptq" else 2)
    t["scales"] = np.asarray(t["scales"]).astype(scale_dtype)
    for key, value in t.items():
      out[f"{name}.{key}"] = np.ascontiguousarray(value)
  for name, value in (tensors or {}).items():
    if name in out:
      raise ValueError(f"tensor name {name!r} collides with a quantized layer tensor")
    out[name] = np.ascontiguousarray(np.asarray(value))
  _safetensors().save_file(out, path, metadata={"quantization_config": json.dumps(config),
                                                "format": "pt"})
  return config


def load_checkpoint(path: str) -> tuple[dict[str, formats.QuantizedWeight], dict[str, np.ndarray],
                                        dict[str, Any]]:
  """Reads a GPTQ or AWQ safetensors file: ``(layers, other_tensors, quantization_config)``.

  The format comes from the file's ``quantization_config`` metadata (GPTQ v1 when it has none
  and ``g_idx`` tensors are present, AWQ when ``g_idx`` is absent).
  """
  from safetensors import safe_open
  st = _safetensors()
  tensors = st.load_file(path)
  with safe_open(path, framework="numpy") as f:
    meta = f.metadata() or {}
  config = json.loads(meta["quantization_config"]) if "quantization_config" in meta else {}
  names = sorted({k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")})
  method = config.get("quant_method") or ("gptq" if any(f"{n}.g_idx" in tensors for n in names)
                                          else "awq")
  bits = int(config.get("bits", config.get("w_bit", 4)))
  layers = {}
  for name in names:
    q, z, s = (tensors.pop(f"{name}{suffix}") for suffix in (".qweight", ".qzeros", ".scales"))
    if method == "awq":
      layers[name] = formats.from_awq(q, z, s)
    elif method == "gptq":
      version = 2 if config.get("checkpoint_format") == "gptq_v2" else 1
      g_idx = tensors.pop(f"{name}.g_idx", None)
      layers[name] = formats.from_gptq(q, z, s, g_idx, bits=bits, sym=bool(config.get("sym")),
                                       version=version)
    else:
      raise NotImplementedError(f"quant_method {method!r} is not supported")
  return layers, tensors, config


def export_model(model: nnx.Module, path: str, *, format: str = "gptq") -> dict[str, Any]:
  """Saves every ``QuantLinear`` of ``model`` in ``format`` plus all other parameters."""
  from quant.nnx import QuantLinear
  layers, tensors = {}, {}
  for p, node in nnx.iter_graph(model):
    if isinstance(node, QuantLinear):
      name = ".".join(map(str, p))
      layers[name] = node.quantized_weight
      if node.bias is not None:
        tensors[f"{name}.bias"] = np.asarray(node.bias[...])
      if node.input_scale is not None:
        tensors[f"{name}.input_scale"] = np.asarray(node.input_scale[...])
  inside = tuple(layers)
  for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name = ".".join(map(str, p))
    if not any(name.startswith(n + ".") for n in inside):
      tensors[name] = np.asarray(var[...])
  if not layers:
    raise ValueError("the model has no QuantLinear layer; quantize it first")
  return save_checkpoint(path, layers, format=format, tensors=tensors)


def import_model(model: nnx.Module, path: str, *, implementation: str | None = None,
                 mosaic: bool | None = None) -> nnx.Module:
  """Returns a copy of ``model`` whose linears named in the checkpoint are ``QuantLinear``s
  and whose other parameters are taken from the checkpoint. ``mosaic``: store the weights in the
  Mosaic GPU decode kernel's layout (True, prepared once here), in our packed format (False), or
  pick per layer (None: the Mosaic layout on Hopper where it serves; see ``QuantLinear``)."""
  from quant.nnx import QuantLinear, _get, _set
  layers, tensors, _ = load_checkpoint(path)
  model = nnx.clone(model)
  for name, qw in layers.items():
    path_ = tuple(int(p) if p.isdigit() else p for p in name.split("."))
    lin = _get(model, path_)
    if not isinstance(lin, (nnx.Linear, QuantLinear)):
      raise ValueError(f"{name!r} in the checkpoint is a {type(lin).__name__} in the model")
    if tuple(lin.kernel.shape if isinstance(lin, nnx.Linear) else qw.shape) != qw.shape:
      raise ValueError(f"{name!r}: checkpoint shape {qw.shape} != model shape {lin.kernel.shape}")
    bias = tensors.pop(f"{name}.bias", None)
    scale = tensors.pop(f"{name}.input_scale", None)
    names = lin.kernel.get_metadata().get("out_sharding") if isinstance(lin, nnx.Linear) else None
    _set(model, path_, QuantLinear(qw, bias=None if bias is None else jnp.asarray(bias),
                                   input_scale=None if scale is None else jnp.asarray(scale),
                                   dtype=getattr(lin, "dtype", None), sharding=names,
                                   implementation=implementation, mosaic=mosaic))
  flat = dict((".".join(map(str, p)), v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
  for name, value in tensors.items():
    if name not in flat:
      raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    if flat[name].shape != value.shape:
      raise ValueError(f"{name!r}: checkpoint shape {value.shape} != model shape {flat[name].shape}")
    flat[name][...] = jnp.asarray(value, flat[name][...].dtype)
  return model

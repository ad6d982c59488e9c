"""``int4_matmul``: argument checks and backend dispatch for ``x @ dequantize(qw)``.

Backends share one calling convention, ``fn(x, qw, *, bias, config, interpret) -> y``. The "xla"
reference (``reference.py``) always works; Pallas kernels live in ``quant/matmul/<name>.py`` and
expose ``int4_matmul`` with that convention. A backend that cannot serve a valid call (a group
size, bit width or shape it does not support) raises NotImplementedError, and with
``implementation=None`` dispatch tries the next backend, ending at "xla".

The weight is a ``quant.QuantizedWeight`` or, for the Mosaic GPU decode kernel on Hopper, the
same weight prepared once at load time with ``quant.matmul.layout.prepare_mosaic`` (a
``MosaicWeight``). A prepared weight goes to "mosaic" first (any M: above 256 rows in equal
chunks); a backend after it gets the weight back as a ``QuantizedWeight``
(``layout.to_quantized``, one unpack per call), e.g. on a GPU that is not Hopper.

Example:
  >>> qw = quant.rtn(w, bits=4, group_size=128)          # w: [K, N]
  >>> y = quant.int4_matmul(x, qw)                        # x: [..., K] -> y: [..., N]
  >>> mw = quant.matmul.layout.prepare_mosaic(qw)         # once, at load time (Hopper decode)
  >>> y = quant.int4_matmul(x, mw)
"""
from __future__ import annotations

import importlib
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from quant import formats
from quant.matmul import layout, reference

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("mosaic", "triton", "xla")
_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _xla_backend(x, qw, *, bias, config, interpret):
  del interpret
  if config is not None:
    raise NotImplementedError("the xla backend takes no config")
  return reference.int4_matmul(x, qw, bias=bias)


def _backend(name: str) -> Callable[..., jax.Array]:
  if name == "xla":
    return _xla_backend
  module = importlib.import_module(f"quant.matmul.{name}")
  return module.int4_matmul


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def default_order() -> tuple[str, ...]:
  """Backends tried by ``implementation=None``: Pallas kernels first on a GPU, else only "xla"."""
  return IMPLEMENTATIONS if _on_gpu() else ("xla",)


def check_inputs(x, qw, *, bias, implementation) -> None:
  if not isinstance(qw, layout.MosaicWeight):
    formats.check_quantized(qw)
  if not hasattr(x, "ndim") or x.ndim < 1:
    raise ValueError(f"x must be an array [..., K], got {type(x).__name__}")
  if x.dtype not in _DTYPES:
    raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
  k, n = qw.shape
  if x.shape[-1] != k:
    raise ValueError(f"x has {x.shape[-1]} features on its last axis, the weight expects K={k}")
  if bias is not None and getattr(bias, "shape", None) != (n,):
    raise ValueError(f"bias must have shape {(n,)}, got {getattr(bias, 'shape', type(bias))}")
  if implementation is not None and implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, "
                     f"got {implementation!r}")


def int4_matmul(x: Float[Array, "... K"], qw: formats.QuantizedWeight | layout.MosaicWeight, *,
                bias: Float[Array, "N"] | None = None, implementation: str | None = None,
                config: Any = None, interpret: bool | None = None) -> Float[Array, "... N"]:
  """``x @ dequantize(qw) (+ bias)`` with a low-bit weight, dispatched to the fastest backend.

  Args:
    x: activations ``[..., K]`` in bf16, f16 or f32; the result has the same dtype.
    qw: a ``quant.QuantizedWeight`` of logical shape ``[K, N]``, or a ``layout.MosaicWeight``
      prepared from one (``layout.prepare_mosaic``; served by "mosaic" directly and by the other
      backends after ``layout.to_quantized``).
    bias: optional ``[N]``.
    implementation: "mosaic" | "triton" | "xla"; None tries the available ones fastest first.
    config: backend tuning config (frozen dataclass) or None for heuristics.
    interpret: Pallas interpret mode; None means True when no GPU is present.
  """
  check_inputs(x, qw, bias=bias, implementation=implementation)
  if interpret is None:
    interpret = not _on_gpu()
  order = (implementation,) if implementation is not None else default_order()
  errors = []
  converted = None
  for name in order:
    try:
      fn = _backend(name)
    except ImportError as e:   # a kernel module that is not there yet
      if implementation is not None:
        raise NotImplementedError(f"int4_matmul backend {name!r} is not available: {e}") from e
      errors.append(f"{name}: {e}")
      continue
    w = qw
    if isinstance(qw, layout.MosaicWeight) and name != "mosaic":
      converted = layout.to_quantized(qw) if converted is None else converted
      w = converted
    try:
      return fn(x, w, bias=bias, config=config, interpret=interpret)
    except NotImplementedError as e:
      if implementation is not None:
        raise
      log.debug("int4_matmul backend %s declined: %s", name, e)
      errors.append(f"{name}: {e}")
  raise NotImplementedError("no int4_matmul backend accepted the call: " + "; ".join(errors))

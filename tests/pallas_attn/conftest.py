"""Shared fixtures for the attention tests.

* 8 simulated CPU devices for shard_map tests (must be set before jax is imported; the Makefile
  exports the same flag).
* ``backend`` fixture over ``harness.BACKENDS`` (adding a backend is one line there); it skips a
  backend whose module does not import yet.
* ``@pytest.mark.gpu`` tests (full grids, compiled kernels) are skipped unless JAX runs on a GPU.
"""
from __future__ import annotations

import importlib
import os
import pathlib

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from harness import BACKENDS, PALLAS_BACKENDS  # noqa: E402  (BACKENDS: add "mosaic" there)


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def require_backend(name: str) -> str:
  """Skips (with the import error as reason) when the backend's module does not import yet."""
  if name != "xla":
    try:
      importlib.import_module(f"pallas_attn.{name}")
    except ImportError as e:
      pytest.skip(f"pallas_attn.{name} does not import: {e}")
  return name


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
  """The implementation under test; ``harness.per_backend`` orders it inside each case."""
  return require_backend(request.param)


@pytest.fixture(params=PALLAS_BACKENDS)
def pallas_backend(request) -> str:
  return require_backend(request.param)


def pytest_collection_modifyitems(config, items):
  if on_gpu():
    return
  skip = pytest.mark.skip(reason=f"needs a GPU (jax.default_backend() is "
                                 f"{jax.default_backend()!r}); run with `pytest -m gpu` on one")
  here = pathlib.Path(__file__).parent
  for item in items:
    if "gpu" in item.keywords and here in pathlib.Path(item.path).parents:
      item.add_marker(skip)


@pytest.fixture
def launched(monkeypatch):
  """The Mosaic forward Statics ``ops._forward`` sizes, in order (the last one is what it
  launches)."""
  from pallas_attn.mosaic import ops  # pylint: disable=import-outside-toplevel
  seen = []
  real = ops.kernels.smem_bytes

  def spy(*, st, **kw):
    seen.append(st)
    return real(st=st, **kw)
  monkeypatch.setattr(ops.kernels, "smem_bytes", spy)
  return seen

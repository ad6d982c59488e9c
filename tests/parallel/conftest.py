"""Shared fixtures for parallel/ tests: 8 simulated CPU devices and a tiny GPT."""
import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import pytest  # noqa: E402



@pytest.fixture(scope="session", autouse=True)
def eight_devices():
  if jax.device_count() != 8:
    pytest.fail(f"parallel tests need 8 (simulated) devices, found {jax.device_count()}; "
                f"set XLA_FLAGS={_FLAG} before jax is imported")
  return jax.devices()



"""notebooks/02_sharding.ipynb executes top to bottom (its own cells assert equal losses)."""
import os
import pathlib

import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "02_sharding.ipynb"


def test_sharding_notebook_runs():
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  env_flag = "--xla_force_host_platform_device_count=8"
  os.environ.setdefault("XLA_FLAGS", env_flag)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute()
  outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                    for o in c.get("outputs", []))
  assert "all layouts agree" in outputs
  assert "8 devices" in outputs

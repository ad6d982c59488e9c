"""notebooks/01_quantization.ipynb executes on CPU and its outputs say what the text claims."""
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "01_quantization.ipynb"


def test_quantization_notebook_runs():
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(NOTEBOOK, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  client.execute()
  text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))
  assert "dequantize == (q - z) * s exactly: True" in text
  assert "int4_matmul == x @ dequantize(qw): True" in text
  # Section 2: GPTQ and AWQ output errors below RTN at both widths.
  rows = [line.split() for line in text.splitlines()
          if line.strip().split(" ")[0] in ("4", "3") and len(line.split()) == 4]
  err = {(b, m): float(oe) for b, m, _, oe in rows}
  for bits in ("4", "3"):
    assert err[(bits, "GPTQ")] < err[(bits, "RTN")] and err[(bits, "AWQ")] < err[(bits, "RTN")]
  assert "held-out perplexity (subset)" in text
  assert "max |logits(reloaded) - logits(quantized)|" in text

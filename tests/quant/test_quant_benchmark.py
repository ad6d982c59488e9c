"""The GPTQ benchmark script's logic on tiny shapes (CPU); the PyTorch peer runs if torch is here."""
import importlib.util
import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  spec = importlib.util.spec_from_file_location("bench_gptq", ROOT / "benchmarks" / "gptq.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_small_run_writes_json(tmp_path, monkeypatch):
  bench = _load()
  monkeypatch.setattr(bench, "SMALL_LAYERS", ((256, 128),))
  # Only the XLA path here: the Pallas kernel is checked against it in test_quant_gptq.py.
  payload = bench.main(["--out", str(tmp_path), "--small", "--iters", "1", "--peer-iters", "1",
                        "--impls", "xla"])
  data = json.loads((tmp_path / "gptq.json").read_text())
  assert data["small"] and data["tokens"] == 4096 and set(data["layers"]) == {"256x128"}
  for entry in data["layers"].values():
    assert "error" not in entry
    assert entry["hessian_ours_f32_s"] > 0 and entry["hessian_ours_bf16_s"] > 0
    for g in ("g128", "g-1"):
      assert entry[f"{g}.ours_s"] > 0 and entry[f"{g}.ours_impl"] == "xla"
      assert entry[f"{g}.ours_s"] == entry[f"{g}.ours_xla_s"]
      assert entry[f"{g}.ours_error"] < entry[f"{g}.rtn_error"]      # GPTQ beats RTN
      if data["peer_unavailable"] is None:
        # Same Hessian, same algorithm: the peer's weights match ours almost everywhere.
        assert entry[f"{g}.frac_equal_weights"] > 0.99
        assert entry[f"{g}.peer_error"] == pytest.approx(entry[f"{g}.ours_error"], rel=0.02)
  assert payload["layers"] == data["layers"]

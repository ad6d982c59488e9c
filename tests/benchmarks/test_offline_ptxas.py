"""``benchmarks/offline_ptxas.py``: ptxas's report read right, and (where the offline kit is
set up: ``bash benchmarks/offline_setup.sh``) the deviceless compile of our kernels for sm_90a.
"""
import json
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import offline_ptxas as O  # noqa: E402  pylint: disable=wrong-import-position

# ptxas 13.0's report on session 13's dQ-writer backward (the codes come before the function).
WRITER_REPORT = """\
ptxas info    : 0 bytes gmem
ptxas info    : (C7507) Potential Performance Loss: 'setmaxnreg' ignored to maintain minimum \
register requirements.
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized \
due to insufficient register resources for the function 'flash_attention_dkdv_mosaic_gpu_kernel'
ptxas warning : Registers are spilled to local memory in function \
'flash_attention_dkdv_mosaic_gpu_kernel', 480 bytes spill stores, 496 bytes spill loads
ptxas info    : Compiling entry function 'flash_attention_dkdv_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for flash_attention_dkdv_mosaic_gpu_kernel
    488 bytes stack frame, 480 bytes spill stores, 496 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 488 bytes cumulative stack size, 1 bytes smem
ptxas info    : Compile time = 98.797 ms
"""


def test_parse_ptxas_reads_spills_and_codes():
  (fn,) = O.parse_ptxas(WRITER_REPORT)
  assert fn == dict(name="flash_attention_dkdv_mosaic_gpu_kernel", registers=168,
                    stack_bytes=488, spill_stores=480, spill_loads=496,
                    codes=["C7507", "C7512"])


def test_parse_ptxas_codes_stay_with_their_function():
  clean = WRITER_REPORT.replace("(C7507)", "").replace("(C7512)", "").replace("480", "0")
  second = WRITER_REPORT.replace("dkdv", "dq")
  fns = O.parse_ptxas(clean + second)
  assert [f["name"] for f in fns] == ["flash_attention_dkdv_mosaic_gpu_kernel",
                                      "flash_attention_dq_mosaic_gpu_kernel"]
  assert fns[0]["codes"] == [] and fns[0]["spill_stores"] == 0
  assert fns[1]["codes"] == ["C7507", "C7512"]


def test_sass_histogram_strips_predicates_and_modifiers():
  sass = """
        /*0a10*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0a20*/              @!P0 MUFU.EX2 R3, R3 ;
        /*0a30*/              @UP1 HGMMA.64x64x16.F32.BF16 R88, gdesc[UR12], R88 ;
        /*0a40*/                   STL [R1+0x8], R2 ;
  """
  assert O.sass_histogram(sass) == {"HGMMA": 2, "MUFU": 1, "STL": 1}


needs_kit = pytest.mark.skipif(
    not (pathlib.Path(O.KIT) / "site" / "jax_plugins").is_dir(),
    reason="offline CUDA kit not set up (bash benchmarks/offline_setup.sh)")

# ptxas advisories that mean the tensor cores wait: wgmma serialised (C7510-C7515) or a
# setmaxnreg split ignored (C7507).
SERIALISING = {"C7507", "C7510", "C7511", "C7512", "C7513", "C7514", "C7515"}


def _report(tmp_path, *args) -> list[dict]:
  out = tmp_path / "report.json"
  subprocess.run([sys.executable, str(BENCH / "offline_ptxas.py"), *args, "--json", str(out)],
                 check=True, capture_output=True, timeout=600)
  return json.loads(out.read_text())["kernels"]


@needs_kit
def test_forward_compiles_for_sm90_without_spills(tmp_path):
  """The default bf16 forward at H = 128, compiled for sm_90a with no GPU: 168 registers a
  thread (the setmaxnreg split of three warpgroups) and no spills."""
  (fwd,) = _report(tmp_path, "attn")
  assert fwd["module"].startswith("flash_attention_fwd")
  assert fwd["registers"] == 168 and fwd["spill_stores"] == 0 and fwd["codes"] == []


# (job arguments, the most spill-store bytes any kernel of the job may have). Budgets are
# session 28's figures with ptxas 13.0, rounded up: a change that spills more, or makes ptxas
# serialise wgmmas, shows here before it costs device time. Two were raised in session 40: the
# persistent dK/dV kernel spills 52 B (was 16; default shape) and 100 B (was <= 80; 4x8 heads)
# since session 31 made "lse+delta" early stats its default (bisected to afbb68f; timed there
# the dK/dV kernel 5% faster at 16x1024x16x128 full), which this kit-only test (skipped in CI)
# missed.
DEFAULTS = [
    (("attn", "--grad"), 56),
    (("attn", "--grad", "--causal"), 200),
    (("attn", "--grad", "--causal", "--softcap", "30"), 320),
    (("attn", "--grad", "--causal", "--segments"), 256),
    (("attn", "--grad", "--head-dim", "64", "--causal"), 0),
    # session 28's opt-in backward forms (persistent kernels, D in the dQ kernel)
    (("attn", "--grad", "--batch", "4", "--heads", "8",
      "--set", "bwd_persistent=True,exit_read_only=True"), 104),
    (("attn", "--grad", "--head-dim", "64", "--set", "bwd_persistent=True,bwd_delta_in_dq=True"),
     0),
    (("fp8", "--seq", "4096"), 0),
    (("w4a16", "--m", "1"), 0),
    (("w4a16", "--m", "64", "--k", "28672", "--n", "8192"), 0),
]


@needs_kit
@pytest.mark.parametrize("args,max_spill", DEFAULTS, ids=lambda a: "-".join(map(str, a))
                         if isinstance(a, tuple) else str(a))
def test_default_kernels_keep_their_registers(tmp_path, args, max_spill):
  kernels = _report(tmp_path, *args)
  assert kernels
  for k in kernels:
    assert not SERIALISING & set(k["codes"]), (k["module"], k["codes"])
    assert k["spill_stores"] <= max_spill, (k["module"], k["spill_stores"])


def test_loop_histograms_finds_the_wgmma_loop():
  sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_3:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0020*/                   MUFU.EX2 R3, R3 ;
        /*0030*/              @P0 BRA `(.L_x_3) ;
.L_x_4:
        /*0040*/                   FADD R2, R2, R3 ;
        /*0050*/              @P1 BRA `(.L_x_4) ;
        /*0060*/                   EXIT ;
  """
  (loop,) = O.loop_histograms(sass)
  assert (loop["start"], loop["end"], loop["length"]) == (1, 3, 3)
  assert loop["ops"] == {"HGMMA": 1, "MUFU": 1, "BRA": 1}

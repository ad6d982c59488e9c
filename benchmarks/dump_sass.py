"""Compile our Mosaic GPU kernels once with Mosaic's dump switches on and summarise ptxas's report.

Costs compile time only (each kernel runs once). Mosaic GPU reads its dump switches from the
environment when it compiles, so they are set here before jax is imported:
MOSAIC_GPU_DUMP_PTX / _PTXAS / _SASS and MOSAIC_GPU_DUMP_TO=<dir>. ptxas's reports and the
SASS land in ``OUT/mosaic_dump.tar.gz``; ``OUT/sass_summary.json`` lists, per dumped module
(and which job compiled it), the registers, spill stores/loads and stack frame that ptxas
reported (the questions METHOD.md says to answer from the compiler before spending device time
on timing):

  PYTHONPATH=$PWD python3 benchmarks/dump_sass.py --out $OUT [--only w4a16,attn_fwd,attn_bwd]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))


def _summarise(dump_dir: str) -> list[dict]:
  """One entry per ptxas log: the function names with registers, spills and stack bytes."""
  rows = []
  for path in sorted(glob.glob(os.path.join(dump_dir, "*"))):
    if "ptxas" not in os.path.basename(path):
      continue
    text = open(path, errors="replace").read()
    entry = dict(file=os.path.basename(path), job=None, functions=[])
    for fn in re.finditer(r"Compiling entry function '([^']+)'(.*?)(?=Compiling entry function|\Z)",
                          text, re.S):
      body = fn.group(2)
      grab = lambda pat: (int(m.group(1)) if (m := re.search(pat, body)) else None)
      entry["functions"].append(dict(
          name=fn.group(1), registers=grab(r"Used (\d+) registers"),
          stack_bytes=grab(r"(\d+) bytes stack frame"),
          spill_stores=grab(r"(\d+) bytes spill stores"),
          spill_loads=grab(r"(\d+) bytes spill loads")))
    entry["raw_tail"] = text[-1500:]
    rows.append(entry)
  return rows


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--only", default="w4a16,attn_fwd,attn_bwd")
  args = ap.parse_args()
  # Mosaic also dumps MLIR at every pass (large, many files): dump to a scratch folder and keep
  # only ptxas's reports and the SASS, packed in one archive.
  dump_dir = tempfile.mkdtemp(prefix="mosaic_dump_")
  os.makedirs(args.out, exist_ok=True)
  # The device image had no nvdisasm on the PATH (session 7); Triton's wheel carries one.
  site = os.path.dirname(os.path.dirname(os.__file__))
  for cand in ("/usr/local/cuda/bin", *glob.glob("/usr/local/cuda*/bin"),
               *glob.glob("/opt/nvidia/*/bin"),
               *glob.glob(os.path.join(site, "site-packages/triton/backends/nvidia/bin")),
               *glob.glob(os.path.join(site, "site-packages/nvidia/*/bin")),
               *glob.glob("/opt/*/.venv/lib/python3*/site-packages/triton/backends/nvidia/bin")):
    if os.path.exists(os.path.join(cand, "nvdisasm")):
      os.environ["PATH"] = cand + os.pathsep + os.environ.get("PATH", "")
      break
  for flag in ("PTX", "PTXAS", "SASS"):
    os.environ[f"MOSAIC_GPU_DUMP_{flag}"] = "1"
  os.environ["MOSAIC_GPU_DUMP_TO"] = dump_dir
  for p in (os.path.dirname(_HERE), _HERE):
    if p not in sys.path:
      sys.path.insert(0, p)

  import jax
  import jax.numpy as jnp
  import quant
  from quant.matmul import layout, mosaic as w4_mosaic
  from quant.matmul.config import default_mosaic_config
  from pallas_attn import flash_attention

  jobs = {}

  def w4a16():
    for m, k, n in ((1, 8192, 28672), (1, 8192, 8192), (16, 8192, 28672)):
      qw = quant.rtn(jax.random.normal(jax.random.key(0), (k, n), jnp.float32), bits=4,
                     group_size=128, sym=False)
      mw = layout.prepare_mosaic(qw)
      x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
      cfg = default_mosaic_config(m=m, k=k, n=n, group_size=128)
      jax.block_until_ready(w4_mosaic.int4_matmul(x, mw, config=cfg))
  jobs["w4a16"] = w4a16

  def _qkv(h):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(kk, (4, 1024, 16 * 128 // h, h), jnp.bfloat16) for kk in keys]

  def attn_fwd():
    for h in (128, 64, 256):
      q, k, v = _qkv(h)
      for causal in (False, True):
        jax.block_until_ready(flash_attention(q, k, v, causal=causal, implementation="mosaic"))
  jobs["attn_fwd"] = attn_fwd

  def attn_bwd():
    q, k, v = _qkv(128)
    for causal in (False, True):
      g = jax.grad(lambda q, k, v: flash_attention(q, k, v, causal=causal, implementation="mosaic")
                   .astype(jnp.float32).sum(), argnums=(0, 1, 2))
      jax.block_until_ready(g(q, k, v))
  jobs["attn_bwd"] = attn_bwd

  status, made_by = {}, {}

  def write_summary():
    """Rewritten after every job, so a job that never returns leaves the earlier reports."""
    modules = _summarise(dump_dir)
    for mod in modules:
      mod["job"] = made_by.get(mod["file"])
    summary = dict(status=status, modules=modules, nvdisasm=shutil.which("nvdisasm"))
    with tarfile.open(os.path.join(args.out, "mosaic_dump.tar.gz"), "w:gz") as tar:
      for path in sorted(glob.glob(os.path.join(dump_dir, "*"))):
        if re.search(r"(ptxas|resources|sass)", os.path.basename(path)):
          tar.add(path, arcname=os.path.basename(path))
    with open(os.path.join(args.out, "sass_summary.json"), "w") as f:
      json.dump(summary, f, indent=1)
    return summary

  for name in args.only.split(","):
    before = set(os.listdir(dump_dir))
    status[name] = "started"
    try:
      jobs[name]()
      status[name] = "ok"
    except Exception as e:  # keep going: the other kernels' reports are still worth having
      status[name] = f"{type(e).__name__}: {e}"[:2000]
      traceback.print_exc()
    for f in set(os.listdir(dump_dir)) - before:
      made_by[f] = name
    summary = write_summary()
  for mod in summary["modules"]:
    for fn in mod["functions"]:
      print(f"{mod['job']} {mod['file'][:50]:50s} {fn['name'][:40]:40s} regs={fn['registers']} stack={fn['stack_bytes']} "
            f"spill_st={fn['spill_stores']} spill_ld={fn['spill_loads']}")
  print(json.dumps(status))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

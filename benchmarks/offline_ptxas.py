"""ptxas's verdict on our Mosaic GPU kernels, on a host with no GPU (XLA's deviceless compile).

Device time is scarce, and several kernel forms failed on it for a reason the compiler states
before anything runs: ptxas spilling registers, ignoring ``setmaxnreg`` (C7507) or serialising
every wgmma of the function (C7512, session 13's dQ writer). This script answers those questions
on the CPU host. jax's CUDA plugin accepts a GPU *target config* instead of a device; its XLA
compiler then runs Mosaic's own MLIR -> PTX pipeline and ptxas, exactly as on the GPU, and
Mosaic's dump switches keep the PTX and ptxas's report. From the PTX the script also builds the
cubin and counts the SASS opcodes (``nvdisasm``). The plugin never runs a kernel here.

Set-up once (~350 MB under the git-ignored ``.offline_cuda/``): ``bash
benchmarks/offline_setup.sh``. Then, e.g.::

  .venv/bin/python benchmarks/offline_ptxas.py attn --grad --config "Config(bwd_dq_writer=True)"
  .venv/bin/python benchmarks/offline_ptxas.py fp8 --seq 4096
  .venv/bin/python benchmarks/offline_ptxas.py w4a16 --m 1 --k 8192 --n 28672 \
      --config "MosaicConfig(block_n=64, block_k=512, num_stages=4, split_k=2)"
  PYTHONPATH=/tmp/site:.whl/stubs .venv/bin/python benchmarks/offline_ptxas.py tokamax \
      --head-dim 256 --heads 8 --batch 4 --seq 4096 --sass      # the peer, same report

(``/tmp/site``: ``pip install --no-deps --target /tmp/site .whl/*.whl``.) Each job prints one
line per kernel; ``--keep DIR`` keeps the PTX, the report and the SASS; ``loop_histograms``
gives the opcode counts of each SASS loop that issues wgmmas.

Checked against the device: session 13's writer backward gave C7507, C7512 and 480 bytes of
spill stores on the H200 (``results/attention/2026-12-03_s13_ptxas_writer.txt``); here, with the
host's ptxas (CUDA 13.0), the same three lines and the same 480 bytes.
"""
from __future__ import annotations

# pylint: disable=import-outside-toplevel  (jax is imported only after _bootstrap)

import argparse
import ast
import collections
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
KIT = os.path.join(_ROOT, ".offline_cuda")

# XLA's GPU description of an H100 SXM (the fields of stream_executor.GpuTargetConfigProto); the
# compile only needs the compute capability and the limits, all equal on the H200.
H100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 3352320000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 84978434048 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

_PTXAS_CODE = re.compile(r"\((C\d{4})\)")


def parse_ptxas(text: str) -> list[dict]:
  """ptxas's ``-v`` report -> one dict per entry function: registers, stack and spill bytes,
  and the advisory codes (C7507 setmaxnreg ignored, C7512 / C7513 wgmma serialised, ...) that
  name the function or precede it in the report.

  >>> parse_ptxas("ptxas info    : Compiling entry function 'k' for 'sm_90a'\\n"
  ...             "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\\n"
  ...             "ptxas info    : Used 168 registers, used 16 barriers")[0]["registers"]
  168
  """
  functions = []
  pending: list[str] = []            # ptxas prints a function's advisories before its block
  for block in re.split(r"(?<=\n)(?=ptxas info\s+: Compiling entry function)", text):
    m = re.search(r"Compiling entry function '([^']+)'", block)
    if not m:
      pending += _PTXAS_CODE.findall(block)
      continue
    # The block runs on into the next function's advisories: they start after "Used N registers".
    own, _, rest = block.partition("registers")
    grab = lambda pat: int(g.group(1)) if (g := re.search(pat, block)) else None
    functions.append(dict(
        name=m.group(1), registers=grab(r"Used (\d+) registers"),
        stack_bytes=grab(r"(\d+) bytes stack frame"),
        spill_stores=grab(r"(\d+) bytes spill stores"),
        spill_loads=grab(r"(\d+) bytes spill loads"),
        codes=sorted(set(pending + _PTXAS_CODE.findall(own)))))
    pending = _PTXAS_CODE.findall(rest)
  return functions


def sass_histogram(sass: str) -> dict[str, int]:
  """Opcode -> static count in ``nvdisasm`` output (predicates and modifiers stripped:
  ``@!P0 HGMMA.64x128x16.F32.BF16`` counts as HGMMA)."""
  ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]\s+)?([A-Z][A-Z0-9_]*)", sass)
  return dict(collections.Counter(ops).most_common())


def loop_histograms(sass: str) -> list[dict]:
  """The loops of a SASS listing (a backward ``BRA`` to a label) that issue tensor-core work
  (HGMMA: wgmma; HMMA: mma.sync): their instruction range, length and opcode histogram (the
  steady state of a kernel, where static counts say the most)."""
  labels, instrs = {}, []
  for line in sass.splitlines():
    if m := re.match(r"\s*(\.L_x_\d+):", line):
      labels[m.group(1)] = len(instrs)
    elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]\s+)?([A-Z][A-Z0-9_]*)(.*)", line):
      instrs.append((m.group(1), m.group(2)))
  loops = []
  for end, (op, rest) in enumerate(instrs):
    target = re.search(r"(\.L_x_\d+)", rest) if op == "BRA" else None
    start = labels.get(target.group(1)) if target else None
    if start is not None and start <= end:
      ops = collections.Counter(o for o, _ in instrs[start:end + 1])
      if ops["HGMMA"] or ops["HMMA"]:
        loops.append(dict(start=start, end=end, length=end + 1 - start,
                          ops=dict(ops.most_common())))
  return loops


def _tool(name: str) -> str | None:
  return shutil.which(name) or shutil.which(name, path=os.path.join(KIT, "bin"))


def _bootstrap(dump_dir: str) -> None:
  """Before jax is imported: the plugin on sys.path, the dump switches set (read when Mosaic
  compiles), only the CPU backend initialised (the plugin's own backend needs a driver)."""
  site = os.path.join(KIT, "site")
  if not os.path.isdir(os.path.join(site, "jax_plugins")):
    raise SystemExit(f"no CUDA plugin under {site}: run `bash benchmarks/offline_setup.sh`")
  for p in (site, _ROOT):
    if p not in sys.path:
      sys.path.insert(0, p)
  os.environ["PATH"] = os.path.join(KIT, "bin") + os.pathsep + os.environ.get("PATH", "")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["MOSAIC_GPU_DUMP_PTX"] = "1"
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  os.environ["MOSAIC_GPU_DUMP_TO"] = dump_dir


def compile_for_sm90(fn, *args) -> None:
  """Compile ``jax.jit(fn)`` on abstract ``args`` (pytrees of ShapeDtypeStruct) for one H100,
  without a GPU: the arguments are placed on a compile-only device of a deviceless topology,
  and traced under an abstract GPU mesh (what the kernels' wrappers ask the device for)."""
  import jax
  from jax._src import mesh as mesh_lib
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(platform="cuda", topology_name="",
                                      target_config=H100_TARGET, topology="1x1x1")
  sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
  placed = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
  dev = mesh_lib.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=dev)):
    lowered = jax.jit(fn).trace(*placed).lower(lowering_platforms=("cuda",))
  lowered.compile()


def _with_overrides(cfg, spec: str):
  """``cfg`` with the fields of ``--set`` (``"a=1,b=True"``) replaced."""
  if not spec:
    return cfg
  fields = {k.strip(): ast.literal_eval(v.strip())
            for k, v in (item.split("=", 1) for item in spec.split(","))}
  return dataclasses.replace(cfg, **fields)


def _attn_job(args):
  import jax
  import jax.numpy as jnp
  from pallas_attn.mosaic import Config, default_config, ops
  h, n, kh = args.head_dim, args.heads, args.kv_heads or args.heads
  cfg = (eval(args.config, {"Config": Config}) if args.config  # pylint: disable=eval-used
         else default_config(head_dim=h, seq_k=args.seq, masked=args.causal or bool(args.window),
                             key_masks=args.segments or args.kv_lengths,
                             windowed=bool(args.window), batch=args.batch))
  cfg = _with_overrides(cfg, args.set)
  q = jax.ShapeDtypeStruct((args.batch, args.seq, n, h), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((args.batch, args.seq, kh, h), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32)
  extra = (seg if args.segments else None, seg if args.segments else None,
           jax.ShapeDtypeStruct((args.batch,), jnp.int32) if args.kv_lengths else None)
  window = tuple(None if w == "none" else int(w) for w in args.window.split(",")) \
      if args.window else None
  hp = ops.padded_head_dim(h)

  def loss(q, k, v, q_seg, kv_seg, kv_lengths):
    out, _ = ops._attention(  # pylint: disable=protected-access
        q, k, v, q_seg, kv_seg, kv_lengths, args.causal, h ** -0.5, window, args.softcap, cfg,
        hp, False)
    return out.astype(jnp.float32).sum()
  fn = jax.grad(loss, argnums=(0, 1, 2)) if args.grad else loss
  return fn, (q, kv, kv, *extra), repr(cfg)


def _fp8_job(args):
  import jax
  import jax.numpy as jnp
  from pallas_attn.mosaic import Config, ops
  from pallas_attn.mosaic import fp8 as mosaic_fp8
  ops._on_hopper = lambda: True  # pylint: disable=protected-access
  b, t, n, h = args.batch, args.seq, args.heads, args.head_dim
  cfg = (eval(args.config, {"Config": Config}) if args.config  # pylint: disable=eval-used
         else None)
  if args.set:
    cfg = _with_overrides(cfg or mosaic_fp8.fp8_default_config(
        head_dim=h, seq_k=t, masked=args.causal), args.set)
  codes = jax.ShapeDtypeStruct((b, t, n, h), jnp.float8_e4m3fn)
  rows = jax.ShapeDtypeStruct((b, n, t), jnp.float32)
  chans = jax.ShapeDtypeStruct((b, n, h), jnp.float32)

  def fwd(q8, qs, k8, ks, v8, vs):
    return mosaic_fp8.attention(q8, qs, k8, ks, v8, vs, out_dtype=jnp.bfloat16,
                                causal=args.causal, scale=h ** -0.5, window=None, softcap=None,
                                q_segment_ids=None, kv_segment_ids=None, kv_lengths=None,
                                return_lse=False, config=cfg, interpret=False,
                                k_scale_block=256)
  return fwd, (codes, rows, codes, rows, codes, chans), repr(cfg)


def _w4a16_job(args):
  import jax
  import jax.numpy as jnp
  import quant
  from quant.matmul import layout
  from quant.matmul import mosaic as w4_mosaic
  from quant.matmul.config import MosaicConfig
  k, n, gs = args.k, args.n, args.group_size
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  qw = quant.QuantizedWeight(
      qweight=i32(k // 8, n), scales=jax.ShapeDtypeStruct((k // gs, n), jnp.bfloat16),
      zeros=i32(k // gs, n), perm=None, bits=4, group_size=gs, sym=False, shape=(k, n))
  cfg = (eval(args.config, {"MosaicConfig": MosaicConfig})  # pylint: disable=eval-used
         if args.config else None)
  if args.set:
    cfg = _with_overrides(cfg, args.set)
  block_k = args.block_k or (cfg.block_k if cfg else None)
  mw = jax.eval_shape(lambda qw: layout.prepare_mosaic(qw, block_k=block_k), qw)
  x = jax.ShapeDtypeStruct((args.m, k), jnp.bfloat16)
  fn = lambda x, mw: w4_mosaic.int4_matmul(x, mw, config=cfg, interpret=False)
  return fn, (x, mw), repr(cfg)


def _tokamax_job(args):
  """tokamax's Mosaic attention (the peer in issue #3's table) on the same shapes; needs
  tokamax importable (e.g. PYTHONPATH with ``pip install --no-deps --target`` of ``.whl``)."""
  import jax
  import jax.numpy as jnp
  import tokamax
  h, n, kh = args.head_dim, args.heads, args.kv_heads or args.heads
  q = jax.ShapeDtypeStruct((args.batch, args.seq, n, h), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((args.batch, args.seq, kh, h), jnp.bfloat16)

  from tokamax._src import config as tk_config
  from tokamax._src.ops.attention import pallas_mosaic_gpu as tk_mgpu
  gpu = tk_mgpu.gpu_utils                   # its sm checks ask the (absent) device
  gpu.has_mosaic_gpu_support = lambda *a, **k: True
  gpu.is_sm80, gpu.is_sm90, gpu.is_sm100 = (
      (lambda *a, v=v, **k: v) for v in (False, True, False))

  def loss(q, k, v):
    with tk_config.cross_compile(True):      # its device check would see the CPU
      out = tokamax.dot_product_attention(q, k, v, is_causal=args.causal,
                                          implementation="mosaic_gpu")
    return out.astype(jnp.float32).sum()
  fn = jax.grad(loss, argnums=(0, 1, 2)) if args.grad else loss
  return fn, (q, kv, kv), "tokamax " + getattr(tokamax, "__version__", "?")


JOBS = {"attn": _attn_job, "fp8": _fp8_job, "w4a16": _w4a16_job, "tokamax": _tokamax_job}


def report(dump_dir: str, *, sass: bool) -> list[dict]:
  """One entry per dumped kernel: ptxas's figures, and with ``sass`` the opcode histogram of
  the cubin rebuilt from the dumped PTX by the same ptxas."""
  kernels = []
  for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptxas"))):
    base = os.path.basename(path)[:-len(".ptxas")]
    for fn in parse_ptxas(open(path, errors="replace").read()):
      fn["module"] = base
      ptx = os.path.join(dump_dir, base + ".ptx")
      if sass and os.path.exists(ptx) and _tool("ptxas") and _tool("nvdisasm"):
        cubin = os.path.join(dump_dir, base + ".cubin")
        subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-o", cubin, ptx], check=True,
                       capture_output=True)
        text = subprocess.run([_tool("nvdisasm"), "-c", cubin], check=True,
                              capture_output=True, text=True).stdout
        with open(os.path.join(dump_dir, base + ".sass"), "w") as f:
          f.write(text)
        fn["sass"] = sass_histogram(text)
        fn["sass_loops"] = loop_histograms(text)
      kernels.append(fn)
  return kernels


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("job", choices=sorted(JOBS))
  ap.add_argument("--config", default="", help="Config(...) / MosaicConfig(...) expression; "
                  "default: the library's heuristic for the shape")
  ap.add_argument("--set", default="", help="fields to replace in the config, e.g. "
                  "'bwd_registers=240,named_free=False' (attn: over the default for the shape)")
  ap.add_argument("--grad", action="store_true", help="attn: forward and backward")
  ap.add_argument("--causal", action="store_true")
  # Shapes: attention [batch, seq, heads, head_dim] (kv_heads 0: as many as heads; fewer:
  # GQA); W4A16 x [m, k] @ W [k, n] in groups (block_k 0: the layout's default K step).
  for name, default in (("--head-dim", 128), ("--heads", 2), ("--kv-heads", 0), ("--batch", 1),
                        ("--seq", 1024), ("--m", 1), ("--k", 8192), ("--n", 28672),
                        ("--group-size", 128), ("--block-k", 0)):
    ap.add_argument(name, type=int, default=default)
  ap.add_argument("--segments", action="store_true", help="attn: packed-sequence segment ids")
  ap.add_argument("--kv-lengths", action="store_true", help="attn: per-row key lengths")
  ap.add_argument("--window", default="", help="attn: 'left,right' (either may be 'none')")
  ap.add_argument("--softcap", type=float, default=None, help="attn: logit softcap")
  ap.add_argument("--sass", action="store_true", help="also count SASS opcodes (nvdisasm)")
  ap.add_argument("--keep", default="", help="copy the dump (PTX, ptxas report, SASS) here")
  ap.add_argument("--json", default="", help="write the report here")
  args = ap.parse_args()

  dump_dir = tempfile.mkdtemp(prefix="offline_ptxas_")
  _bootstrap(dump_dir)
  fn, fn_args, cfg = JOBS[args.job](args)
  compile_for_sm90(fn, *fn_args)
  kernels = report(dump_dir, sass=args.sass)
  for k in kernels:
    hot = ({op: k["sass"][op] for op in ("HGMMA", "MUFU", "STL", "LDL", "BAR", "SYNCS")
            if op in k["sass"]} if "sass" in k else "")
    sys.stdout.write(f"{k['module'][:44]:44s} regs={k['registers']} "
                     f"spill_st={k['spill_stores']} spill_ld={k['spill_loads']} "
                     f"codes={','.join(k['codes']) or '-'} {hot}\n")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(job=args.job, args=vars(args), config=cfg, kernels=kernels), f, indent=1)
  if args.keep:
    shutil.copytree(dump_dir, args.keep, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*mlir-passes.log"))
  shutil.rmtree(dump_dir, ignore_errors=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())

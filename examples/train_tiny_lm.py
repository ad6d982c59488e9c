"""Quantization quality study: a tiny byte-level GPT trained on Python's own documentation text.

The text is ``pydoc_data.topics`` (the help() topics shipped with CPython, ~490 KB of English);
the last 10% of its bytes are held out. The model is ``examples.gpt.GPT`` (4 layers, d_model 128,
seq 128), trained on CPU for a few minutes with AdamW (1000 steps of 16 x 128 bytes). Its parameters are saved (float32, about
3.5 MB) so the study can be re-run without retraining.

Held-out perplexity ``exp(mean NLL)`` is then measured for the float model and for every linear
layer of the blocks quantized (the embedding, norms and LM head stay in float, as is usual) by
RTN, GPTQ (with and without act-order) and AWQ at 4-bit and 3-bit, group size 128, asymmetric,
with 128 calibration windows of 128 bytes from the training split, through
``quant.quantize_model`` (true-sequential, layer by layer).

  PYTHONPATH=$PWD python examples/train_tiny_lm.py                   # train (or load) + table
  PYTHONPATH=$PWD python examples/train_tiny_lm.py --retrain --steps 1000
Writes ``benchmarks/results/quant_quality.{md,json}`` and ``benchmarks/results/tiny_lm_params.npz``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import quant
from examples.gpt import GPT, GPTConfig, next_token_loss

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                       "results")
CONFIG = GPTConfig(vocab=256, d_model=128, n_heads=4, n_kv_heads=4, n_layers=4, mlp_ratio=4,
                   max_len=128)
SEQ = 128


def load_text() -> tuple[np.ndarray, np.ndarray]:
  """UTF-8 bytes of ``pydoc_data.topics`` (topics in sorted order): (train 90%, held-out 10%)."""
  from pydoc_data.topics import topics
  data = np.frombuffer("\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8"), np.uint8)
  split = int(0.9 * len(data))
  return data[:split].astype(np.int32), data[split:].astype(np.int32)


def attention(q, k, v, *, causal):
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")


def new_model(seed: int = 0) -> GPT:
  return GPT(CONFIG, rngs=nnx.Rngs(seed), attention_fn=attention)


def train(train_data: np.ndarray, *, steps: int, batch: int = 32, lr: float = 5e-3,
          seed: int = 0, log_every: int = 50) -> GPT:
  model = new_model(seed)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(100, steps // 10), steps, lr / 10)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, tokens):
    def loss_fn(p):
      return next_token_loss(nnx.merge(graphdef, p, rest), tokens)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  t0 = time.time()
  for i in range(steps):
    starts = rng.integers(0, len(train_data) - SEQ - 1, batch)
    tokens = jnp.asarray(np.stack([train_data[s:s + SEQ + 1] for s in starts]))
    params, opt_state, loss = step(params, opt_state, tokens)
    if i % log_every == 0 or i == steps - 1:
      logging.info("step %d loss %.4f (%.0f s)", i, float(loss), time.time() - t0)
  return nnx.merge(graphdef, params, rest)


def save_params(model: GPT, path: str, *, steps: int) -> None:
  flat = {".".join(map(str, k)): np.asarray(v[...]) for k, v in
          nnx.to_flat_state(nnx.state(model, nnx.Param))}
  np.savez(path, __steps__=np.asarray(steps), **flat)


def load_params(path: str) -> tuple[GPT, int]:
  """The saved model and the number of steps it was trained for."""
  model = new_model()
  with np.load(path) as f:
    for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
      v[...] = jnp.asarray(f[".".join(map(str, k))])
    return model, int(f["__steps__"])


def windows(data: np.ndarray, length: int = SEQ + 1) -> np.ndarray:
  """Non-overlapping windows covering ``data`` (the tail shorter than a window is dropped)."""
  n = len(data) // length
  return data[: n * length].reshape(n, length)


def perplexity(model, data: np.ndarray, *, batch: int = 64) -> float:
  """exp of the mean next-byte NLL over non-overlapping windows of ``data``."""
  w = windows(data)
  loss = nnx.jit(lambda m, t: next_token_loss(m, t))
  total, count = 0.0, 0
  for i in range(0, len(w), batch):
    chunk = jnp.asarray(w[i:i + batch])
    total += float(loss(model, chunk)) * chunk.shape[0]
    count += chunk.shape[0]
  return math.exp(total / count)


def calibration_batches(train_data: np.ndarray, *, n: int = 128, batch: int = 32, seed: int = 1):
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(train_data) - SEQ, n)
  tok = np.stack([train_data[s:s + SEQ] for s in starts])
  return [jnp.asarray(tok[i:i + batch]) for i in range(0, n, batch)]


METHODS = (("RTN", dict(method="rtn")),
           ("GPTQ", dict(method="gptq")),
           ("GPTQ act-order", dict(method="gptq", act_order=True)),
           ("AWQ", dict(method="awq")))


def study(model: GPT, train_data, heldout, *, bits_list=(4, 3), group_size=128,
          progress=False) -> dict:
  calib = calibration_batches(train_data)
  fp = perplexity(model, heldout)
  rows = {"fp32": {"ppl": fp}}
  for bits in bits_list:
    for name, kw in METHODS:
      t0 = time.time()
      qmodel, report = quant.quantize_model(model, calib, bits=bits, group_size=group_size,
                                            progress=progress, **kw)
      ppl = perplexity(qmodel, heldout)
      rows[f"{name} {bits}-bit g{group_size}"] = dict(
          ppl=ppl, rel_to_fp=ppl / fp - 1, seconds=time.time() - t0,
          layer_error=sum(r.error for r in report), layer_rtn_error=sum(r.rtn_error for r in report))
      logging.info("%s %d-bit: ppl %.4f", name, bits, ppl)
  return rows


def write_results(rows: dict, meta: dict, out_dir: str = RESULTS) -> None:
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "quant_quality.json"), "w") as f:
    json.dump(dict(meta=meta, results=rows), f, indent=1)
  fp = rows["fp32"]["ppl"]
  lines = [
      "# Quantization quality: tiny byte-level GPT on `pydoc_data.topics`",
      "",
      f"Produced by `examples/train_tiny_lm.py` on {meta['date']} ({meta['device']}). Model: "
      f"`examples.gpt.GPT`, {meta['model']}, trained {meta['steps']} steps on the first 90% of the "
      f"bytes of `pydoc_data.topics` (Python {meta['python']}); held-out perplexity on the last "
      f"10% ({meta['heldout_tokens']} bytes, non-overlapping windows of {SEQ + 1} bytes, {SEQ} "
      "predictions each). The linear layers of "
      "the blocks are quantized (asymmetric, group 128, true-sequential `quant.quantize_model`, "
      "128 calibration windows of 128 bytes from the training split); embeddings, norms and the "
      "LM head stay float32. `layer err / RTN` is the summed proxy output error "
      "tr(D^T H D) of the quantized layers relative to RTN on the same calibration inputs.",
      "",
      "| weights | held-out perplexity | vs fp32 | layer err / RTN |",
      "|---|---|---|---|",
      f"| fp32 | {fp:.4f} | | |",
  ]
  for name, r in rows.items():
    if name == "fp32":
      continue
    lines.append(f"| {name} | {r['ppl']:.4f} | {100 * r['rel_to_fp']:+.2f}% | "
                 f"{r['layer_error'] / r['layer_rtn_error']:.3f} |")
  with open(os.path.join(out_dir, "quant_quality.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description="tiny LM quantization quality study")
  ap.add_argument("--steps", type=int, default=1000)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--retrain", action="store_true")
  ap.add_argument("--params", default=os.path.join(RESULTS, "tiny_lm_params.npz"))
  ap.add_argument("--out", default=RESULTS)
  args = ap.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
  train_data, heldout = load_text()
  t0 = time.time()
  if args.retrain or not os.path.exists(args.params):
    model = train(train_data, steps=args.steps, batch=args.batch)
    save_params(model, args.params, steps=args.steps)
    steps = args.steps
  else:
    model, steps = load_params(args.params)
  train_s = time.time() - t0
  rows = study(model, train_data, heldout, progress=True)
  import platform
  meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind,
              model=(f"{CONFIG.n_layers} layers, d_model {CONFIG.d_model}, {CONFIG.n_heads} heads, "
                     f"MLP {CONFIG.mlp_ratio * CONFIG.d_model}, seq {SEQ}"),
              steps=steps, python=platform.python_version(), heldout_tokens=len(heldout),
              train_tokens=len(train_data), train_or_load_s=train_s, jax=jax.__version__)
  write_results(rows, meta, args.out)
  return rows


if __name__ == "__main__":
  main()

"""Calibration statistics, AWQ, QuantLinear / quantize_model on the example GPT, safetensors I/O."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import quant
from quant import calibration, hf
from quant.matmul import layout
from quant.gptq import quantize_error
from examples.gpt import GPT, GPTConfig, next_token_loss


def _acts(seed=0, t=1024, k=128):
  rng = np.random.default_rng(seed)
  # Outlier channels, as in LLM activations: AWQ protects them.
  scales = np.exp(rng.standard_normal(k)).astype(np.float32)
  x = (rng.standard_normal((t, k)) @ rng.standard_normal((k, k)) * 0.2 + rng.standard_normal((t, k)))
  return jnp.asarray(x * scales, jnp.float32)


def test_streaming_statistics_equal_one_shot():
  x = _acts()
  stats = calibration.from_batches([x[:100], x[100:700].reshape(2, 300, 128), x[700:]])
  xn = np.asarray(x, np.float64)
  np.testing.assert_allclose(np.asarray(calibration.hessian(stats)), 2 * xn.T @ xn / 1024,
                             rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(calibration.mean_abs(stats)), np.abs(xn).mean(0), rtol=1e-5)
  assert int(stats.count) == 1024
  # bf16 inputs: exact products, float32 sums.
  s16 = calibration.from_batches([x.astype(jnp.bfloat16)])
  x16 = np.asarray(x.astype(jnp.bfloat16), np.float64)
  np.testing.assert_allclose(np.asarray(calibration.hessian(s16)), 2 * x16.T @ x16 / 1024,
                             rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("bits", [4, 3])
def test_awq_output_error_below_rtn(bits):
  x = _acts(1)
  w = jax.random.normal(jax.random.key(0), (128, 64)) * 0.05
  stats = calibration.from_batches([x])
  h, sx = calibration.hessian(stats), calibration.mean_abs(stats)
  res = quant.awq(w, h, sx, bits=bits, group_size=64)
  w_awq = quant.dequantize(res.qweight) / res.scale[:, None]
  w_rtn = quant.dequantize(quant.rtn(w, bits=bits, group_size=64))
  e_awq, e_rtn = quantize_error(w, w_awq, h), quantize_error(w, w_rtn, h)
  assert e_awq < 0.9 * e_rtn
  np.testing.assert_allclose(float(res.error), float(e_awq), rtol=1e-4)
  assert 0 <= float(res.alpha) < 1 and res.scale.shape == (128,)
  assert res.clip.shape == (2, 64) and float(res.clip.min()) >= 0.5
  # (x / s) @ Q(s w) is what a model computes after folding.
  y = quant.int4_matmul(x / res.scale, res.qweight)
  np.testing.assert_allclose(np.asarray(y), np.asarray(x @ w_awq), rtol=2e-4, atol=2e-4)
  # Without the clipping search the error can only be larger or equal.
  no_clip = quant.awq(w, h, sx, bits=bits, group_size=64, clip=False)
  assert float(no_clip.error) >= float(res.error) * (1 - 1e-6)


def _attention(q, k, v, *, causal):
  return jax.nn.dot_product_attention(q, k, v, is_causal=causal)


@pytest.fixture(scope="module")
def gpt():
  cfg = GPTConfig(vocab=256, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, max_len=32)
  model = GPT(cfg, rngs=nnx.Rngs(0), attention_fn=_attention)
  rng = np.random.default_rng(0)
  batches = [jnp.asarray(rng.integers(0, 256, (4, 32)), jnp.int32) for _ in range(2)]
  _BEFORE.append(jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))
  return model, batches


_QUANTIZED = {}
_BEFORE = []          # the fixture model's parameters before any quantize_model call


def _quantized(gpt, method):
  """quantize_model(method) of the fixture model, computed once per test process."""
  if method not in _QUANTIZED:
    model, batches = gpt
    _QUANTIZED[method] = quant.quantize_model(model, batches, method=method, bits=4, group_size=32,
                                              act_order=method == "gptq", progress=False)
  return _QUANTIZED[method]


def test_quant_linear_matches_reference():
  lin = nnx.Linear(128, 16, rngs=nnx.Rngs(0))
  qw = quant.rtn(lin.kernel[...], group_size=64)
  s = jnp.linspace(0.5, 2, 128)
  ql = quant.QuantLinear.from_linear(lin, qw, input_scale=s)
  x = jax.random.normal(jax.random.key(2), (3, 128))
  np.testing.assert_allclose(np.asarray(ql(x)),
                             np.asarray((x * s) @ quant.dequantize(qw) + lin.bias[...]), rtol=1e-5,
                             atol=1e-6)
  assert not nnx.state(ql, nnx.Param).get("qweight")       # packed codes are not trainable


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_quantize_model(gpt, method):
  model, batches = gpt
  qmodel, report = _quantized(gpt, method)
  before = _BEFORE[0]
  # The input model is untouched; every linear but the head is quantized, in execution order.
  after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  jax.tree.map(np.testing.assert_array_equal, before, after)
  names = [r.path for r in report]
  assert names == [f"blocks.{i}.{n}" for i in range(2)
                   for n in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up", "mlp.down")]
  assert isinstance(qmodel.head, nnx.Linear)
  assert all(isinstance(qmodel.blocks[i].attn.q, quant.QuantLinear) for i in range(2))
  for r in report:
    assert r.tokens == 2 * 4 * 32 and np.isfinite(r.error)
    if method == "rtn":
      assert r.error == pytest.approx(r.rtn_error, rel=1e-5)
  total, total_rtn = sum(r.error for r in report), sum(r.rtn_error for r in report)
  if method == "gptq":
    assert total < 0.8 * total_rtn
  if method == "awq":   # smaller gain: q/k/v are searched without clipping (llm-awq's rule)
    assert total < 0.95 * total_rtn
  if method == "awq":   # q/k/v share one scale folded into ln1, up into ln2, o/down keep it
    folded = {r.path: r.folded_into for r in report}
    assert folded["blocks.0.attn.q"] == "blocks.0.ln1" and folded["blocks.1.mlp.up"] == "blocks.1.ln2"
    assert folded["blocks.0.attn.o"] is None and qmodel.blocks[0].attn.o.input_scale is not None
  loss_fp = float(next_token_loss(model, batches[0]))
  loss_q = float(jax.jit(lambda m, t: next_token_loss(m, t))(qmodel, batches[0]))
  assert abs(loss_q - loss_fp) < 0.05 * loss_fp
  # nnx.jit through the quantized model equals eager.
  eager = qmodel(batches[1])
  jitted = nnx.jit(lambda m, t: m(t))(qmodel, batches[1])
  np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-5, atol=1e-5)


def test_true_sequential_calibration_sees_quantized_inputs(gpt):
  # The 'o' layer's statistics come from the already quantized q/k/v: quantizing them or not
  # changes o's calibration Hessian and hence its error.
  model, batches = gpt
  kw = dict(method="rtn", bits=2, group_size=32, progress=False)
  _, rep = quant.quantize_model(model, batches[:1], **kw)
  _, rep_fp_qkv = quant.quantize_model(model, batches[:1], exclude=("head", "q", "k", "v"), **kw)
  o = [r.error for r in rep if r.path == "blocks.0.attn.o"][0]
  o_fp_qkv = [r.error for r in rep_fp_qkv if r.path == "blocks.0.attn.o"][0]
  assert o != pytest.approx(o_fp_qkv, rel=1e-3)
  assert [r.path for r in rep_fp_qkv][:2] == ["blocks.0.attn.o", "blocks.0.mlp.up"]


@pytest.mark.parametrize("fmt,method", [("gptq", "gptq"), ("gptq_v2", "rtn"), ("awq", "awq")])
def test_safetensors_export_import(gpt, tmp_path, fmt, method):
  model, batches = gpt
  qmodel, _ = _quantized(gpt, method)
  path = str(tmp_path / "model.safetensors")
  config = hf.export_model(qmodel, path, format=fmt)
  assert config["quant_method"] == ("awq" if fmt == "awq" else "gptq")
  layers, others, cfg = hf.load_checkpoint(path)
  assert cfg == config and len(layers) == 12 and "head.kernel" in others
  # Codes and zero points survive bit-exactly; scales become float16.
  for name, qw in layers.items():
    node = qmodel
    for p in name.split("."):
      node = node[int(p)] if p.isdigit() else getattr(node, p)
    ours = node.quantized_weight
    np.testing.assert_array_equal(np.asarray(quant.dequantize(qw, dtype=jnp.float32)),
                                  np.asarray(quant.dequantize(formats_f16(ours), dtype=jnp.float32)))
  reloaded = hf.import_model(model, path)
  np.testing.assert_allclose(np.asarray(reloaded(batches[0])),
                             np.asarray(qmodel(batches[0])), rtol=2e-2, atol=2e-2)
  if fmt == "gptq":   # the same checkpoint in the Mosaic kernel's layout: the same model
    prepared = hf.import_model(model, path, mosaic=True)
    assert isinstance(prepared.blocks[0].attn.q.weight, layout.MosaicWeight)
    np.testing.assert_array_equal(np.asarray(prepared(batches[0])),
                                  np.asarray(reloaded(batches[0])))
    again = hf.export_model(prepared, str(tmp_path / "again.safetensors"), format=fmt)
    assert again == config
  from safetensors import safe_open
  with safe_open(path, framework="numpy") as f:
    meta = json.loads(f.metadata()["quantization_config"])
    assert meta["bits"] == 4 and meta["group_size"] == 32
    if fmt != "awq":
      assert f.get_tensor("blocks.0.attn.q.qweight").shape == (64 // 8, 64)
      assert f.get_tensor("blocks.0.attn.q.g_idx").shape == (64,)
    else:
      assert f.get_tensor("blocks.0.attn.q.qweight").shape == (64, 64 // 8)


def formats_f16(qw):
  return quant.QuantizedWeight(qw.qweight, qw.scales.astype(jnp.float16), qw.zeros, qw.perm,
                               qw.bits, qw.group_size, qw.sym, qw.shape)


def test_checkpoint_group_size_with_single_group_layers(tmp_path):
  # K=128 with group 128 is one group per column; it shares a config with K=512, group 128.
  a = quant.rtn(jax.random.normal(jax.random.key(0), (128, 16)), group_size=128)
  b = quant.rtn(jax.random.normal(jax.random.key(1), (512, 16)), group_size=128)
  path = str(tmp_path / "x.safetensors")
  assert hf.save_checkpoint(path, {"a": a, "b": b})["group_size"] == 128
  layers, _, _ = hf.load_checkpoint(path)
  assert layers["a"].group_size == 128 and layers["b"].group_size == 128
  np.testing.assert_array_equal(np.asarray(layers["b"].qweight), np.asarray(b.qweight))
  c = quant.rtn(jax.random.normal(jax.random.key(2), (256, 16)), group_size=None)
  with pytest.raises(ValueError, match="one group over K=256"):
    hf.save_checkpoint(path, {"c": c, "b": b})

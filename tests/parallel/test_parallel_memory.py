"""Per-device memory from the compiled executables' memory analysis."""
import functools

import jax
import optax
from flax import nnx

import parallel
from parallel import rules as R
from examples.gpt import GPT, dense_attention, next_token_nll
from parallel_helpers import FAST_COMPILE, make_tokens, tiny_config


def state_bytes_per_device(rules, mesh):
  """Argument bytes of the compiled step on one device, minus that device's slice of the batch."""
  model = GPT(tiny_config(), rngs=nnx.Rngs(0), attention_fn=dense_attention)
  step = parallel.make_train_step(model, optax.adam(1e-3), next_token_nll, mesh=mesh,
                                  rules=rules, compiler_options=FAST_COMPILE)
  tokens = make_tokens()
  compiled = step.lower(step.init(model), tokens).compile()
  batch_bytes = tokens.nbytes // (mesh.shape["data"] * mesh.shape["fsdp"])
  return compiled.memory_analysis().argument_size_in_bytes - batch_bytes


def test_fsdp_param_and_optimizer_bytes_are_one_nth():
  mesh = parallel.make_mesh(fsdp=8)
  replicated = state_bytes_per_device(R.DP, mesh)
  fsdp = state_bytes_per_device(R.FSDP, mesh)
  zero1 = state_bytes_per_device(R.ZERO1, mesh)
  # Adam: params + mu + nu = 3 copies. FSDP shards all three, ZeRO-1 only mu and nu.
  assert fsdp <= replicated / 8 * 1.05, (fsdp, replicated)
  params = replicated / 3
  assert zero1 <= (params + 2 * params / 8) * 1.05, (zero1, replicated)
  assert zero1 > fsdp

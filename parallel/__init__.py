"""3D parallelism on ``jax.sharding.Mesh`` + ``shard_map``: DP, ZeRO/FSDP, TP (+SP), PP, ring attention.

Example:
  >>> import parallel
  >>> mesh = parallel.make_mesh(data=2, fsdp=2, tensor=2)
  >>> step = parallel.make_train_step(model, optax.adam(1e-3), loss_fn, mesh=mesh,
  ...                                 rules=parallel.rules.FSDP_TP)
  >>> state = step.init(model)
  >>> state, metrics = step(state, batch)
"""
from parallel import checkpoint, context, pipeline, rules, tensor
from parallel.context import ring_attention
from parallel.mesh import AXES, make_mesh
from parallel.pipeline import PipelineConfig, pipeline_apply
from parallel.sharding import ActivationSharding, batch_sharding, shard_model, state_shardings
from parallel.train import REMAT_POLICIES, TrainState, TrainStep, make_train_step

__all__ = [
    "AXES", "make_mesh", "rules", "ActivationSharding", "batch_sharding", "shard_model",
    "state_shardings", "REMAT_POLICIES", "TrainState", "TrainStep", "make_train_step",
    "PipelineConfig", "pipeline_apply", "ring_attention", "checkpoint", "context", "pipeline",
    "tensor",
]

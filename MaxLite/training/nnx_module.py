"""The configured decoder as a Flax NNX module, for users whose training code is NNX (nnx.Optimizer, nnx.jit).

It is the very linen `Transformer` that `build.model(config)` returns, wrapped by `flax.nnx.bridge.ToNNX`, not an
NNX port: one model definition, so every decoder family, layer option, Qwix quantization and initialiser is the one
MaxLite trains, and nothing can drift between two copies of the layers. The bridge turns each parameter's linen
`LogicallyPartitioned` box into an `nnx.Param` whose `out_sharding` metadata holds the same logical axis names (the
scanned layers' leading `layers` axis included): outside a logical-axis-rules context
`nnx.get_partition_spec(nnx.state(model))` gives MaxLite's logical PartitionSpecs, which the config's
`logical_axis_rules` map to the mesh (`shardings` does it with MaxLite's own mapping).

The parameters are the module's attributes at MaxLite's paths (`model.token_embedder["embedding"]`,
`model.decoder["layers"]["mlp"]["wi_0"]["kernel"]`, ...), so `nnx.to_pure_dict(nnx.state(model, nnx.Param))` is the
`state.params` tree a MaxLite checkpoint holds; the rest of the state is the dropout stream (`to_nnx__rngs`).
Call it as the linen model: `model(ids, positions, segment_ids)` -> logits (`return_hidden=True` as in the tiled
loss). A MoE model's routing summary comes with `mutable="intermediates"`, then `nnx.pop(model, nnx.Intermediate)`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from jax.sharding import Mesh

from MaxLite.checkpoint import hf, lora_steps
from MaxLite.cli.errors import ConfigError
from MaxLite.config import Config
from MaxLite.models import build
from MaxLite.parallel import sharding as sharding_lib


def _check_supported(config: Config) -> None:
  if config.enable_lora:
    # A LoRA run's parameters are the adapters alone, beside a frozen base: no single NNX state is that tree.
    raise ConfigError(
      "enable_lora=true is not supported by the NNX module: build it without LoRA (load_checkpoint reads a LoRA step "
      "as its merged weights)"
    )
  if config.ensemble_size > 1:
    raise ConfigError(
      f"ensemble_size={config.ensemble_size}: the NNX module is one model; build it without an ensemble and read a "
      "member with load_checkpoint(model, path, member=i)"
    )
  if config.num_pipeline_stages > 1:
    # The pipeline applies each stage's slice of the raw parameters; through the bridge they arrive boxed.
    raise ConfigError(
      f"ici_pipeline_parallelism x dcn_pipeline_parallelism = {config.num_pipeline_stages} is not supported by the "
      "NNX module: shard it with fsdp, tensor or sequence parallelism"
    )


def nnx_model(config: Config, mesh: Mesh | None = None, rngs: nnx.Rngs | None = None) -> nnx.bridge.ToNNX:
  """The training model of `config` (dropout when dropout_rate > 0) as an NNX module holding the parameters a MaxLite
  run has at step 0 (jax.random.key(init_weights_seed)); made on `mesh`, placed as MaxLite places them, when given.
  `rngs` feed dropout, one draw per call: by default nnx.Rngs(dropout=config.seed), whose n-th draw (from 0) is the
  dropout key of MaxLite's step n when the module is called once a step (no gradient accumulation)."""
  _check_supported(config)

  def create(ids: jax.Array) -> nnx.bridge.ToNNX:
    # Initialised without dropout: the bridge's init takes a key for params alone (an nnx.Rngs stream would hand it
    # fold_in(key, 0), not MaxLite's key), and no parameter depends on dropout.
    model = nnx.bridge.ToNNX(build.model(config))
    # Made unsharded, then placed by MaxLite's logical-to-mesh mapping: flax's eager sharding maps each axis name on
    # its own, so two dimensions of one parameter could claim the same mesh axis.
    with nnx.use_eager_sharding(False):
      model.lazy_init(ids, ids, ids, rngs=jax.random.key(config.init_weights_seed))
    model.to_nnx__module = build.model(config, deterministic=config.dropout_rate == 0.0)
    if mesh is not None:
      nnx.update(model, jax.lax.with_sharding_constraint(nnx.state(model), shardings(model, mesh, config)))
    return model

  # Under jit the forward pass the init runs is dropped: only the parameters are computed, each on its own shards.
  ids = jnp.zeros((config.micro_batch_size, config.max_target_length), jnp.int32)
  if mesh is None:
    model = nnx.jit(create)(ids)
  else:
    with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
      model = nnx.jit(create)(ids)
  # Set here, not given to ToNNX, which would fork the stream into other keys.
  model.to_nnx__rngs = nnx.data(rngs if rngs is not None else nnx.Rngs(dropout=config.seed))
  return model


def shardings(model: nnx.Module, mesh: Mesh, config: Config) -> nnx.State:
  """NamedShardings of the module's whole state (the rngs replicated): where MaxLite keeps the same parameters."""
  # With no rules in context get_partition_spec keeps the logical names, which MaxLite's mapping then resolves.
  with nn_partitioning.axis_rules(()):
    logical = nnx.get_partition_spec(nnx.state(model))
  return sharding_lib.logical_to_sharding(logical, mesh, config)


def params_from_nnx(model: nnx.Module) -> dict[str, Any]:
  """MaxLite's params tree (a checkpoint's `state.params`), made of the module's arrays themselves."""
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def load_params_into(model: nnx.Module, params: dict[str, Any]) -> None:
  """Sets the module's parameters from MaxLite's params tree, each placed where the module keeps that parameter.
  A missing, extra or differently shaped parameter is a ValueError naming it (nothing is changed then)."""
  current = params_from_nnx(model)
  given = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  wanted = dict(jax.tree_util.tree_flatten_with_path(current)[0])
  for path in sorted(set(given) | set(wanted), key=str):
    name = jax.tree_util.keystr(path, simple=True, separator="/")
    if path not in wanted:
      raise ValueError(f"params have '{name}', which the NNX module lacks")
    if path not in given:
      raise ValueError(f"params have no '{name}' (shape {wanted[path].shape} in the NNX module)")
    if tuple(given[path].shape) != wanted[path].shape:
      raise ValueError(f"params' '{name}' has shape {tuple(given[path].shape)}, the NNX module's {wanted[path].shape}")
  placed = jax.tree_util.tree_map_with_path(lambda path, old: jax.device_put(given[path], old.sharding), current)
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, placed)
  nnx.update(model, state)


def load_checkpoint(model: nnx.Module, path: str, member: int = -1) -> None:
  """Loads a MaxLite checkpoint step's parameters (…/checkpoints/<step> of a run, a params-only export, a LoRA step
  as its merged weights, member `member` of an ensemble's step) into the module: MaxLite's own reader, straight onto
  the module's shardings."""
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), params_from_nnx(model))
  load_params_into(model, lora_steps.load_params(path, target, member))


def save_checkpoint(model: nnx.Module, config: Config, output_path: str) -> str:
  """Writes the module's parameters as a params-only MaxLite checkpoint, <output_path>/0 with the config's model keys
  (the step the Hugging Face import writes), and returns that step directory: MaxLite's load_parameters_path."""
  return hf.save_params(params_from_nnx(model), config, output_path)

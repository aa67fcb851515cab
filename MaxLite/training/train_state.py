"""Create the train state (params + optimizer state) directly sharded over the mesh."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxLite.config import Config, objectives
from MaxLite.layers import lora
from MaxLite.parallel.sharding import logical_to_sharding, unbox


@dataclasses.dataclass(frozen=True)
class TrainState(train_state.TrainState):
  """flax's train state, plus the frozen reference parameters of DPO (None otherwise). The reference is sharded like
  the parameters and saved with them, so a resumed DPO run needs nothing but its checkpoint. Without one the state
  flattens exactly as flax's does, so checkpoints written before the field existed still restore."""

  reference: Any = None
  frozen: Any = None  # LoRA: the base parameters, never updated nor saved; `params` are then the adapters alone
  _flax_dataclass = True  # flax's own dataclass registration is skipped: _flatten below decides the tree


def _flatten(state: TrainState) -> tuple[list, tuple]:
  names = ("step", "params", "opt_state") + tuple(n for n in ("reference", "frozen") if getattr(state, n) is not None)
  children = [(jax.tree_util.GetAttrKey(name), getattr(state, name)) for name in names]
  return children, (state.apply_fn, state.tx, names)


def _unflatten(aux: tuple, children: list) -> TrainState:
  apply_fn, tx, names = aux
  return TrainState(apply_fn=apply_fn, tx=tx, **dict(zip(names, children)))


jax.tree_util.register_pytree_with_keys(TrainState, _flatten, _unflatten)


def init_state(model: nn.Module, tx: optax.GradientTransformation, config: Config, rng: jax.Array) -> TrainState:
  """Step 0 from `rng`, boxed with logical axes (the pure function every initialiser jits or maps over members)."""
  # lazy_init traces the model on shapes only and keeps just the parameter computations, so the
  # compiled initialiser holds no forward pass (it compiles several times faster).
  shape = (config.micro_batch_size, config.max_target_length)
  ids = jax.ShapeDtypeStruct(shape, jnp.int32)
  with lora.init_scope(config):
    variables = model.lazy_init({"params": rng, "dropout": rng}, ids, ids, ids)
  return new_state(model, tx, config, variables["params"])


def keeps_reference(config: Config) -> bool:
  """Whether the state holds a frozen copy of the starting parameters: DPO's reference, or GRPO's for its KL penalty
  (none with grpo_beta=0, as TRL loads no reference model then). Under LoRA the frozen base is the reference."""
  return objectives.of(config).reference(config)


def model_params(state: TrainState) -> Any:
  """The parameters the model is applied with: with LoRA the frozen base and the adapters joined."""
  return state.params if state.frozen is None else lora.merge(state.frozen, state.params)


def new_state(model: nn.Module, tx: optax.GradientTransformation, config: Config, params: Any) -> TrainState:
  """Step 0 around `params`: a fresh optimizer state (with LoRA the adapters' alone; with DPO the reference)."""
  # A strongly typed step (TrainState.create's is a weakly typed Python 0) keeps the train step's
  # input types the same whether the state was just created or restored from a checkpoint, so both
  # runs execute one identical compiled program and resume bit for bit.
  if config.enable_lora:  # the optimizer sees the adapters alone; DPO's reference is the base with adapters off
    adapters, frozen = lora.split(params)
    state = TrainState.create(apply_fn=model.apply, params=adapters, tx=tx, frozen=frozen)
  else:
    reference = params if keeps_reference(config) else None
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx, reference=reference)
  return state.replace(step=jnp.zeros((), jnp.int32))


def abstract_state(model: nn.Module, tx: optax.GradientTransformation, config: Config, mesh: Mesh):
  """(unboxed abstract state, logical PartitionSpecs, NamedShardings), all with the state's tree structure."""
  # The key is abstract too (nothing runs on a device, so this also works for an AOT target whose devices cannot
  # execute anything), typed as create_train_state's concrete key is, replicated over the mesh: both share one trace.
  dtype = jax.eval_shape(lambda: jax.random.key(config.init_weights_seed)).dtype
  key = jax.ShapeDtypeStruct((), dtype, sharding=NamedSharding(mesh, PartitionSpec()))
  boxed = jax.eval_shape(_initialiser(model, tx, config), key)
  logical = nn.get_partition_spec(boxed)
  return unbox(boxed), logical, logical_to_sharding(logical, mesh, config)


def create_train_state(
  model: nn.Module, tx: optax.GradientTransformation, config: Config, shardings: Any
) -> TrainState:
  """Initialise inside jit with out_shardings, so no device ever holds the whole unsharded state (an ensemble's:
  ensemble.create_state)."""
  init = jax.jit(_initialiser(model, tx, config), out_shardings=shardings)
  return unbox(init(jax.random.key(config.init_weights_seed)))


# jax keeps a function's trace for its input types, whatever the jit around it: abstract_state's shapes and
# create_train_state's initialiser share one trace of the model when they are given the same function object (a
# training run calls both: an 8-step model_name=tiny run took 2.76 s instead of 2.93, the mean of 5 here, and a
# bigger model traces for longer). The last two (model, optimizer, config) are kept, by identity.
_INITIALISERS: list[tuple[Any, Any, Any, Any]] = []


def _initialiser(model: nn.Module, tx: optax.GradientTransformation, config: Config) -> Any:
  for held_model, held_tx, held_config, init in _INITIALISERS:
    if held_model is model and held_tx is tx and held_config is config:
      return init
  init = functools.partial(init_state, model, tx, config)
  _INITIALISERS[:] = [(model, tx, config, init), *_INITIALISERS[:1]]
  return init


def state_from_params(
  model: nn.Module, tx: optax.GradientTransformation, config: Config, params: Any, shardings: Any
) -> TrainState:
  """Step 0 with a fresh optimizer around given params (e.g. loaded for fine-tuning; with DPO also the reference)."""
  return jax.jit(functools.partial(new_state, model, tx, config), out_shardings=shardings)(params)


def reference_from_params(state: TrainState, shardings: Any) -> TrainState:
  """`state` with its parameters also as DPO's frozen reference: for a state loaded from a run without DPO (a
  pretraining or SFT step), whose parameters are the reference as load_parameters_path's are. The reference gets
  buffers of its own (the train step donates the parameters' buffers), placed as `shardings.reference`."""
  reference = jax.jit(lambda params: params, out_shardings=shardings.reference)(state.params)
  return state.replace(reference=reference)


def bytes_per_device(tree: Any) -> int:
  """Bytes this tree occupies on the most-loaded device, measured from the live shards."""
  per_device: dict[Any, int] = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values(), default=0)


def total_bytes(tree: Any) -> int:
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))

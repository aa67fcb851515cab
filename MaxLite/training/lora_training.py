"""Where a LoRA run's two parts come from. The frozen base: load_parameters_path (or load_full_state_path), else the
init_weights_seed's fresh parameters; it is never saved, so a resumed run reads it again from there. The adapters and
their optimizer state: the run's own newest checkpoint (auto-resume, which holds nothing else), else
lora_restore_path (a MaxLite LoRA step) or hf_lora_adapter_path (a PEFT folder), else fresh (B = 0)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from MaxLite.checkpoint import lora_steps
from MaxLite.checkpoint import manager as checkpointing
from MaxLite.config import Config
from MaxLite.layers import lora
from MaxLite.models import build
from MaxLite.training.train_state import TrainState


def _fresh(config: Config, pieces: Any, part: str, shardings: Any) -> Any:
  """The adapters (part="adapters") or the base (part="base") of a fresh init: jit computes only the part returned."""

  def init(rng: jax.Array) -> Any:
    ids = jax.ShapeDtypeStruct((config.micro_batch_size, config.max_target_length), jnp.int32)
    with lora.init_scope(config):
      params = pieces.model.lazy_init({"params": rng, "dropout": rng}, ids, ids, ids)["params"]
    adapters, base = lora.split(params)
    return adapters if part == "adapters" else base

  from MaxLite.parallel.sharding import unbox

  return unbox(jax.jit(init, out_shardings=shardings)(jax.random.key(config.init_weights_seed)))


def base_parameters(config: Config, pieces: Any, target: Any) -> Any:
  """The frozen base; with QLoRA read in full precision and quantized on the device as Qwix stores it."""
  path = config.load_parameters_path or config.load_full_state_path
  if not path:
    return _fresh(config, pieces, "base", pieces.shardings.frozen)
  if not config.lora_weight_qtype:
    return lora_steps.load_params(path, target.frozen, config.ensemble_member)
  mesh = jax.tree.leaves(pieces.shardings.params)[0].mesh
  plain = build.parameters(config, mesh, adapters=False, stored=False)
  full = lora_steps.load_params(
    path, checkpointing.sharded_target(plain.abstract, plain.shardings), config.ensemble_member
  )
  quantize = lambda params: lora.quantize_base(params, pieces.abstract.frozen)  # noqa: E731
  return jax.jit(quantize, out_shardings=pieces.shardings.frozen)(full)


def start_adapters(config: Config, pieces: Any, target: Any) -> Any:
  if config.lora_restore_path:
    logging.info("adapters from %s", config.lora_restore_path)
    return checkpointing.load_params(config.lora_restore_path, target.params)
  if config.hf_lora_adapter_path:
    from MaxLite.checkpoint import lora_peft

    logging.info("adapters from the PEFT folder %s", config.hf_lora_adapter_path)
    adapters = lora_peft.read_adapter(config.hf_lora_adapter_path, config, pieces.abstract.params)
    return jax.device_put(adapters, pieces.shardings.params)
  return _fresh(config, pieces, "adapters", pieces.shardings.params)


def initial_state(config: Config, pieces: Any, target: Any, checkpointer: Any, batches: Any) -> tuple[Any, int]:
  """(state, step) of a LoRA run: trainer.initial_state's LoRA branch."""
  if jax.process_index() == 0:
    print(describe(config, pieces.abstract), flush=True)
  frozen = base_parameters(config, pieces, target)
  resumed = checkpointer.restore_newest(target.replace(frozen=None), batches)
  if resumed is not None:
    state, step = resumed
    logging.info("resumed the adapters from checkpoint at step %d in %s", step, config.checkpoint_dir)
    return state.replace(frozen=frozen), step
  adapters = start_adapters(config, pieces, target)

  def create(adapters: Any, frozen: Any) -> TrainState:  # a strongly typed step, as train_state.new_state makes
    state = TrainState.create(apply_fn=pieces.model.apply, params=adapters, tx=pieces.tx, frozen=frozen)
    return state.replace(step=jnp.zeros((), jnp.int32))

  return jax.jit(create, out_shardings=pieces.shardings)(adapters, frozen), 0


def describe(config: Config, abstract: Any) -> str:
  """One line for the start of a LoRA run: what trains, out of how much."""
  trained = lora.count(abstract.params)
  total = trained + config.num_params  # not the frozen tree's size: QLoRA's holds scales besides the weights
  modules = lora.adapted_modules(abstract.params)
  moving_bias = config.routed_bias and config.routed_bias_update_rate > 0  # not moved: train_step.train_step says why
  return (
    f"LoRA rank {config.lora_rank}, alpha {config.lora_alpha:g}: {trained:,} trainable parameters of {total:,} "
    f"({100 * trained / total:.3f}%), adapters on {len(modules)} projections ({', '.join(modules[:3])}"
    f"{', ...' if len(modules) > 3 else ''}); the base is frozen"
    + (", its routing bias too (routed_bias_update_rate is for full training)" if moving_bias else "")
  )

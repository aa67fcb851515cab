"""The loss and the jitted train/eval steps: pure functions of (state, batch)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from MaxLite.config import Config, objectives
from MaxLite.config.families import family
from MaxLite.layers import lora
from MaxLite.parallel.sharding import on_device
from MaxLite.runtime import one_at_a_time
from MaxLite.runtime.compiler_options import step_compiler_options
from MaxLite.training.optimizer import create_optimizer, learning_rate_schedule
from MaxLite.training.train_state import TrainState

Batch = dict[str, jax.Array]


def batch_loss_sums(
  params: Any, apply_fn: Any, batch: Batch, rng: jax.Array, config: Config, reference: Any = None
) -> tuple:
  """(total, sums): the objective's losses on `batch` summed (not averaged) over what it averages over (tokens,
  pairs, completions; `reference`: the frozen reference parameters where it reads them), so microbatches add up to
  the full batch exactly. `total` (also sums["loss_sum"]) is what the gradient is taken of; sums["count"] is what it
  is a sum over."""
  return objectives.of(config).loss_sums(params, reference, apply_fn, batch, rng, config)


def _microbatches(batch: Batch, n: int) -> Batch:
  """[n*B, S] -> [n, B, S] such that each device's rows stay on that device (no resharding)."""
  return {k: jnp.swapaxes(v.reshape(v.shape[0] // n, n, *v.shape[1:]), 0, 1) for k, v in batch.items()}


def _gradients(state: TrainState, batch: Batch, rng: jax.Array, config: Config) -> tuple[Any, dict]:
  """Gradients of the summed loss with respect to state.params: with LoRA the adapters alone (the frozen base is a
  constant of the differentiated function, so it has no gradient), and DPO's reference is that base."""
  reference = state.frozen if state.frozen is not None else state.reference

  def loss_fn(params: Any, micro: Batch, micro_rng: jax.Array) -> tuple:
    full = params if state.frozen is None else lora.merge(state.frozen, params)
    return batch_loss_sums(full, state.apply_fn, micro, micro_rng, config, reference)

  def grad_fn(micro: Batch, micro_rng: jax.Array) -> tuple:
    return jax.value_and_grad(loss_fn, has_aux=True)(state.params, micro, micro_rng)

  objective = objectives.of(config)
  if objective.prepare is not None:  # whole-batch quantities, before the batch is split
    batch = objective.prepare(batch, config)
  n = config.gradient_accumulation_steps
  if n == 1:
    (_, aux), grads = grad_fn(batch, rng)
    return grads, aux

  def accumulate(carry, micro):
    grads_acc, aux_acc, i = carry
    (_, aux), grads = grad_fn(micro, jax.random.fold_in(rng, i))
    return (jax.tree.map(jnp.add, grads_acc, grads), jax.tree.map(jnp.add, aux_acc, aux), i + 1), None

  zeros = jax.tree.map(jnp.zeros_like, state.params)
  micros = _microbatches(batch, n)
  aux_shape = jax.eval_shape(lambda: grad_fn(jax.tree.map(lambda v: v[0], micros), rng)[0][1])
  aux0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shape)
  (grads, aux, _), _ = jax.lax.scan(accumulate, (zeros, aux0, 0), micros)
  return grads, aux


def train_step(
  state: TrainState, batch: Batch, *, config: Config, shardings: Any = None, member: dict | None = None
) -> tuple[TrainState, dict]:
  """`shardings` (the state's): where host-offloaded params or optimizer state live, to bring them in. `member`: an
  ensemble member's own "seed" and peak "learning_rate" (traced; training/ensemble.py maps this step over them)."""
  if shardings is not None:
    state = state.replace(
      params=on_device(state.params, shardings.params), opt_state=on_device(state.opt_state, shardings.opt_state)
    )
  peak = None if member is None else member["learning_rate"]
  rng = jax.random.fold_in(jax.random.key(config.seed if member is None else member["seed"]), state.step)
  grads, aux = _gradients(state, batch, rng, config)
  count = jnp.maximum(aux["count"], 1.0)  # tokens, or DPO's pairs
  grads = jax.tree.map(lambda g: g / count.astype(g.dtype), grads)
  grad_norm = optax.global_norm(grads)
  if member is None:
    new_state = state.apply_gradients(grads=grads)
  else:  # the member's own schedule; its optimizer state has the same structure, so `tx` goes back unchanged
    new_state = state.replace(tx=create_optimizer(config, peak)).apply_gradients(grads=grads).replace(tx=state.tx)
  objective = objectives.of(config)
  if objective.keeps_update is not None:  # e.g. GRPO: no update from a batch with no signal (objectives/grpo.py)
    new_state = jax.tree.map(functools.partial(jnp.where, objective.keeps_update(batch)), new_state, state)
  # With LoRA the routing bias belongs to the frozen base, which a LoRA step does not save: moved here it would be
  # lost at each resume and missing from every export (base + adapters), so it stays as loaded.
  if "expert_counts" in aux and config.routed_bias_update_rate > 0 and state.frozen is None:
    new_state = new_state.replace(params=update_routing_bias(new_state.params, aux["expert_counts"], config))
  metrics = {
    "loss": aux["loss_sum"] / count,
    "grad_norm": grad_norm,
    "learning_rate": learning_rate_schedule(config, peak)(state.step),
    "tokens": aux["tokens"],
  }
  metrics.update(objective.train_metrics(aux, count))
  if "moe_lb_sum" in aux:
    metrics["moe_lb_loss"] = aux["moe_lb_sum"] / count
    metrics["moe_dropped_fraction"] = aux["moe_dropped"] / jnp.maximum(aux["moe_routed"], 1.0)
  return new_state, metrics


def update_routing_bias(params: Any, counts: jax.Array, config: Config) -> Any:
  """Auxiliary-loss-free balancing (DeepSeek-V3's, MaxText's update): each MoE layer's routing bias moves by
  routed_bias_update_rate towards balance, up for an expert chosen less often than the average, down for one chosen
  more. counts [MoE layers, experts] are this step's choices over the whole global batch. No gradient is involved."""
  step = config.routed_bias_update_rate * jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)
  decoder, row = dict(params["decoder"]), 0
  # counts' rows are the MoE layers in depth order: the family's stacks in order, each scanned or unrolled.
  for stack in family(config.decoder_block).stacks(config):
    names = [stack.name] if config.scan_layers else [f"{stack.name}_{i}" for i in range(stack.count)]
    for name in names:
      if "score_correction_bias" not in decoder.get(name, {}).get("moe", {}):
        continue
      rows = step[row : row + stack.count] if config.scan_layers else step[row]
      decoder[name] = _with_bias(decoder[name], decoder[name]["moe"]["score_correction_bias"] + rows)
      row += stack.count if config.scan_layers else 1
  return {**params, "decoder": decoder}


def _with_bias(layer: Any, bias: jax.Array) -> Any:
  return {
    **layer,
    "moe": {**layer["moe"], "score_correction_bias": bias.astype(layer["moe"]["score_correction_bias"].dtype)},
  }


def eval_step(
  params: Any,
  batch: Batch,
  reference: Any = None,
  *,
  apply_fn: Any,
  config: Config,
  shardings: Any = None,
  reference_shardings: Any = None,
) -> dict:
  """The loss sums of one eval batch; `reference` only for an objective that reads it."""
  if shardings is not None:
    params = on_device(params, shardings)
    reference = None if reference is None else on_device(reference, reference_shardings or shardings)
  objective = objectives.of(config)
  batch = batch if objective.prepare is None else objective.prepare(batch, config)
  _, aux = batch_loss_sums(params, apply_fn, batch, jax.random.key(0), config, reference)
  aux.pop("expert_counts", None)  # only training moves the routing bias; eval reports scalars
  return aux


class _TrainStep:
  """The jitted step with the optimizer state donated, and the parameters too unless donate_params=false.

  Donating the parameters lets the new ones overwrite them in place. On the compiler's own allocation (the buffer
  assignment train_compile.py reads) it is the smaller program on llama2-7b (v5p-8, 2 x 8192: 32.38 GiB donated,
  32.50 not) and on five of MaxText's seven recipes (0.14-0.35 GiB less; v5e 64B and 128B 0.02-0.04 more).
  memory_analysis()'s sum says the opposite (39.6 against 35.5 GiB on llama2-7b) because libtpu's
  temp_size_in_bytes counts more than the temporaries it allocates."""

  def __init__(self, jitted: Any, devices: Any):
    self._jitted = jitted
    self._call = one_at_a_time.calls(jitted, devices)  # simulated CPU devices: one step at a time (why: there)

  def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    return self._call(state.params, state.replace(params=None), batch)

  def lower(self, state: TrainState, batch: Batch) -> Any:
    return self._jitted.lower(state.params, state.replace(params=None), batch)


def jit_train_step(
  config: Config, state_shardings: Any, batch_sharding: Any, replicated: Any, members_step: Any = None
) -> _TrainStep:
  """members_step: an ensemble's step (training/ensemble.py maps this module's train_step over its members)."""

  def split_train_step(params: Any, rest: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    if members_step is not None:
      return members_step(params, rest, batch, config=config)
    return train_step(rest.replace(params=params), batch, config=config, shardings=state_shardings)

  return _TrainStep(
    jax.jit(
      split_train_step,  # its name must hold "train_step": train_compile dumps the module by that name
      in_shardings=(state_shardings.params, state_shardings.replace(params=None), batch_sharding),
      out_shardings=(state_shardings, replicated),
      donate_argnums=(0, 1) if config.donate_params else 1,
      compiler_options=step_compiler_options(config, _platform(batch_sharding)),
    ),
    batch_sharding.device_set,
  )


def _platform(sharding: Any) -> str:
  """The platform the program runs on: its devices' (a deviceless AOT target's too), not this process's default."""
  return next(iter(sharding.device_set)).platform


def jit_eval_step(
  config: Config,
  apply_fn: Any,
  param_shardings: Any,
  batch_sharding: Any,
  replicated: Any,
  reference_shardings: Any = None,
):
  """The frozen reference (DPO's) is a third argument, sharded like the parameters unless `reference_shardings` says
  otherwise (LoRA: the base alone)."""
  reference_shardings = param_shardings if reference_shardings is None else reference_shardings
  return jax.jit(
    functools.partial(
      eval_step, apply_fn=apply_fn, config=config, shardings=param_shardings, reference_shardings=reference_shardings
    ),
    in_shardings=(param_shardings, batch_sharding)
    + ((reference_shardings,) if objectives.of(config).reads_reference else ()),
    out_shardings=replicated,
    compiler_options=step_compiler_options(config, _platform(batch_sharding)),
  )

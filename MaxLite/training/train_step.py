"""The loss and the jitted train/eval steps: pure functions of (state, batch)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from MaxLite.config import Config
from MaxLite.config.families import family
from MaxLite.layers import lora
from MaxLite.models.transformer import logits_dtype
from MaxLite.parallel.sharding import on_device
from MaxLite.runtime.compiler_options import step_compiler_options
from MaxLite.training import dpo, grpo, loss
from MaxLite.training.optimizer import create_optimizer, learning_rate_schedule
from MaxLite.training.train_state import TrainState

Batch = dict[str, jax.Array]


def batch_loss_sums(
  params: Any, apply_fn: Any, batch: Batch, rng: jax.Array, config: Config, reference: Any = None
) -> tuple:
  """(total, sums): the model's losses on `batch` summed (not averaged) over real tokens (DPO: over pairs, with
  `reference` the frozen reference parameters), so microbatches add up to the full batch exactly. `total` (also
  sums["loss_sum"]) is what the gradient is taken of; sums["count"] is what it is a sum over."""
  if config.use_dpo:
    return _dpo_loss_sums(params, reference, apply_fn, batch, rng, config)
  if config.use_grpo:
    logits, _ = forward(params, apply_fn, batch, rng)
    sums = grpo.loss_sums(logits, batch, config)
    return sums["loss_sum"], sums
  tiled, sliced = config.num_vocab_tiling > 1, config.vocab_slices > 1
  out, extra = forward(params, apply_fn, batch, rng, return_hidden=tiled or sliced)
  mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  if tiled or sliced:
    hidden, head = out
    split_loss = loss.tiled_loss_sums if tiled else loss.vocab_sliced_loss_sums
    n = config.num_vocab_tiling if tiled else config.vocab_slices
    xent_sum, z_sum = split_loss(
      hidden, head, batch["targets"], mask, config.z_loss_multiplier, n, logits_dtype(config)
    )
  else:
    xent_sum, z_sum = loss.loss_sums(out, batch["targets"], mask, config.z_loss_multiplier)
  tokens = jnp.sum(mask)
  sums = {"xent_sum": xent_sum, "z_sum": z_sum, "tokens": tokens, "count": tokens}
  if "moe" in extra.get("intermediates", {}):
    moe = extra["intermediates"]["moe"][0]
    # Token-weighted like the other terms, so gradient accumulation and sharding leave it unchanged.
    sums.update(moe_lb_sum=moe["lb_loss"] * tokens, moe_dropped=moe["dropped"], moe_routed=moe["routed"])
    if "expert_counts" in moe:  # [MoE layers, experts], for the routing-bias update
      sums["expert_counts"] = moe["expert_counts"]
  sums["loss_sum"] = sums["xent_sum"] + sums["z_sum"] + config.load_balance_loss_weight * sums.get("moe_lb_sum", 0.0)
  return sums["loss_sum"], sums


def forward(params: Any, apply_fn: Any, batch: Batch, rng: jax.Array, return_hidden: bool = False) -> tuple:
  """(logits or (hidden, head), the intermediates) of the model on a batch's inputs."""
  return apply_fn(
    {"params": params},
    batch["inputs"],
    batch["inputs_position"],
    batch["inputs_segmentation"],
    return_hidden=return_hidden,
    rngs={"dropout": rng},
    mutable="intermediates",
  )


def _dpo_loss_sums(params: Any, reference: Any, apply_fn: Any, batch: Batch, rng: jax.Array, config: Config) -> tuple:
  """DPO's loss and metrics summed over the batch's preference pairs (training/dpo.py)."""

  def responses(p: Any) -> tuple[jax.Array, ...]:
    logits, _ = forward(p, apply_fn, batch, rng)
    log_p, _ = loss.target_log_probs(logits, batch["targets"])
    return dpo.response_log_probs(log_p, batch["targets_segmentation"])

  chosen, rejected, valid = responses(params)
  # The reference's own forward pass: without dropout, whatever dropout_rate (training/dpo.py).
  ref_chosen, ref_rejected = dpo.reference_log_probs(reference, batch, config)
  sums = dpo.dpo_sums(
    (chosen, rejected), (ref_chosen, ref_rejected), valid, config.dpo_beta, config.dpo_label_smoothing
  )
  sums.update(loss_sum=sums["dpo_loss_sum"], count=sums["pairs"], tokens=jnp.sum(batch["targets_segmentation"] != 0))
  return sums["loss_sum"], sums


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
  if config.use_grpo:  # no update from a batch whose advantages are all 0 (training/grpo.py's docstring)
    new_state = jax.tree.map(functools.partial(jnp.where, grpo.updates(batch)), new_state, state)
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
  if config.use_dpo:
    metrics.update({k: aux[k] / count for k in dpo.REWARD_METRICS}, pairs=aux["pairs"])
  elif config.use_grpo:  # per completion token, as TRL logs them
    metrics.update({k: aux[k] / jnp.maximum(aux["tokens"], 1.0) for k in grpo.TOKEN_METRICS if k in aux})
  else:
    metrics["z_loss"] = aux["z_sum"] / count
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
  """The loss sums of one eval batch; `reference` only with use_dpo."""
  if shardings is not None:
    params = on_device(params, shardings)
    reference = None if reference is None else on_device(reference, reference_shardings or shardings)
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

  def __init__(self, jitted: Any):
    self._jitted = jitted

  def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    return self._jitted(state.params, state.replace(params=None), batch)

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
    )
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
  """DPO's frozen reference is a third argument, sharded like the parameters unless `reference_shardings` says
  otherwise (LoRA: the base alone)."""
  reference_shardings = param_shardings if reference_shardings is None else reference_shardings
  return jax.jit(
    functools.partial(
      eval_step, apply_fn=apply_fn, config=config, shardings=param_shardings, reference_shardings=reference_shardings
    ),
    in_shardings=(param_shardings, batch_sharding) + ((reference_shardings,) if config.use_dpo else ()),
    out_shardings=replicated,
    compiler_options=step_compiler_options(config, _platform(batch_sharding)),
  )

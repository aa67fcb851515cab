"""Ensembles: ensemble_size members of the configured model trained in one compiled program.

Every parameter and optimizer-state array gets a leading member axis, logical axis "ensemble" (sharded over the
`ensemble` mesh axis by the config's rules), and the one-member train step is mapped over it with jax.vmap. Inside the
map a member is exactly a separate run: its own seeds and peak learning rate (config/ensembles.py), its own gradient
clipping norm, and the model's sharding constraints get the member axis added (spmd_axis_name), so the other mesh axes
shard each member as they shard a single run. The step counter is shared.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from MaxLite.config import Config
from MaxLite.config.ensembles import member_learning_rates, member_seed_offsets
from MaxLite.objectives import cross_entropy as loss
from MaxLite.parallel.sharding import logical_to_sharding, unbox
from MaxLite.training.train_state import TrainState, init_state, new_state
from MaxLite.training.train_step import Batch, train_step

AXIS = "ensemble"  # the logical axis and the mesh axis of the members
PER_MEMBER = ("loss", "grad_norm", "learning_rate")  # the metrics that get one series per member


def members(config: Config) -> dict[str, jax.Array]:
  """Each member's init seed, step seed and peak learning rate, as [ensemble_size] arrays."""
  offsets = jnp.asarray(member_seed_offsets(config), jnp.int32)
  return {
    "init_seed": config.init_weights_seed + offsets,
    "seed": config.seed + offsets,
    "learning_rate": jnp.asarray(member_learning_rates(config), jnp.float32),
  }


def _state_axes(state: TrainState) -> TrainState:
  """vmap's axes for a state: every array mapped on axis 0 but the shared step."""
  return jax.tree.map(lambda _: 0, state).replace(step=None)


def stack(abstract: TrainState, logical: TrainState, config: Config, mesh: jax.sharding.Mesh) -> tuple:
  """A one-member state's (abstract, logical specs) -> the ensemble's, with its NamedShardings."""
  k = config.ensemble_size
  stacked = jax.tree.map(lambda a: jax.ShapeDtypeStruct((k, *a.shape), a.dtype), abstract).replace(step=abstract.step)
  specs = jax.tree.map(
    lambda s: PartitionSpec(AXIS, *s), logical, is_leaf=lambda s: isinstance(s, PartitionSpec)
  ).replace(step=logical.step)
  return stacked, specs, logical_to_sharding(specs, mesh, config)


def create_state(model: Any, tx: Any, config: Config, shardings: Any, abstract: TrainState) -> TrainState:
  """Every member initialised from its own init seed, each exactly as a separate run's step 0, made sharded."""

  def init(seeds: jax.Array) -> TrainState:
    one = lambda seed: unbox(init_state(model, tx, config, jax.random.key(seed)))  # noqa: E731
    # spmd_axis_name: the layers' sharding constraints place each member's shards on its own devices during init too.
    return jax.vmap(one, out_axes=_state_axes(abstract), spmd_axis_name=AXIS)(seeds)

  return jax.jit(init, out_shardings=shardings)(members(config)["init_seed"])


def one_member_target(target: Any) -> Any:
  """An ensemble's stacked target (ShapeDtypeStructs with shardings) -> one member's."""

  def one(t: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    sharding = jax.sharding.NamedSharding(t.sharding.mesh, PartitionSpec(*t.sharding.spec[1:]))
    return jax.ShapeDtypeStruct(t.shape[1:], t.dtype, sharding=sharding)

  return jax.tree.map(one, target)


def state_from_params(model: Any, tx: Any, config: Config, params: Any, shardings: Any, abstract: TrainState) -> Any:
  """Step 0 with every member starting from the same loaded parameters (a fine-tuning sweep), each its own optimizer."""

  def build(p: Any) -> TrainState:
    stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (config.ensemble_size, *a.shape)), p)
    fresh = lambda q: new_state(model, tx, config, q)  # noqa: E731
    return jax.vmap(fresh, out_axes=_state_axes(abstract), spmd_axis_name=AXIS)(stacked)

  return jax.jit(build, out_shardings=shardings)(params)


def _member_batches(batch: Batch, config: Config) -> tuple[Batch, int | None]:
  """(batch, vmap axis): ensemble_data=distinct loads ensemble_size batches in one, member-major."""
  if config.ensemble_data != "distinct":
    return batch, None
  k = config.ensemble_size
  return {name: v.reshape(k, v.shape[0] // k, *v.shape[1:]) for name, v in batch.items()}, 0


def _with_member_series(metrics: dict[str, jax.Array], config: Config) -> dict[str, jax.Array]:
  """[members] metrics -> the mean of each over the members still training (what the log line and the NaN check
  read: NaN once every member has diverged) and one series per member."""
  out = {name: jnp.nanmean(v) for name, v in metrics.items()}
  out["tokens"] = jnp.sum(metrics["tokens"]) if config.ensemble_data == "distinct" else metrics["tokens"][0]
  for name in PER_MEMBER:
    out.update({f"{name}/member_{i}": metrics[name][i] for i in range(config.ensemble_size)})
  return out


def ensemble_train_step(params: Any, rest: TrainState, batch: Batch, *, config: Config) -> tuple[TrainState, dict]:
  member_batch, batch_axis = _member_batches(batch, config)

  def one(p: Any, opt_state: Any, member: dict, b: Batch) -> tuple:
    new, metrics = train_step(rest.replace(params=p, opt_state=opt_state), b, config=config, member=member)
    return new.params, new.opt_state, metrics

  mapped = jax.vmap(one, in_axes=(0, 0, 0, batch_axis), spmd_axis_name=AXIS)
  new_params, new_opt, metrics = mapped(params, rest.opt_state, members(config), member_batch)
  # A member whose loss or gradients went non-finite (a sweep's too-high rate) keeps its last weights and optimizer
  # state, so the others train on and every checkpoint stays finite; its loss series shows NaN from there on. Decided
  # before the update is needed, so the select fuses into it: no second copy of the state (checking the updated
  # weights too cost 2.35 GiB more per chip in the v5e-8 compile the README quotes).
  finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])

  def keep(new: jax.Array, old: jax.Array) -> jax.Array:
    return jnp.where(finite.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)

  new_params = jax.tree.map(keep, new_params, params)
  new_opt = jax.tree.map(keep, new_opt, rest.opt_state)
  metrics = {**metrics, "loss": jnp.where(finite, metrics["loss"], jnp.nan)}
  updated = rest.replace(step=rest.step + 1, params=new_params, opt_state=new_opt)
  return updated, _with_member_series(metrics, config)


def eval_sums(params: Any, batch: Batch, *, apply_fn: Any, config: Config) -> dict[str, jax.Array]:
  """Each member's cross-entropy sum over the batch's real tokens, and the ensemble's: that of the members' averaged
  probabilities, log(mean_i p_i) = logsumexp_i(log p_i) - log K."""

  def target_log_probs(p: Any) -> jax.Array:
    logits, _ = loss.forward(p, apply_fn, batch, jax.random.key(0))
    return loss.target_log_probs(logits, batch["targets"])[0]

  log_p = jax.vmap(target_log_probs, spmd_axis_name=AXIS)(params)  # [members, batch, length]
  mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  averaged = jax.nn.logsumexp(log_p, axis=0) - jnp.log(float(config.ensemble_size))
  return {
    "member_xent_sums": -jnp.sum(log_p * mask, axis=(1, 2)),
    "ensemble_xent_sum": -jnp.sum(averaged * mask),
    "tokens": jnp.sum(mask),
  }


def eval_metrics(totals: dict[str, Any]) -> dict[str, float]:
  tokens = max(float(totals["tokens"]), 1.0)
  per_member = [float(x) / tokens for x in totals["member_xent_sums"]]
  out = {
    "eval_loss": sum(per_member) / len(per_member),  # the members' mean, as the training loss is
    "eval_ensemble_loss": float(totals["ensemble_xent_sum"]) / tokens,
  }
  out.update({f"eval_loss/member_{i}": v for i, v in enumerate(per_member)})
  return out


def jit_eval_step(config: Config, apply_fn: Any, param_shardings: Any, batch_sharding: Any, replicated: Any) -> Any:
  return jax.jit(
    functools.partial(eval_sums, apply_fn=apply_fn, config=config),
    in_shardings=(param_shardings, batch_sharding),
    out_shardings=replicated,
  )


def best_member(config: Config, rows: list[dict[str, Any]]) -> str:
  """ ", best member i (eval loss x, learning rate y)": by the last eval, else by the last step's training loss."""
  k = config.ensemble_size
  evals = [row for row in rows if "eval_loss/member_0" in row]
  row, key, what = (evals[-1], "eval_loss", "eval loss") if evals else (rows[-1] if rows else {}, "loss", "loss")
  if f"{key}/member_0" not in row:
    return ""
  losses = [row[f"{key}/member_{i}"] for i in range(k)]
  best = min(range(k), key=lambda i: losses[i] if math.isfinite(losses[i]) else math.inf)
  return f", best member {best} ({what} {losses[best]:.4f}, learning rate {member_learning_rates(config)[best]:g})"

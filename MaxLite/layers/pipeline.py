"""GPipe-style pipeline parallelism over the `stage` mesh axis, written as plain SPMD array code.

The scanned layer parameters [layers, ...] are viewed as [stages, layers_per_stage, ...]; their
`layers` dimension is sharded on `stage`, so each stage's devices hold only their own layers. The
batch is split into microbatches. At every tick all stages run at once (a vmap over the stage
dimension, partitioned on the `stage` axis), then each stage's output moves to the next stage (a
shift along the stage-sharded dimension, which XLA lowers to a collective permute). After
microbatches + stages - 1 ticks every microbatch has passed through every layer. Ticks in which a
stage has no microbatch yet (or any more) compute on padding and are discarded: the GPipe bubble.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxLite.parallel.sharding import EMBED_ACTIVATION

STATE_ACTIVATION = ("activation_stage", *EMBED_ACTIVATION)
STATE_IDS = ("activation_stage", "activation_batch", "activation_length")

# layer_fn(params of one layer, x, positions, segment_ids, layer depth, rng) -> (x, aux or None)
LayerFn = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


def to_microbatches(a: jax.Array, n: int) -> jax.Array:
  """[batch, ...] -> [n, batch // n, ...] keeping each device's rows on that device (row r -> r % n)."""
  return jnp.swapaxes(a.reshape(a.shape[0] // n, n, *a.shape[1:]), 0, 1)


def from_microbatches(a: jax.Array) -> jax.Array:
  """Inverse of to_microbatches."""
  swapped = jnp.swapaxes(a, 0, 1)
  return swapped.reshape(swapped.shape[0] * swapped.shape[1], *swapped.shape[2:])


def _shift_in(first: jax.Array, previous: jax.Array) -> jax.Array:
  """Stage 0 takes `first`; stage i takes what stage i-1 produced last tick."""
  return jnp.concatenate([first[None], previous[:-1]], axis=0)


def run_pipeline(
  layer_fn: LayerFn,
  params: Any,
  x: jax.Array,
  positions: jax.Array,
  segment_ids: jax.Array,
  rng: jax.Array,
  *,
  stages: int,
  microbatches: int,
) -> tuple[jax.Array, Any]:
  """Apply all scanned layers to x [batch, seq, embed] -> (x, per-layer aux [layers, ...] summed over
  microbatches, or None)."""
  num_layers = jax.tree.leaves(params)[0].shape[0]
  per_stage = num_layers // stages
  staged = jax.tree.map(lambda p: p.reshape(stages, per_stage, *p.shape[1:]), params)
  micro_x = to_microbatches(x, microbatches)
  micro_seg = to_microbatches(segment_ids, microbatches)
  micro_pos = to_microbatches(positions, microbatches)

  def stage_fn(stage_params, h, pos, seg, stage, micro):
    def one_layer(carry, layer):
      p, j = layer
      layer_rng = jax.random.fold_in(jax.random.fold_in(rng, stage * per_stage + j), micro)
      return layer_fn(p, carry, pos, seg, stage * per_stage + j, layer_rng)

    return jax.lax.scan(one_layer, h, (stage_params, jnp.arange(per_stage)))

  run_stages = jax.vmap(stage_fn, spmd_axis_name="stage")
  stage_index = jnp.arange(stages)

  def tick(carry, t):
    h, seg, pos, outputs, aux_total = carry
    feed = jnp.minimum(t, microbatches - 1)
    live = t < microbatches  # after the last microbatch, stage 0 runs on padding (segment id 0)
    h = _shift_in(micro_x[feed], h)
    seg = _shift_in(jnp.where(live, micro_seg[feed], 0), seg)
    pos = _shift_in(micro_pos[feed], pos)
    h = nn.with_logical_constraint(h, STATE_ACTIVATION)
    seg = nn.with_logical_constraint(seg, STATE_IDS)
    micro = t - stage_index  # the microbatch each stage is working on at this tick
    h, aux = run_stages(staged, h, pos, seg, stage_index, micro)
    h = nn.with_logical_constraint(h, STATE_ACTIVATION)
    done = t - (stages - 1)  # the last stage just finished this microbatch
    outputs = jnp.where(done >= 0, outputs.at[jnp.maximum(done, 0)].set(h[-1]), outputs)
    if aux is not None:
      valid = ((micro >= 0) & (micro < microbatches)).astype(jnp.float32)
      expand = lambda a: valid.reshape(stages, *(1,) * (a.ndim - 1))
      aux_total = jax.tree.map(lambda acc, a: acc + a * expand(a), aux_total, aux)
    return (h, seg, pos, outputs, aux_total), None

  state_shape = (stages, *micro_x.shape[1:])
  aux_shape = jax.eval_shape(
    lambda: run_stages(
      staged,
      jnp.zeros(state_shape, x.dtype),
      jnp.zeros(state_shape[:3], positions.dtype),
      jnp.zeros(state_shape[:3], segment_ids.dtype),
      stage_index,
      stage_index,
    )[1]
  )
  aux0 = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), aux_shape)  # [stages, per_stage, ...]
  carry = (
    jnp.zeros(state_shape, x.dtype),
    jnp.zeros(state_shape[:3], segment_ids.dtype),
    jnp.zeros(state_shape[:3], positions.dtype),
    jnp.zeros_like(micro_x),
    aux0,
  )
  (_, _, _, outputs, aux_total), _ = jax.lax.scan(tick, carry, jnp.arange(microbatches + stages - 1))
  per_layer = jax.tree.map(lambda a: a.reshape(num_layers, *a.shape[2:]), aux_total)
  return from_microbatches(outputs), per_layer

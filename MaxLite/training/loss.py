"""Cross-entropy and z-loss summed over real tokens: from whole logits, or vocabulary-tiled.

Vocabulary tiling (num_vocab_tiling = n > 1) makes the logits for 1/n of the tokens at a time, each chunk under
jax.checkpoint inside a scan, so neither the forward nor the backward pass ever holds the whole [tokens, vocab]
float32 logits (with Llama 3's 128k vocabulary they are the largest buffer in the step). Chunk i takes every n-th
token starting at i, so every batch and sequence shard contributes equally to every chunk and no chunk needs
data from another device.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

LOGITS_AXES = ("activation_batch", "activation_length", "activation_vocab")


def target_log_probs(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(log-probability of each target, log Z), in float32."""
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - log_z, log_z


def loss_sums(
  logits: jax.Array, targets: jax.Array, mask: jax.Array, z_loss_multiplier: float
) -> tuple[jax.Array, jax.Array]:
  """(summed cross-entropy, summed z-loss) over the tokens where mask is 1; one log-sum-exp serves both."""
  log_p, log_z = target_log_probs(logits, targets)
  return jnp.sum(-log_p * mask), jnp.sum(z_loss_multiplier * jnp.square(log_z) * mask)


def tiled_loss_sums(
  hidden: jax.Array,
  head: jax.Array,
  targets: jax.Array,
  mask: jax.Array,
  z_loss_multiplier: float,
  num_tiles: int,
  logits_dtype: Any = jnp.float32,
) -> tuple[jax.Array, jax.Array]:
  """loss_sums(hidden @ head, ...) without the whole logits: hidden [b, s, e], head [e, vocab] in the weight dtype
  (cast to hidden's dtype chunk by chunk, so its gradient adds up over the chunks in the weight dtype); logits_dtype as
  the head's matmul returns them (None: hidden's dtype; the loss itself is float32 either way)."""
  b, s = targets.shape

  def strided_chunks(x: jax.Array) -> jax.Array:  # [b, s, ...] -> [n, b, s/n, ...], chunk i = tokens i, i+n, ...
    return jnp.moveaxis(x.reshape(b, s // num_tiles, num_tiles, *x.shape[2:]), 2, 0)

  @jax.checkpoint  # the backward pass makes each chunk's logits again instead of keeping them
  def chunk_sums(h: jax.Array, t: jax.Array, m: jax.Array) -> tuple[jax.Array, jax.Array]:
    logits = nn.with_logical_constraint(
      jnp.einsum("bse,ev->bsv", h, head.astype(h.dtype), preferred_element_type=logits_dtype), LOGITS_AXES
    )
    return loss_sums(logits, t, m, z_loss_multiplier)

  def step(carry, chunk):
    xent, z = chunk_sums(*chunk)
    return (carry[0] + xent, carry[1] + z), None

  zero = jnp.zeros((), jnp.float32)
  (xent, z), _ = jax.lax.scan(step, (zero, zero), tuple(map(strided_chunks, (hidden, targets, mask))))
  return xent, z

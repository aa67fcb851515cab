"""Cross-entropy and z-loss summed over real tokens: from whole logits, token-tiled, or a vocabulary slice at a time.

Vocabulary tiling (num_vocab_tiling = n > 1) makes the logits for 1/n of the tokens at a time, each chunk under
jax.checkpoint inside a scan, so neither the forward nor the backward pass ever holds the whole [tokens, vocab]
float32 logits (with Llama 3's 128k vocabulary they are the largest buffer in the step). Chunk i takes every n-th
token starting at i, so every batch and sequence shard contributes equally to every chunk and no chunk needs
data from another device.

Vocabulary slices (num_vocab_slices = n > 1) split the other way: the output head's matmul, the loss and their
gradients run on 1/n of the vocabulary at a time, with an online log-sum-exp in the forward pass and the slice's
logits made again in the backward pass. On a pod the head's weights and their gradient are whole (all-gathered,
then reduce-scattered) while a slice is worked on, so slicing the vocabulary shrinks the gathered weights, the
logits, their gradient and the head's unreduced weight gradient together; tiling the tokens shrinks only the logits.
Slice i holds the vocabulary ids i, i+n, ..., so a vocabulary dimension split over `tensor` stays split.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxLite.parallel.sharding import EMBED_ACTIVATION

LOGITS_AXES = ("activation_batch", "activation_length", "activation_vocab")


def forward(params: Any, apply_fn: Any, batch: dict[str, jax.Array], rng: jax.Array, return_hidden: bool = False):
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


def vocab_sliced_loss_sums(
  hidden: jax.Array,
  head: jax.Array,
  targets: jax.Array,
  mask: jax.Array,
  z_loss_multiplier: float,
  num_slices: int,
  logits_dtype: Any = jnp.float32,
) -> tuple[jax.Array, jax.Array]:
  """loss_sums(hidden @ head, ...) made 1/num_slices of the vocabulary at a time, forward and backward: hidden
  [b, s, e] in the activation dtype, head [e, vocab] in the weight dtype (its gradient comes back in that dtype);
  logits_dtype as the head's matmul returns them (None: hidden's dtype; the loss itself is float32 either way)."""
  return _sliced(hidden, head, targets, mask, z_loss_multiplier, num_slices, logits_dtype)


def _vocab_slices(head: jax.Array, n: int) -> jax.Array:
  """[e, V] -> [n, e, V/n]; slice i holds the ids i, i+n, ... (the split V stays the split dimension)."""
  e, v = head.shape
  return jnp.moveaxis(head.reshape(e, v // n, n), 2, 0)


def _slice_logits(h: jax.Array, w: jax.Array, logits_dtype: Any) -> jax.Array:
  logits = jnp.einsum("bse,ev->bsv", h, w.astype(h.dtype), preferred_element_type=logits_dtype)
  return nn.with_logical_constraint(logits, LOGITS_AXES).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _sliced(h, head, targets, mask, z, n, logits_dtype):
  return _sliced_fwd(h, head, targets, mask, z, n, logits_dtype)[0]


def _sliced_fwd(h, head, targets, mask, z, n, logits_dtype):
  in_slice, column = targets % n, targets // n

  def add_slice(carry, slice_and_weights):
    top, total, target_logit = carry
    i, w = slice_and_weights
    logits = _slice_logits(h, w, logits_dtype)
    new_top = jnp.maximum(top, jnp.max(logits, axis=-1))
    total = total * jnp.exp(top - new_top) + jnp.sum(jnp.exp(logits - new_top[..., None]), axis=-1)
    picked = jnp.take_along_axis(logits, column[..., None], axis=-1)[..., 0]
    return (new_top, total, jnp.where(in_slice == i, picked, target_logit)), None

  zeros = jnp.zeros(targets.shape, jnp.float32)
  start = (jnp.full(targets.shape, -jnp.inf, jnp.float32), zeros, zeros)
  (top, total, target_logit), _ = jax.lax.scan(add_slice, start, (jnp.arange(n), _vocab_slices(head, n)))
  log_z = top + jnp.log(total)
  sums = (jnp.sum((log_z - target_logit) * mask), jnp.sum(z * jnp.square(log_z) * mask))
  return sums, (h, head, targets, mask, log_z)


def _sliced_bwd(z, n, logits_dtype, residuals, cotangents):
  h, head, targets, mask, log_z = residuals
  g_xent, g_z = cotangents
  # d(sums)/d(logit v) = softmax_v * mask * (g_xent + 2 z g_z log Z) - [v = target] * mask * g_xent
  softmax_weight = (mask * (g_xent + 2.0 * z * g_z * log_z))[..., None]
  target_weight = (mask * g_xent)[..., None]
  in_slice, column = targets % n, targets // n

  def slice_grads(dh, slice_and_weights):
    i, w = slice_and_weights
    logits = _slice_logits(h, w, logits_dtype)
    is_target = (jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == column[..., None]) & (in_slice == i)[..., None]
    d = jnp.exp(logits - log_z[..., None]) * softmax_weight - jnp.where(is_target, target_weight, 0.0)
    d = nn.with_logical_constraint(d.astype(h.dtype), LOGITS_AXES)
    # Each slice's weight gradient is reduced to its shards before the next slice starts: the whole unreduced
    # [embed, vocab] gradient never exists. The hidden gradient adds up in float32 on its own shards.
    dw = jnp.einsum("bse,bsv->ev", h, d, preferred_element_type=jnp.float32)
    dw = nn.with_logical_constraint(dw.astype(head.dtype), ("embed", "vocab"))
    dh_slice = nn.with_logical_constraint(jnp.einsum("bsv,ev->bse", d, w.astype(h.dtype)), EMBED_ACTIVATION)
    return dh + dh_slice.astype(jnp.float32), dw

  dh = nn.with_logical_constraint(jnp.zeros(h.shape, jnp.float32), EMBED_ACTIVATION)
  dh, dw_slices = jax.lax.scan(slice_grads, dh, (jnp.arange(n), _vocab_slices(head, n)))
  e, v = head.shape
  return dh.astype(h.dtype), jnp.moveaxis(dw_slices, 0, 2).reshape(e, v), None, None


_sliced.defvjp(_sliced_fwd, _sliced_bwd)

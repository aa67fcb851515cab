"""Cross-entropy and z-loss summed over real tokens: from whole logits, or vocabulary-tiled.

Vocabulary tiling (num_vocab_tiling = n > 1) makes the logits for 1/n of the tokens at a time inside a scan, so
no pass ever holds the whole [tokens, vocab] float32 logits (with Llama 3's 128k vocabulary they are the largest
buffer in the step). Under differentiation each chunk's gradients are made in the same pass, while its logits
are still at hand (a fused linear cross-entropy): no second head matmul. Chunk i takes every n-th
token starting at i, so every batch and sequence shard contributes equally to every chunk and no chunk needs
data from another device.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

LOGITS_AXES = ("activation_batch", "activation_length", "activation_vocab")


def _token_terms(logits: jax.Array, targets: jax.Array, z_loss_multiplier: float) -> tuple[jax.Array, jax.Array]:
  """Per-token cross-entropy and z-loss; one log-sum-exp over the vocabulary serves both."""
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return log_z - target_logit, z_loss_multiplier * jnp.square(log_z)


def loss_sums(
  logits: jax.Array, targets: jax.Array, mask: jax.Array, z_loss_multiplier: float
) -> tuple[jax.Array, jax.Array]:
  """(summed cross-entropy, summed z-loss) over the tokens where mask is 1."""
  xent, z_loss = _token_terms(logits, targets, z_loss_multiplier)
  return jnp.sum(xent * mask), jnp.sum(z_loss * mask)


def _strided_chunks(x: jax.Array, n: int) -> jax.Array:
  """[b, s, ...] -> [n, b, s/n, ...]: chunk i holds tokens i, i+n, i+2n, ... of every row."""
  b, s = x.shape[:2]
  return jnp.moveaxis(x.reshape(b, s // n, n, *x.shape[2:]), 2, 0)


def _unchunk(x: jax.Array) -> jax.Array:
  n, b, c = x.shape[:3]
  return jnp.moveaxis(x, 0, 2).reshape(b, c * n, *x.shape[3:])


def _chunk_terms(h, t, m, head, z_loss_multiplier):
  logits = nn.with_logical_constraint(jnp.einsum("bse,ev->bsv", h, head), LOGITS_AXES).astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
  return logits, log_z, jnp.sum((log_z - target_logit) * m), jnp.sum(z_loss_multiplier * jnp.square(log_z) * m)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def tiled_loss_sums(
  hidden: jax.Array,
  head: jax.Array,
  targets: jax.Array,
  mask: jax.Array,
  z_loss_multiplier: float,
  num_tiles: int,
) -> tuple[jax.Array, jax.Array]:
  """loss_sums(hidden @ head, ...) without the whole logits: hidden [b, s, e], head [e, vocab]."""

  def step(carry, chunk):
    _, _, xent, z = _chunk_terms(*chunk, head, z_loss_multiplier)
    return (carry[0] + xent, carry[1] + z), None

  zero = jnp.zeros((), jnp.float32)
  chunks = tuple(_strided_chunks(x, num_tiles) for x in (hidden, targets, mask))
  return jax.lax.scan(step, (zero, zero), chunks)[0]


def _tiled_fwd(hidden, head, targets, mask, z_loss_multiplier, num_tiles):
  """The sums and, chunk by chunk while its logits are at hand, their gradients with respect to hidden and
  head: the loss is a sum over tokens, so those gradients need nothing from the layers above but a scalar."""
  with_z = z_loss_multiplier != 0.0

  def step(carry, chunk):
    xent_sum, z_sum, d_head = carry
    h, t, m = chunk
    logits, log_z, xent, z = _chunk_terms(h, t, m, head, z_loss_multiplier)
    probs = jnp.exp(logits - log_z[..., None])
    is_target = jnp.arange(logits.shape[-1]) == t[..., None]
    d_logits = [jnp.where(is_target, probs - 1.0, probs) * m[..., None]]  # d xent_sum / d logits
    if with_z:
      d_logits.append(probs * (2.0 * z_loss_multiplier * log_z * m)[..., None])  # d z_sum / d logits
    d_h, d_w = [], []
    for d in d_logits:
      d = nn.with_logical_constraint(d.astype(head.dtype), LOGITS_AXES)
      d_h.append(jnp.einsum("bsv,ev->bse", d, head))
      d_w.append(jnp.einsum("bse,bsv->ev", h, d, preferred_element_type=jnp.float32))
    d_head = tuple(acc + w for acc, w in zip(d_head, d_w))
    return (xent_sum + xent, z_sum + z, d_head), tuple(d_h)

  zero = jnp.zeros((), jnp.float32)
  d_head0 = tuple(jnp.zeros(head.shape, jnp.float32) for _ in range(2 if with_z else 1))
  chunks = tuple(_strided_chunks(x, num_tiles) for x in (hidden, targets, mask))
  (xent_sum, z_sum, d_head), d_hidden = jax.lax.scan(step, (zero, zero, d_head0), chunks)
  d_hidden = tuple(_unchunk(d) for d in d_hidden)
  head_dtype = jnp.zeros((0,), head.dtype)  # residuals must be arrays: this one carries the head's dtype
  return (xent_sum, z_sum), (d_hidden, d_head, head_dtype)


def _tiled_bwd(z_loss_multiplier, num_tiles, residuals, cotangents):
  (d_hidden, d_head, head_dtype), (g_xent, g_z) = residuals, cotangents
  weights = (g_xent, g_z)[: len(d_hidden)]
  hidden_grad = sum(g * d.astype(jnp.float32) for g, d in zip(weights, d_hidden))
  head_grad = sum(g * d for g, d in zip(weights, d_head))
  return hidden_grad.astype(d_hidden[0].dtype), head_grad.astype(head_dtype.dtype), None, None


tiled_loss_sums.defvjp(_tiled_fwd, _tiled_bwd)

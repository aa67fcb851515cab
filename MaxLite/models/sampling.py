"""Sampling many completions at once inside one compiled program: GRPO's rollouts, on the training mesh.

`rollout` prefills every prompt into the KV cache, then samples one token per row per iteration of a while loop that
stops when every row has ended (its end-of-sequence token) or max_decode_steps are sampled. No host round trip per
token: the whole batch of completions is one call. Sampling applies the temperature, then top-k, then top-p (the
order transformers' and vLLM's samplers use), each off at its neutral value (top_k <= 0, top_p >= 1).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp


def top_k_logits(logits: jax.Array, k: int, keep: jax.Array | None = None) -> jax.Array:
  """logits [..., vocab] with all but each row's k largest at -inf; a k past the vocabulary keeps every token.
  `keep` [..., vocab] (bool): tokens kept whatever their rank."""
  kth = jax.lax.top_k(logits, min(k, logits.shape[-1]))[0][..., -1:]
  cut = logits < kth if keep is None else (logits < kth) & ~keep
  return jnp.where(cut, -jnp.inf, logits)


def top_p_logits(logits: jax.Array, p: float, keep: jax.Array | None = None) -> jax.Array:
  """logits [..., vocab] with only the smallest set of most likely tokens whose probability reaches p kept (and
  `keep`'s tokens, as top_k_logits)."""
  sorted_logits = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
  cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
  # The cutoff is the first sorted logit at which the mass reaches p: it and every larger logit stay.
  cutoff_index = jnp.minimum(jnp.sum(cumulative < p, axis=-1, keepdims=True), logits.shape[-1] - 1)
  cutoff = jnp.take_along_axis(sorted_logits, cutoff_index, axis=-1)
  cut = logits < cutoff if keep is None else (logits < cutoff) & ~keep
  return jnp.where(cut, -jnp.inf, logits)


def sampling_logits(
  logits: jax.Array, temperature: float, top_k: int, top_p: float, keep: jax.Array | None = None
) -> jax.Array:
  """The logits a token is drawn from (module docstring), in float32, [..., vocab]. `keep` [..., vocab] (bool): tokens
  never cut by top-k/top-p (GRPO scores a sampled token so, objectives/grpo.py)."""
  logits = logits.astype(jnp.float32) / temperature
  if top_k > 0:
    logits = top_k_logits(logits, top_k, keep)
  if top_p < 1.0:
    logits = top_p_logits(logits, top_p, keep)
  return logits


def prefill(params: Any, ids: jax.Array, lengths: jax.Array, *, model: Any) -> tuple[jax.Array, Any]:
  """(each row's last-prompt-token logits [rows, vocab], the KV cache) of right-padded prompts [rows, width] of
  `lengths` tokens, through a decode=True model."""
  positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
  segments = (positions < lengths[:, None]).astype(jnp.int32)
  logits, variables = model.apply({"params": params}, ids, positions, segments, mutable=["cache"])
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
  return last, variables["cache"]


def decode_step(
  params: Any, cache: Any, tokens: jax.Array, positions: jax.Array, *, model: Any
) -> tuple[jax.Array, Any]:
  """(logits [rows, vocab] after one more token per row at its position, the updated cache)."""
  logits, variables = model.apply(
    {"params": params, "cache": cache},
    tokens[:, None],
    positions[:, None],
    jnp.ones_like(tokens)[:, None],
    mutable=["cache"],
  )
  return logits[:, 0], variables["cache"]


def _rollout(
  params: Any,
  prompts: jax.Array,
  lengths: jax.Array,
  rng: jax.Array,
  *,
  model: Any,
  steps: int,
  eos_id: int,
  temperature: float,
  top_k: int,
  top_p: float,
  greedy: bool,
) -> jax.Array:
  rows = prompts.shape[0]
  last, cache = prefill(params, prompts, lengths, model=model)

  def draw(i: jax.Array, logits: jax.Array) -> jax.Array:
    if greedy:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    picked = sampling_logits(logits, temperature, top_k, top_p)
    return jax.random.categorical(jax.random.fold_in(rng, i), picked, axis=-1).astype(jnp.int32)

  def running(carry: tuple) -> jax.Array:
    i, _, _, _, done = carry
    return (i < steps) & ~jnp.all(done)

  def next_token(carry: tuple) -> tuple:
    i, tokens, logits, cache, done = carry
    token = jnp.where(done, 0, draw(i, logits))  # rows that ended get padding, which the loss never reads
    tokens = tokens.at[:, i].set(token)
    done = done | (token == eos_id)
    logits, cache = decode_step(params, cache, token, lengths + i, model=model)
    return i + 1, tokens, logits, cache, done

  tokens = jnp.zeros((rows, steps), jnp.int32)
  start = (jnp.int32(0), tokens, last, cache, jnp.zeros(rows, bool))
  return jax.lax.while_loop(running, next_token, start)[1]


def make_rollout(
  model: Any, *, steps: int, eos_id: int, temperature: float, top_k: int, top_p: float, greedy: bool = False, **jit
) -> Any:
  """rollout(params, prompts [rows, width] right-padded, lengths [rows], rng) -> completions [rows, steps]: each
  row's sampled tokens, its end-of-sequence token included, then zeros. `model` is a decode=True model whose cache
  holds width + steps positions; `jit` are jax.jit's keyword arguments (shardings). eos_id < 0: never stops early."""
  body = functools.partial(
    _rollout,
    model=model,
    steps=steps,
    eos_id=eos_id,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    greedy=greedy,
  )
  return jax.jit(body, **jit)

"""Context parallelism's load balancing: the order tokens take along a sequence split over devices.

With a causal mask, the shard holding the last part of a sequence attends to every earlier key while the first shard
attends to its own few, so a kernel that skips masked blocks (splash) leaves all shards waiting for the last. Reordered
along the sequence, each shard holds an early and a late part and the work evens out (MaxText's
`context_parallel_load_balance`):
- dual_chunk_swap: the sequence cut into 2N chunks; shard i holds chunks i and 2N-1-i;
- striped: token t goes to shard t mod N.

The model reorders its token ids, positions and segment ids on the way in and puts the final hidden states back in
order on the way out (models/transformer.py), so the loss, metrics, eval and decode see the original order, and
checkpoints do not depend on it. Attention masks by each token's original index (`order`), not its place in the
reordered row. Pure numpy/jax functions; the strategy is the config's derived `context_parallel_reorder`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  import jax

REORDERS = ("dual_chunk_swap", "striped")


@functools.lru_cache(maxsize=64)
def token_order(seq: int, shards: int, strategy: str) -> np.ndarray:
  """[seq] int32: the original index of the token at each place of the reordered sequence (shard i holds places
  i*seq/shards .. (i+1)*seq/shards - 1)."""
  if strategy == "dual_chunk_swap":
    if seq % (2 * shards):
      raise ValueError(f"a sequence of {seq} tokens does not split into 2 x {shards} chunks")
    chunks = np.arange(seq, dtype=np.int32).reshape(2 * shards, seq // (2 * shards))
    pairs = [np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)]
    order = np.concatenate(pairs)
  elif strategy == "striped":
    if seq % shards:
      raise ValueError(f"a sequence of {seq} tokens does not split into {shards} stripes")
    order = np.arange(seq, dtype=np.int32).reshape(seq // shards, shards).T.reshape(-1)
  else:
    raise ValueError(f"unknown reorder strategy {strategy!r}: {', '.join(REORDERS)}")
  order.setflags(write=False)
  return order


def order_of(config, seq: int) -> np.ndarray | None:
  """The token order a model in `config` runs a sequence of `seq` tokens in, or None (not reordered: no context
  parallelism, load balancing off, or a length the reorder does not split, as decoding's single tokens)."""
  strategy, shards = config.context_parallel_reorder, config.sequence_shards
  if not strategy or shards <= 1:
    return None
  if seq % (2 * shards if strategy == "dual_chunk_swap" else shards):
    return None
  return token_order(seq, shards, strategy)


def reorder(x: jax.Array, order: np.ndarray, axis: int = 1) -> jax.Array:
  """x with its `axis` in the reordered layout."""
  import jax.numpy as jnp  # the planner reads token_order without jax

  return jnp.take(x, jnp.asarray(order), axis=axis)


def restore(x: jax.Array, order: np.ndarray, axis: int = 1) -> jax.Array:
  """x (reordered along `axis`) back in the original order."""
  import jax.numpy as jnp

  return jnp.take(x, jnp.asarray(np.argsort(order).astype(np.int32)), axis=axis)

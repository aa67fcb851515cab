"""Splash attention's block sizes: the config keys, their caps, and whether they tile a sequence.

Kept free of jax so config validation can refuse an untileable config before any runtime starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LANES = 128  # the kernel's blocks are whole multiples of the TPU vector lane width
Q_BLOCK_KEYS = ("sa_block_q", "sa_block_q_dkv", "sa_block_q_dq")
KV_BLOCK_KEYS = ("sa_block_kv", "sa_block_kv_compute", "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_kv_dq")


def capped_blocks(config: Mapping[str, Any], q_len: int, kv_len: int) -> dict[str, int]:
  """Each configured block capped at the length it tiles (MaxText does the same): q blocks at the query
  length per sequence shard, kv blocks at the whole sequence."""
  blocks = {k: min(config[k], q_len) for k in Q_BLOCK_KEYS}
  blocks.update({k: min(config[k], kv_len) for k in KV_BLOCK_KEYS})
  return blocks


def tiling_problem(config: Mapping[str, Any], sequence_shards: int) -> str | None:
  """Why the kernel cannot tile this config, as one sentence naming the keys, or None when it can."""
  seq = config["max_target_length"]
  q_len = seq // sequence_shards
  if q_len % LANES:
    return (
      f"attention=splash needs max_target_length / sequence parallelism to be a multiple of {LANES}, got "
      f"{seq} / {sequence_shards} = {q_len}; use a longer max_target_length or attention=dot_product"
    )
  blocks = capped_blocks(config, q_len, seq)
  unused = ("sa_block_q_dq", "sa_block_kv_dq") if config["sa_use_fused_bwd_kernel"] else ()
  for key, block in blocks.items():
    if key in unused:
      continue
    length, what = (q_len, "query length per shard") if key in Q_BLOCK_KEYS else (seq, "sequence")
    if config[key] <= 0 or block % LANES or length % block:
      return (
        f"{key}={config[key]} cannot tile the {what} {length}: a splash block must be a positive multiple of "
        f"{LANES} that divides it"
      )
  if (
    blocks["sa_block_kv"] % blocks["sa_block_kv_compute"]
    or blocks["sa_block_kv_dkv"] % blocks["sa_block_kv_dkv_compute"]
  ):
    return "sa_block_kv_compute must divide sa_block_kv and sa_block_kv_dkv_compute must divide sa_block_kv_dkv"
  return None

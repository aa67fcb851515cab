"""Which attention kernel a run uses (config key `attention`), decided and checked at load time.

Each kernel declares once what it computes (`KERNELS`); a config's needs are read from its keys (`needs`), whatever
the family. The kernel that will run, not the raw `attention` value, is checked against them: autoselected falls
back to dot_product and says which capability was missing, an explicit choice that cannot compute the config is one
line naming the capability and the key that asks for it. jax-free, so a config that cannot run is refused before
any runtime starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from MaxLite.cli.errors import ConfigError
from MaxLite.config import families, splash_blocks

_ALIASES = {"flash": "splash", "cudnn_flash_jax": "cudnn"}
_GPU = ("gpu", "cuda")  # jax's names for an NVIDIA backend (cuDNN does not exist on ROCm)

# What a config may ask of attention, as the sentence an error line uses.
PACKED = "packed segments (several documents in one row)"
WINDOW = "a sliding window"
SOFT_CAP = "a soft cap on the scores"
NARROW_VALUES = "values narrower than queries and keys"
FLOAT32 = "float32 activations"
SPLIT_SEQUENCE = "a sequence split over devices"
SINKS = "attention sinks (a learned logit per head in the softmax)"
LOAD_BALANCED = "a load-balanced sequence order (context_parallel_load_balance)"
ULYSSES = "heads exchanged for the sequence over devices (context_parallel_strategy=ulysses)"
RING = "keys and values passed around the sequence shards (context_parallel_strategy=ring)"
# cuDNN's packed layout has a fixed number of segments per row; MaxText's GPU configs use 32.
GPU_SEGMENTS_PER_ROW = 32


@dataclasses.dataclass(frozen=True)
class Kernel:
  name: str
  platforms: tuple[str, ...]  # where it runs (splash also interpreted on CPU, for tests)
  computes: frozenset[str]
  description: str


KERNELS = {
  k.name: k
  for k in (
    Kernel(
      "dot_product",
      ("cpu", "tpu", *_GPU),
      frozenset(
        {PACKED, WINDOW, SOFT_CAP, NARROW_VALUES, FLOAT32, SPLIT_SEQUENCE, SINKS, LOAD_BALANCED, ULYSSES, RING}
      ),
      "XLA, materialises [batch, heads, seq, seq] scores",
    ),
    # Values narrower than queries are zero-padded to the query width; sinks are the kernel's own (layers/splash.py).
    Kernel(
      "splash",
      ("tpu", "cpu"),
      frozenset({PACKED, WINDOW, SOFT_CAP, NARROW_VALUES, FLOAT32, SPLIT_SEQUENCE, SINKS, LOAD_BALANCED, ULYSSES}),
      "the splash kernel",
    ),
    # jax's cuDNN fused attention: bf16 only, whole rows per device, no soft cap, no sinks; packed rows through cuDNN's
    # packed layout (a fixed segment count per row, Hopper or newer), narrow values zero-padded (layers/cudnn.py).
    Kernel("cudnn", _GPU, frozenset({PACKED, WINDOW, NARROW_VALUES}), "cuDNN flash attention"),
  )
}


def needs(c: dict[str, Any], sequence_shards: int) -> dict[str, str]:
  """{capability: the key setting that asks for it} of this config: the shared keys', then what its family's own
  keys ask (Family.attention_needs)."""
  out = {}
  if c["dataset_type"] != "synthetic" and c["max_segments_per_seq"] != 1:
    out[PACKED] = f"dataset_type={c['dataset_type']} packs documents into rows"
  if c["sliding_window_size"] > 0:
    out[WINDOW] = f"sliding_window_size={c['sliding_window_size']}"
  if c["attn_logits_soft_cap"] > 0:
    out[SOFT_CAP] = f"attn_logits_soft_cap={c['attn_logits_soft_cap']}"
  if c["attention_type"] == "mla" and c["v_head_dim"] != c["qk_nope_head_dim"] + c["qk_rope_head_dim"]:
    out[NARROW_VALUES] = f"attention_type=mla with v_head_dim={c['v_head_dim']}"
  if c["dtype"] == "float32":
    out[FLOAT32] = "dtype=float32"
  if sequence_shards > 1:
    out[SPLIT_SEQUENCE] = f"sequence parallelism {sequence_shards}"
    if c["context_parallel_load_balance"]:
      out[LOAD_BALANCED] = "context_parallel_load_balance=true"
    if c["context_parallel_strategy"] in ("ulysses", "ring"):
      out[{"ulysses": ULYSSES, "ring": RING}[c["context_parallel_strategy"]]] = (
        f"context_parallel_strategy={c['context_parallel_strategy']}"
      )
  return {**out, **families.family(c["decoder_block"]).attention_needs(c)}


def _head_split_problem(c: dict[str, Any], head_shards: int) -> str | None:
  for key in ("base_num_query_heads", "base_num_kv_heads"):
    if c[key] % head_shards:  # splash runs per shard of heads (shard_map), so they must split evenly
      return (
        f"{key}={c[key]} does not split over the {head_shards} shards that logical_axis_rules give activation_heads"
      )
  return None


def _problem(kernel: str, c: dict[str, Any], wanted: dict[str, str], shards: tuple[int, int], gpu: str) -> str | None:
  """Why `kernel` cannot run this config (a phrase to follow "because"), or None."""
  missing = [need for need in wanted if need not in KERNELS[kernel].computes]
  if missing:
    return f"it does not compute {missing[0]}, which {wanted[missing[0]]} asks for"
  if kernel == "splash":
    return splash_blocks.tiling_problem(c, shards[0]) or _head_split_problem(c, shards[1])
  if kernel == "cudnn" and PACKED in wanted and gpu and tuple(map(int, gpu.split("."))) < (9, 0):
    return f"it packs segments only on Hopper or newer GPUs (compute capability 9.0); this GPU's is {gpu}"
  return None


def choose_attention(
  c: dict[str, Any], platform: str, sequence_shards: int, head_shards: int = 1, gpu_capability: str = ""
) -> tuple[str, str]:
  """(kernel, why): dot_product, splash or cudnn, what this config runs on `platform` (cpu, tpu, gpu), and a
  sentence a run logs at start; or a ConfigError. sequence_shards / head_shards: how many ways the logical
  rules split activation_length / activation_heads; gpu_capability: the GPU's compute capability ("9.0"), if known.

  autoselected picks splash on TPU and cudnn on a GPU where they compute everything the config asks for, else
  dot_product, and says what stopped the fused kernel (dot_product holds [batch, heads, seq, seq] scores)."""
  name = _ALIASES.get(c["attention"], c["attention"])
  wanted = needs(c, sequence_shards)
  shards = (sequence_shards, head_shards)
  if name == "autoselected":
    fused = "splash" if platform == "tpu" else "cudnn" if platform in _GPU else None
    if fused is None:
      return "dot_product", f"autoselected: dot_product (no fused kernel on {platform})"
    problem = _problem(fused, c, wanted, shards, gpu_capability)
    if problem:
      return "dot_product", f"autoselected: dot_product, not {fused}, because {problem}"
    return fused, f"autoselected: {KERNELS[fused].description} on {platform.upper()}"
  if platform not in KERNELS[name].platforms:
    if name == "splash":
      raise ConfigError(
        f"attention={c['attention']} is a TPU kernel (interpreted on CPU for tests); this run's devices are "
        f"{platform}: use attention=autoselected"
      )
    raise ConfigError(
      f"attention={c['attention']} needs an NVIDIA GPU ({KERNELS[name].description}); this run's devices are "
      f"{platform}: use attention=dot_product or autoselected"
    )
  problem = _problem(name, c, wanted, shards, gpu_capability)
  if problem:
    if problem.startswith("attention"):  # splash's tiling sentences name the key themselves
      raise ConfigError(problem)
    if problem.startswith("it "):
      raise ConfigError(f"attention={c['attention']} {problem[3:]}: use attention=dot_product or autoselected")
    raise ConfigError(f"attention={c['attention']}: {problem}")
  if name == "splash" and platform == "cpu":
    return name, f"attention={c['attention']}: the splash kernel, interpreted on CPU (slow; for tests)"
  return name, f"attention={c['attention']}"


def segments_per_row(c: dict[str, Any], kernel: str) -> tuple[int, int]:
  """(max_segments_per_seq as resolved, attention_segments): the packer's cap on documents per row (-1 = none) and
  the static segment count the attention kernel is built for (0 = any; 1 = one document per row, padded at its end).

  cuDNN's packed layout has a fixed segment count per row, so a cudnn run with no cap gets GPU_SEGMENTS_PER_ROW,
  which the packer then keeps (resolved into the saved config, so a resume elsewhere names the change)."""
  cap = c["max_segments_per_seq"]
  if c["dataset_type"] == "synthetic":  # generated rows are one sequence each
    return cap, 1
  if kernel == "cudnn":
    cap = GPU_SEGMENTS_PER_ROW if cap == -1 else cap
    return cap, cap
  return cap, 0

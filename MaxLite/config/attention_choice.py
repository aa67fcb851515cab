"""Which attention implementation a run uses (config key `attention`), decided and checked at load time.

jax-free, so a config that cannot run its attention is refused before any runtime starts.
"""

from __future__ import annotations

from typing import Any

from MaxLite.cli.errors import ConfigError
from MaxLite.config import splash_blocks

_ALIASES = {"flash": "splash", "cudnn_flash_jax": "cudnn"}
_GPU = ("gpu", "cuda")  # jax's names for an NVIDIA backend (cuDNN does not exist on ROCm)


def _cudnn_problem(c: dict[str, Any], platform: str, sequence_shards: int) -> str | None:
  if platform not in _GPU:
    return f"needs an NVIDIA GPU (cuDNN flash attention); this run's devices are {platform}"
  if c["dtype"] != "bfloat16":
    return f"takes bfloat16 activations only (cuDNN's fused attention); dtype={c['dtype']}"
  if sequence_shards > 1:
    return f"cannot split the sequence (cuDNN attends over whole rows); sequence parallelism is {sequence_shards}"
  return None


def _head_split_problem(c: dict[str, Any], head_shards: int) -> str | None:
  for key in ("base_num_query_heads", "base_num_kv_heads"):
    if c[key] % head_shards:  # splash runs per shard of heads (shard_map), so they must split evenly
      return (
        f"{key}={c[key]} does not split over the {head_shards} shards that logical_axis_rules give activation_heads"
      )
  return None


def choose_attention(c: dict[str, Any], platform: str, sequence_shards: int, head_shards: int = 1) -> tuple[str, str]:
  """(kernel, why): dot_product, splash or cudnn, what this config runs on `platform` (cpu, tpu, gpu), and a
  sentence a run logs at start; or a ConfigError. sequence_shards / head_shards: how many ways the logical
  rules split activation_length / activation_heads.

  autoselected picks splash on TPU and cudnn on a GPU where they can run this config, else dot_product, and
  says what stopped the fused kernel (dot_product holds [batch, heads, seq, seq] scores)."""
  name = _ALIASES.get(c["attention"], c["attention"])
  if name == "autoselected":
    if platform == "tpu":
      problem = splash_blocks.tiling_problem(c, sequence_shards) or _head_split_problem(c, head_shards)
      if not problem:
        return "splash", "autoselected: the splash kernel on TPU"
      return "dot_product", f"autoselected: dot_product, not splash, because {problem}"
    if platform in _GPU:
      problem = _cudnn_problem(c, platform, sequence_shards)
      if not problem:
        return "cudnn", "autoselected: cuDNN flash attention on the GPU"
      return "dot_product", f"autoselected: dot_product, not cudnn, because it {problem}"
    return "dot_product", f"autoselected: dot_product (no fused kernel on {platform})"
  if name == "cudnn":
    problem = _cudnn_problem(c, platform, sequence_shards)
    if problem:
      raise ConfigError(f"attention={c['attention']} {problem}: use attention=dot_product or autoselected")
  if name == "splash":
    if platform not in ("tpu", "cpu"):
      raise ConfigError(
        f"attention={c['attention']} is a TPU kernel (interpreted on CPU for tests); this run's devices are "
        f"{platform}: use attention=autoselected"
      )
    problem = splash_blocks.tiling_problem(c, sequence_shards) or _head_split_problem(c, head_shards)
    if problem:
      raise ConfigError(problem if problem.startswith("attention") else f"attention={c['attention']}: {problem}")
    if platform == "cpu":
      return name, f"attention={c['attention']}: the splash kernel, interpreted on CPU (slow; for tests)"
  return name, f"attention={c['attention']}"

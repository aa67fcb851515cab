"""The registry of decoder families, by MaxText's `decoder_block` values, and what a family registers: its layer,
exact parameter count, FLOPs, config checks and Hugging Face name map.

The registry sits here, below everything that reads it (config validation asks a family for its checks and parameter
count, the transformer for its layer), and the families fill it from above: each module of `MaxLite/models/`
registers one when `MaxLite.models` is imported (the package's `__init__.py` does, as torchtitan's does). So a config
module never imports a model module, and adding a family touches only `models/`, its config file and its tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class HfLayout:
  """How a family maps onto Hugging Face checkpoints (checkpoint/hf.py streams the tensors).

  architectures: the transformers classes it reads. settings(config.json dict, source name) -> MaxLite model keys
  (a config.json asking for something the family does not compute is refused by name). config(config, bos_id,
  eos_id) -> config.json. layer_tensors(config, layer) / global_tensors(config): the weights of one decoder layer and of
  the rest, as hf_layout.Tensor. read(reader, name) -> the tensor `name` as an array, for a family whose checkpoints
  store some tensors in another form (quantized); None = as stored (checkpoint/safetensors_io.py's reader.read)."""

  architectures: tuple[str, ...]
  settings: Callable[[dict[str, Any], str], dict[str, Any]]
  config: Callable[..., dict[str, Any]]
  layer_tensors: Callable[[Any, int], list[Any]]
  global_tensors: Callable[[Any], list[Any]]
  read: Callable[[Any, str], Any] | None = None


def _no_checks(c: Mapping[str, Any]) -> None:
  del c


def _no_needs(c: Mapping[str, Any]) -> dict[str, str]:
  del c
  return {}


@dataclasses.dataclass(frozen=True)
class Stack:
  """`count` consecutive layers made as layer(..., **options), scanned as one under decoder/<name> (or unrolled as
  decoder/<name>_<i>)."""

  name: str
  count: int
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def one_stack(config: Any) -> tuple[Stack, ...]:
  return (Stack("layers", config.base_num_decoder_layers),)


@dataclasses.dataclass(frozen=True)
class Family:
  """One decoder family.

  layer: the flax module of one decoder layer, made as layer(config, deterministic, decode, name=...) and called
  on (x, positions, segment_ids, layer_index) -> (x, MoE routing statistics or None); layer_index is the layer's
  depth (a traced value under nn.scan) for families whose layers differ by depth (Gemma 3's local and global
  attention). parameter_count(config dict) -> the exact count. training_flops(config) -> {weights, attention, total,
  experts}: model FLOPs of one optimizer step (models/flops.py). check(config dict) raises ConfigError for
  settings the family does not compute. scale_embeddings: the embeddings are multiplied by sqrt(base_emb_dim).
  norm_scale_offset: the final norm's weight is stored minus this (layers/norms.py; Gemma: 1). stacks(config): the
  layers as runs of one kind (DeepSeek: its first dense layers, then the MoE ones); one run by default.
  attention_needs(config dict) -> {capability: the key setting that asks for it}: what the family's own keys ask of
  the attention kernel beyond what the shared keys do (config/attention_choice.py's capability sentences), so a
  kernel that does not compute it is not chosen. mlp_activations: the values of mlp_activations it computes."""

  decoder_blocks: tuple[str, ...]
  layer: Any
  parameter_count: Callable[[Mapping[str, Any]], int]
  training_flops: Callable[[Any], dict[str, float]]
  hf: HfLayout
  check: Callable[[Mapping[str, Any]], None] = _no_checks
  scale_embeddings: bool = False
  norm_scale_offset: float = 0.0
  stacks: Callable[[Any], tuple[Stack, ...]] = one_stack
  attention_needs: Callable[[Mapping[str, Any]], dict[str, str]] = _no_needs
  mlp_activations: tuple[tuple[str, ...], ...] = (("silu", "linear"), ("gelu", "linear"))


_FAMILIES: dict[str, Family] = {}
_LOADERS: list[Callable[[], object]] = []


def register_loader(loader: Callable[[], object]) -> None:
  """`loader()` registers families; it runs at the first lookup. The package root passes one that imports
  MaxLite.models, so that importing the package does not bring jax and flax into a process that never looks a family
  up (train.py's first process only re-execs itself under tcmalloc: 0.6 s of every launch went to that import)."""
  _LOADERS.append(loader)


def register(family: Family) -> Family:
  for name in family.decoder_blocks:
    if name in _FAMILIES:
      raise ValueError(f"decoder_block {name!r} is registered twice")
    _FAMILIES[name] = family
  return family


def _registered() -> dict[str, Family]:
  while _LOADERS:
    _LOADERS.pop(0)()
  if not _FAMILIES:
    raise RuntimeError(
      "no decoder family is registered: import MaxLite.models first (each of its modules registers one)"
    )
  return _FAMILIES


def decoder_blocks() -> tuple[str, ...]:
  return tuple(sorted(_registered()))


def family(decoder_block: str) -> Family:
  try:
    return _registered()[decoder_block]
  except KeyError:
    raise KeyError(f"decoder_block={decoder_block!r}; registered: {', '.join(decoder_blocks())}") from None


def family_for_architecture(architecture: str) -> Family | None:
  """The family that reads a Hugging Face architecture, or None."""
  return next((f for f in _registered().values() if architecture in f.hf.architectures), None)


def architectures() -> tuple[str, ...]:
  return tuple(dict.fromkeys(a for f in _registered().values() for a in f.hf.architectures))

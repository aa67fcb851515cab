"""Parameters from a checkpoint step that may be a LoRA run's. Such a step holds only adapters (training/
lora_training.py); the weights it stands for are its base (its own load_parameters_path, itself possibly a LoRA
step) with the adapters merged in. Every reader of load_parameters_path comes here: training (full, or LoRA on top
of an SFT LoRA step), decoding and the Hugging Face export, which so writes the merged full weights."""

from __future__ import annotations

import json
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from MaxLite import storage
from MaxLite.checkpoint import manager
from MaxLite.cli.errors import CheckpointError
from MaxLite.layers import lora
from MaxLite.storage.layout import saved_config_path, step_dir_of


def lora_settings(path: str) -> dict[str, Any] | None:
  """The saved config of the LoRA run that wrote step `path`, or None for any other step."""
  saved = saved_config_path(step_dir_of(path))
  if not storage.isfile(saved):
    return None
  stored = json.loads(storage.read_text(saved))
  return stored if isinstance(stored, dict) and stored.get("enable_lora") else None


def adapters_of(path: str, mesh_of: Any) -> dict:
  """A LoRA step's adapters (every params.* array it holds), replicated over the mesh of `mesh_of`'s sharding."""
  state_dir = manager.resolve_state_dir(path, "load_parameters_path")
  sharding = NamedSharding(mesh_of.sharding.mesh, PartitionSpec()) if hasattr(mesh_of.sharding, "mesh") else None
  tree: dict = {}
  for name, meta in manager.saved_arrays(state_dir).items():
    if not name.startswith("params."):
      continue
    *parents, leaf = name.split(".")[1:]
    node = tree
    for key in parents:
      node = node.setdefault(key, {})
    node[leaf] = jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=sharding or mesh_of.sharding)
  return manager.load_params(path, tree)


def load_params(path: str, target_params: Any) -> Any:
  """The parameters step `path` stands for, placed as `target_params` (a plain model's): merged when it is a LoRA
  step."""
  settings = lora_settings(path)
  if settings is None:
    return manager.load_params(path, target_params)
  base_path = settings.get("load_parameters_path") or settings.get("load_full_state_path")
  if not base_path:
    raise CheckpointError(
      f"{path} is a LoRA step trained on a randomly initialised base (no load_parameters_path): its weights cannot be "
      "rebuilt; train the adapters on a saved base"
    )
  base = load_params(base_path, target_params)
  adapters = adapters_of(path, jax.tree.leaves(target_params)[0])
  scale = float(settings["lora_alpha"]) / int(settings["lora_rank"])
  shardings = jax.tree.map(lambda t: t.sharding, target_params)
  return jax.jit(lambda b, a: lora.merged(b, a, scale), out_shardings=shardings)(base, adapters)

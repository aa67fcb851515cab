"""Parameters from a checkpoint step that may be a LoRA run's or an ensemble's. A LoRA step holds only adapters
(training/lora_training.py); the weights it stands for are its base (its own load_parameters_path, itself possibly a
LoRA step) with the adapters merged in. An ensemble's step holds every member stacked on a leading axis; a reader names
one with ensemble_member. Every reader of load_parameters_path comes here: training (full, or LoRA on top of an SFT
LoRA step), decoding and the Hugging Face export, which so writes the merged full weights."""

from __future__ import annotations

import json
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from MaxLite import storage
from MaxLite.checkpoint import manager
from MaxLite.cli.errors import CheckpointError, ConfigError
from MaxLite.layers import lora
from MaxLite.storage.layout import saved_config_path, step_dir_of


def _saved_settings(path: str) -> dict[str, Any]:
  saved = saved_config_path(step_dir_of(path))
  stored = json.loads(storage.read_text(saved)) if storage.isfile(saved) else {}
  return stored if isinstance(stored, dict) else {}


def lora_settings(path: str) -> dict[str, Any] | None:
  """The saved config of the LoRA run that wrote step `path`, or None for any other step."""
  stored = _saved_settings(path)
  return stored if stored.get("enable_lora") else None


def _member(path: str, target_params: Any, size: int, member: int) -> Any:
  """Member `member` of an ensemble's step, read whole (members stacked) and sliced to `target_params`' placement."""
  if not 0 <= member < size:
    raise ConfigError(
      f"{path} holds an ensemble of {size} members: choose one with ensemble_member=0..{size - 1} (got {member})"
    )

  def stacked(t: Any) -> jax.ShapeDtypeStruct:
    sharding = t.sharding
    if isinstance(sharding, NamedSharding):
      sharding = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    return jax.ShapeDtypeStruct((size, *t.shape), t.dtype, sharding=sharding)

  every = manager.load_params(path, jax.tree.map(stacked, target_params))
  shardings = jax.tree.map(lambda t: t.sharding, target_params)
  return jax.jit(lambda tree: jax.tree.map(lambda a: a[member], tree), out_shardings=shardings)(every)


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


def load_params(path: str, target_params: Any, member: int = -1) -> Any:
  """The parameters step `path` stands for, placed as `target_params` (a plain model's): merged when it is a LoRA
  step, member `member` (ensemble_member) of an ensemble's step."""
  stored = _saved_settings(path)  # read once: on gs:// each read is a request
  size = int(stored.get("ensemble_size", 1))
  if size > 1:
    return _member(path, target_params, size, member)
  settings = stored if stored.get("enable_lora") else None
  if member != -1 and not (settings and int(settings.get("ensemble_member", -1)) == member):
    raise ConfigError(f"ensemble_member={member} but {path} is not an ensemble's step: leave ensemble_member unset")
  if settings is None:
    return manager.load_params(path, target_params)
  base_path = settings.get("load_parameters_path") or settings.get("load_full_state_path")
  if not base_path:
    raise CheckpointError(
      f"{path} is a LoRA step trained on a randomly initialised base (no load_parameters_path): its weights cannot be "
      "rebuilt; train the adapters on a saved base"
    )
  base = load_params(base_path, target_params, int(settings.get("ensemble_member", -1)))  # the member it was trained on
  adapters = adapters_of(path, jax.tree.leaves(target_params)[0])
  scale = float(settings["lora_alpha"]) / int(settings["lora_rank"])
  shardings = jax.tree.map(lambda t: t.sharding, target_params)
  return jax.jit(lambda b, a: lora.merged(b, a, scale), out_shardings=shardings)(base, adapters)

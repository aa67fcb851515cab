"""Parameters from a checkpoint step that may be a LoRA run's or an ensemble's. A LoRA step holds only adapters
(training/lora_training.py); the weights it stands for are its base (its own load_parameters_path, itself possibly a
LoRA step) with the adapters merged in. An ensemble's step holds every member stacked on a leading axis; a reader names
one with ensemble_member. Every reader of load_parameters_path comes here: training (full, or LoRA on top of an SFT
LoRA step), decoding and the Hugging Face export, which so writes the merged full weights."""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec

from MaxLite import storage
from MaxLite.checkpoint import manager
from MaxLite.checkpoint.reads import read
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
  """Member `member` of an ensemble's step, placed as `target_params`. orbax restores whole arrays only (its
  global_shape truncates at the end), and the whole stack would hold `size` members in memory, so each array is read
  through TensorStore at [member, shard]: only the saved chunks that slice overlaps are read (one member's when the
  run split the ensemble axis over devices; a chunk holding several members is read whole but not kept)."""
  if not 0 <= member < size:
    raise ConfigError(
      f"{path} holds an ensemble of {size} members: choose one with ensemble_member=0..{size - 1} (got {member})"
    )
  state_dir = manager.resolve_state_dir(path, "load_parameters_path")
  stacked = jax.tree.map(lambda t: jax.ShapeDtypeStruct((size, *t.shape), t.dtype), target_params)
  manager.check_compatible(state_dir, {"params": stacked})
  return read(state_dir, lambda: _read_member(state_dir, target_params, member))


def _read_member(state_dir: str, target_params: Any, member: int) -> Any:
  directory = epath.Path(state_dir)
  ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(directory)
  zarr3 = bool(ocp.PyTreeCheckpointHandler().metadata(directory).use_zarr3)
  context = ocp.type_handlers.get_ts_context(use_ocdbt=ocdbt)
  leaves, treedef = jax.tree_util.tree_flatten_with_path({"params": target_params})
  pending = []
  for key_path, target in leaves:  # every read is started before any is waited for
    info = ocp.type_handlers.ParamInfo(
      name=manager.path_name(key_path),
      parent_dir=directory,
      is_ocdbt_checkpoint=ocdbt,
      use_zarr3=zarr3,
      ts_context=context,
    )
    spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=ocdbt)
    store = ts.open(spec, open=True, context=context).result()[member]
    shards = target.sharding.addressable_devices_indices_map(target.shape)
    reads: dict = {}
    for index in shards.values():  # a replicated shard is read once
      reads.setdefault(_index_key(index), store[index].read())
    pending.append((target, shards, reads))
  arrays = []
  for target, shards, reads in pending:
    pieces = [
      jax.device_put(np.asarray(reads[_index_key(index)].result(), dtype=target.dtype), device)
      for device, index in shards.items()
    ]
    arrays.append(jax.make_array_from_single_device_arrays(target.shape, target.sharding, pieces))
  return jax.tree_util.tree_unflatten(treedef, arrays)["params"]


def _index_key(index: tuple[slice, ...]) -> tuple:
  return tuple((s.start, s.stop, s.step) for s in index)


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

"""Hugging Face checkpoints <-> MaxLite checkpoints (the logic of convert_hf.py; the name mapping is hf_layout.py).

to_maxlite writes CKPT/0/state (params only, what load_parameters_path reads) and CKPT/0/config/config.json
(the model settings inferred from config.json), so training, decode.py and to_hf need no model
arguments: `load_parameters_path=CKPT/0`. Tensors are read one at a time from the safetensors files
and written into the one output copy; orbax's save then stages serialisation buffers next to it
(measured peak ~1.9x the model on a 1B checkpoint, end_to_end/bench_convert.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from MaxLite import config as config_lib
from MaxLite import models, storage
from MaxLite.checkpoint import STATE, lora_steps, run_tokenizer, saved_config_path
from MaxLite.checkpoint import manager as checkpointing
from MaxLite.checkpoint.safetensors_io import SafetensorsReader, write_checkpoint
from MaxLite.checkpoint.tokenizer_export import write_tokenizer
from MaxLite.cli.errors import InputError
from MaxLite.config import schema
from MaxLite.data.tokenizer import load_tokenizer
from MaxLite.models import build
from MaxLite.models.hf_layout import layer_slot, part_slice
from MaxLite.storage.layout import newest_step

_REQUIRED = object()


def _get(tree: dict, path: str, missing: Any = _REQUIRED) -> Any:
  for key in path.split("/"):
    if key not in tree and missing is not _REQUIRED:
      return missing
    tree = tree[key]
  return tree


def _set(tree: dict, path: str, value: Any) -> None:
  *parents, leaf = path.split("/")
  for key in parents:
    tree = tree.setdefault(key, {})
  tree[leaf] = value


def _load_config(argv: Sequence[str], extra: Sequence[str]) -> Any:
  yml = [a for a in argv if a.endswith((".yml", ".yaml"))] or [config_lib.BASE_CONFIG_PATH]
  overrides = [a for a in argv if "=" in a]
  return config_lib.load_config([yml[0], *extra, *overrides], num_devices=1, num_slices=1, process_count=1)


def to_maxlite(hf_path: str, output_path: str, argv: Sequence[str]) -> str:
  """Returns the step directory to pass as load_parameters_path."""
  config_json = storage.join(hf_path, "config.json")
  if not storage.isfile(config_json):
    raise InputError(f"--hf_path={hf_path}: no config.json there")
  settings = _model_settings(json.loads(storage.read_text(config_json)), config_json)
  family = models.family(settings["decoder_block"])
  reader = SafetensorsReader(hf_path)
  config = _load_config(argv, [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in settings.items()])
  explicit = dict(a.split("=", 1) for a in argv if "=" in a)
  for key, value in settings.items():  # given model keys must agree with the checkpoint
    if key in explicit and schema.coerce(key, explicit[key], "command line") != value:
      raise InputError(f"{key}={explicit[key]} was given but {config_json} has {value}")
  dtype = np.dtype(config.weight_dtype)
  params: dict = {}
  n = config.base_num_decoder_layers
  read = family.hf.read or SafetensorsReader.read
  for t in family.hf.global_tensors(config):
    for path, value in zip(_paths(t), _parts(t, _converted(reader, t.hf_name, t.to_maxlite, read))):
      _set(params, path, value.astype(dtype))
  for i in range(n):
    stack, j = layer_slot(family, config, i)
    for t in family.hf.layer_tensors(config, i):
      for name, value in zip(_paths(t), _read_layer_tensor(reader, t, i, config.num_experts, read)):
        path = f"decoder/{stack.name}/{name}" if config.scan_layers else f"decoder/{stack.name}_{j}/{name}"
        whole = _get(params, path, missing=None)
        if whole is None:  # the stack's first layer (or first part of a fused weight) gives the shape
          shape = value.shape
          if t.part is not None:
            axis, _, count = t.part
            shape = (*shape[:axis], count, *shape[axis:])
          whole = np.empty((stack.count, *shape) if config.scan_layers else shape, dtype)
          _set(params, path, whole)
        layer = whole[j] if config.scan_layers else whole
        layer[part_slice(t.part) if t.part is not None else ...] = value
  _check_against_model(params, config)
  return save_params(params, config, output_path)


def _model_settings(hf: dict[str, Any], source: str) -> dict[str, Any]:
  """config.json -> MaxLite model keys, decoder_block included, by the family that reads its architecture."""
  architecture = (hf.get("architectures") or ["?"])[0]
  family = models.family_for_architecture(architecture)
  if family is None:
    raise InputError(
      f"{source}: architecture {architecture!r} is not supported (supported: {', '.join(models.architectures())})"
    )
  return {"decoder_block": family.decoder_blocks[0], **family.hf.settings(hf, source)}


def _paths(t: Any) -> tuple[str, ...]:
  """The MaxLite weights one Hugging Face tensor holds (hf_layout.Tensor: one path, or several)."""
  return t.path if isinstance(t.path, tuple) else (t.path,)


def _parts(t: Any, converted: Any) -> tuple[np.ndarray, ...]:
  return tuple(converted) if isinstance(t.path, tuple) else (converted,)


def _read_layer_tensor(
  reader: SafetensorsReader, t: Any, layer: int, num_experts: int, read: Any
) -> tuple[np.ndarray, ...]:
  """The tensor's MaxLite weights, one per path."""
  name = f"model.layers.{layer}.{t.hf_name}"
  if "{e}" not in name:
    return _parts(t, _converted(reader, name, t.to_maxlite, read))
  experts = [_parts(t, _converted(reader, name.format(e=e), t.to_maxlite, read)) for e in range(num_experts)]
  return tuple(np.stack(weight) for weight in zip(*experts))


def _converted(reader: SafetensorsReader, name: str, to_maxlite: Any, read: Any) -> Any:
  value = read(reader, name)
  if not np.issubdtype(value.dtype, np.floating) and value.dtype.name != "bfloat16":
    raise InputError(f"tensor {name!r} has dtype {value.dtype}, expected floating point")
  try:
    return to_maxlite(value)
  except ValueError:  # a reshape to the heads / head_dim of config.json
    raise InputError(
      f"tensor {name!r} has shape {value.shape}, which does not fit the model from config.json "
      "(the safetensors do not match config.json)"
    ) from None


def _check_against_model(params: dict, config: Any) -> None:
  """Every converted tensor has the shape the configured model expects (a config.json / weights mismatch)."""
  expected = {
    checkpointing.path_name(p): leaf.shape
    for p, leaf in jax.tree_util.tree_flatten_with_path(build.abstract_parameters(config))[0]
  }
  got = {checkpointing.path_name(p): leaf.shape for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  for name, shape in expected.items():
    if got.get(name) != tuple(shape):
      raise InputError(
        f"converted weight '{name}' has shape {got.get(name)} but the model from config.json "
        f"expects {tuple(shape)} (the safetensors do not match config.json)"
      )


def _to_jax(tree: dict) -> dict:
  """numpy leaves -> jax arrays one at a time, dropping each numpy copy as soon as it is converted."""
  for key in list(tree):
    tree[key] = _to_jax(tree[key]) if isinstance(tree[key], dict) else jax.device_put(tree.pop(key))
  return tree


def save_params(params: dict, config: Any, output_path: str) -> str:
  step_dir = storage.join(storage.absolute(output_path), "0")
  if storage.exists(step_dir):
    raise InputError(f"--output_path={output_path}: {step_dir} already exists; choose a new directory")
  # Converted to jax arrays leaf by leaf and at most 1 GB in flight: with numpy leaves and default
  # limits orbax stages copies of the whole model (peak ~3x the model; this way ~1.9x).
  handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=1, save_device_host_concurrent_gb=1)
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(storage.join(step_dir, STATE), args=ocp.args.PyTreeSave({"params": _to_jax(params)}))
  settings = {k: getattr(config, k) for k in (*config_lib.MODEL_KEYS, "weight_dtype")}
  storage.write_text(saved_config_path(step_dir), json.dumps(settings, indent=2, sort_keys=True))
  return step_dir


def to_hf(checkpoint_path: str, output_path: str, argv: Sequence[str], adapter: bool = True) -> list[str]:
  """Writes config.json + safetensors that transformers' from_pretrained loads; for a LoRA step also the PEFT adapter
  folder and its base (adapter=False: the merged weights alone)."""
  # The path travels on as load_parameters_path; a wrong one is named by the flag the user typed.
  checkpoint_path = newest_step(checkpoint_path)
  checkpointing.resolve_state_dir(checkpoint_path, "--checkpoint_path")
  yml = [a for a in argv if a.endswith((".yml", ".yaml"))] or [config_lib.BASE_CONFIG_PATH]
  raw = config_lib.load_raw([yml[0], f"load_parameters_path={checkpoint_path}", *(a for a in argv if "=" in a)])
  # The tokenizer the run was trained with comes with its checkpoint, as its model keys do (explicit keys win).
  origin = run_tokenizer.take_from_checkpoint(raw)
  config = config_lib.build(raw, num_devices=1, num_slices=1, process_count=1)
  tokenizer = load_tokenizer(storage.resolve(config.tokenizer_path), config.tokenizer_type)  # for BOS/EOS ids
  ids = {name: getattr(tokenizer, name) for name in ("bos_id", "eos_id")}
  named = origin is not None or "tokenizer_path" in config.explicit_keys
  foreign = not named and tokenizer.vocab_size != config.vocab_size
  if foreign:
    # A converted step names no tokenizer, and the shipped default is not this model's: its BOS/EOS ids and its files
    # would be someone else's.
    logging.warning(
      "to_hf: no tokenizer_path given; bos_token_id/eos_token_id are left null in config.json and no tokenizer is "
      "written"
    )
    ids = {name: -1 for name in ids}
  else:
    run_tokenizer.check_vocabulary(tokenizer, config, origin)
  abstract = build.abstract_parameters(config)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
  params = jax.tree.map(np.asarray, lora_steps.load_params(checkpoint_path, target, config.ensemble_member))
  dtype = np.dtype(config.weight_dtype)
  tensors = []

  def add(name: str, value: np.ndarray, to_hf_fn: Any) -> None:
    tensors.append((name, to_hf_fn(value).shape, dtype, lambda: to_hf_fn(value)))

  family = models.family(config.decoder_block)
  joined = lambda t, values: values if isinstance(t.path, tuple) else values[0]  # what t.to_hf takes
  for t in family.hf.global_tensors(config):
    add(t.hf_name, joined(t, tuple(_get(params, path) for path in _paths(t))), t.to_hf)
  for i in range(config.base_num_decoder_layers):
    stack, j = layer_slot(family, config, i)
    for t in family.hf.layer_tensors(config, i):
      if config.scan_layers:
        values = tuple(_get(params, f"decoder/{stack.name}/{path}")[j] for path in _paths(t))
      else:
        values = tuple(_get(params, f"decoder/{stack.name}_{j}/{path}") for path in _paths(t))
      if t.part is not None:
        values = tuple(value[part_slice(t.part)] for value in values)
      name = f"model.layers.{i}.{t.hf_name}"
      if "{e}" in name:
        for e in range(config.num_experts):
          add(name.format(e=e), joined(t, tuple(value[e] for value in values)), t.to_hf)
      else:
        add(name, joined(t, values), t.to_hf)
  files = write_checkpoint(output_path, tensors)
  hf_config = family.hf.config(config, **{name: i if i >= 0 else None for name, i in ids.items()})
  storage.write_text(storage.join(output_path, "config.json"), json.dumps(hf_config, indent=2))
  files = ["config.json", *files, *([] if foreign else write_tokenizer(config, output_path))]
  return files + (_peft_adapter(checkpoint_path, config, target, output_path, argv) if adapter else [])


def _peft_adapter(checkpoint_path: str, config: Any, target: Any, output_path: str, argv: Sequence[str]) -> list[str]:
  """A LoRA step's adapters also as a PEFT folder, <output_path>/adapter, beside the merged weights, with the weights
  they were trained on, unmerged, as <output_path>/base: adapter_config.json names that folder, so peft's
  AutoPeftModelForCausalLM.from_pretrained(<output_path>/adapter) loads on its own (not the merged weights, which
  hold the adapters already), as does PeftModel.from_pretrained(<the base in transformers>, <output_path>/adapter)."""
  settings = lora_steps.lora_settings(checkpoint_path)
  if settings is None:
    return []
  from MaxLite.checkpoint import lora_peft

  base_path = settings.get("load_parameters_path") or settings.get("load_full_state_path")
  member = int(settings.get("ensemble_member", -1))  # the ensemble member the adapters were trained on, if any
  base = jax.tree.map(np.asarray, lora_steps.load_params(base_path, target, member))
  adapters = jax.tree.map(np.asarray, lora_steps.adapters_of(checkpoint_path, jax.tree.leaves(target)[0]))
  base_dir = storage.join(output_path, "base")
  base_files = to_hf(base_path, base_dir, [*argv, *([f"ensemble_member={member}"] if member >= 0 else [])], False)
  folder = storage.join(output_path, "adapter")
  rank, alpha = settings["lora_rank"], settings["lora_alpha"]
  # Absolute: peft hands base_model_name_or_path to from_pretrained as written, relative to the reader's directory.
  written = lora_peft.write_adapter(folder, config, base, adapters, rank, alpha, storage.absolute(base_dir))
  return [f"base/{name}" for name in base_files] + [f"adapter/{name}" for name in written]

"""LoRA adapters <-> a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) for the Hugging Face
model checkpoint/hf.py exports.

A MaxLite adapter pair is A [in, r] and B [r, out], `in` and `out` the kernel's contracted and kept dims flattened in
kernel order; PEFT's are lora_A.weight [r, in] and lora_B.weight [out, r] of the Hugging Face module, scaled by
lora_alpha / r as MaxLite scales. So an adapter is its transpose wherever the Hugging Face weight is the kernel
flattened to [in, out] and transposed (every q/k/v/o and gate/up/down projection of the Llama-like families); where
it is not (a fused qkv or gate/up kernel, experts) the export names the weight and stops.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from MaxLite import models, storage
from MaxLite.checkpoint.hf import _layer_slot
from MaxLite.checkpoint.safetensors_io import read_file, write_file
from MaxLite.cli.errors import CheckpointError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModelForCausalLM -> the transformers model


def _get(tree: dict, keys: list[str]) -> Any:
  for key in keys:
    if not isinstance(tree, dict) or key not in tree:
      return None
    tree = tree[key]
  return tree


def _projections(config: Any) -> Iterator[tuple[str, list[str], int | None, Any]]:
  """(PEFT module name, MaxLite path of the kernel's module, index in a scanned stack or None, the layer tensor) of
  every layer projection the family's Hugging Face map has."""
  family = models.family(config.decoder_block)
  for i in range(config.base_num_decoder_layers):
    stack, j = _layer_slot(family, config, i)
    for t in family.hf.layer_tensors(config, i):
      if not (t.path.endswith("/kernel") and t.hf_name.endswith(".weight")) or "{e}" in t.hf_name:
        continue
      module = t.path.removesuffix("/kernel").split("/")
      where = ["decoder", stack.name, *module] if config.scan_layers else ["decoder", f"{stack.name}_{j}", *module]
      yield f"model.layers.{i}.{t.hf_name.removesuffix('.weight')}", where, j if config.scan_layers else None, t


def _check_plain_transpose(name: str, tensor: Any, kernel_shape: tuple[int, ...], rows: int) -> None:
  """The Hugging Face weight of `tensor` must be its kernel as [in, out], transposed, for A and B to carry over."""
  probe = np.arange(math.prod(kernel_shape), dtype=np.float64).reshape(kernel_shape)
  if tensor.part is not None or not np.array_equal(tensor.to_hf(probe), probe.reshape(rows, -1).T):
    raise CheckpointError(
      f"{name}: this weight is not a plain [in, out] kernel in MaxLite (fused_qkv / fused_mlp), so its adapter has no "
      "PEFT equivalent; train the LoRA run with fused_qkv=false fused_mlp=false"
    )


def adapter_tensors(config: Any, base: dict, adapters: dict) -> tuple[dict[str, np.ndarray], list[str]]:
  """({PEFT tensor name: array}, target module names) of MaxLite adapters on model `config` (base: its kernels)."""
  out: dict[str, np.ndarray] = {}
  targets, used = set(), set()
  for name, where, j, tensor in _projections(config):
    node = _get(adapters, where)
    if not node:
      continue
    a, b = np.asarray(node["kernel_lora_a"]), np.asarray(node["kernel_lora_b"])
    kernel = np.asarray(_get(base, [*where, "kernel"]))
    if j is not None:
      a, b, kernel = a[j], b[j], kernel[j]
    _check_plain_transpose(name, tensor, kernel.shape, a.shape[0])
    out[f"{PREFIX}{name}.lora_A.weight"] = a.T
    out[f"{PREFIX}{name}.lora_B.weight"] = b.T
    targets.add(name.rsplit(".", 1)[-1])
    used.add("/".join(where))
  unmapped = sorted({"/".join(k[:-1]) for k in _flat(adapters)} - used)
  if unmapped:
    raise CheckpointError(f"adapters on {unmapped[0]} have no Hugging Face module to go on ({len(unmapped)} such)")
  return out, sorted(targets)


def _flat(tree: dict, prefix: tuple = ()) -> Iterator[tuple]:
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _flat(v, (*prefix, k))
    else:
      yield (*prefix, k)


def write_adapter(output_dir: str, config: Any, base: dict, adapters: dict, rank: int, alpha: float) -> list[str]:
  tensors, targets = adapter_tensors(config, base, adapters)
  storage.makedirs(output_dir)
  write_file(storage.join(output_dir, WEIGHTS_FILE), tensors)
  peft_config = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "r": rank,
    "lora_alpha": alpha,
    "lora_dropout": 0.0,
    "target_modules": targets,
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "init_lora_weights": True,
    "inference_mode": True,
    "base_model_name_or_path": None,
  }
  storage.write_text(storage.join(output_dir, CONFIG_FILE), json.dumps(peft_config, indent=2))
  return [CONFIG_FILE, WEIGHTS_FILE]


def _read_config(folder: str, config: Any) -> dict:
  path = storage.join(folder, CONFIG_FILE)
  if not storage.isfile(path):
    raise CheckpointError(f"hf_lora_adapter_path={folder}: no {CONFIG_FILE} (a PEFT adapter folder has one)")
  peft_config = json.loads(storage.read_text(path))
  if peft_config.get("peft_type", "LORA") != "LORA":
    raise CheckpointError(f"{path}: peft_type {peft_config.get('peft_type')!r}, only LORA adapters are read")
  for key in ("use_rslora", "fan_in_fan_out", "use_dora"):
    if peft_config.get(key):
      raise CheckpointError(f"{path}: {key}=true is not supported (plain LoRA only)")
  if (peft_config["r"], float(peft_config["lora_alpha"])) != (config.lora_rank, float(config.lora_alpha)):
    raise CheckpointError(
      f"{path} has r={peft_config['r']} lora_alpha={peft_config['lora_alpha']}: set lora_rank={peft_config['r']} "
      f"lora_alpha={peft_config['lora_alpha']} (the run has {config.lora_rank} and {config.lora_alpha:g})"
    )
  return peft_config


def read_adapter(folder: str, config: Any, abstract_adapters: dict) -> dict:
  """A PEFT adapter folder as MaxLite adapters shaped as `abstract_adapters` (the run's, from lora_module_path)."""
  _read_config(folder, config)
  weights = read_file(storage.join(folder, WEIGHTS_FILE))
  weights = {k.replace(".default.", "."): v for k, v in weights.items()}  # a name with PEFT's adapter name in it
  out: dict = {}
  taken = set()
  for name, where, j, _ in _projections(config):
    node = _get(abstract_adapters, where)
    if not node:
      continue
    for side, key in (("A", "kernel_lora_a"), ("B", "kernel_lora_b")):
      tensor_name = f"{PREFIX}{name}.lora_{side}.weight"
      if tensor_name not in weights:
        raise CheckpointError(f"hf_lora_adapter_path={folder}: {tensor_name} is missing (lora_module_path adapts it)")
      shape = node[key].shape[1:] if j is not None else node[key].shape
      value = weights[tensor_name].T
      if value.shape != tuple(shape):
        raise CheckpointError(
          f"hf_lora_adapter_path={folder}: {tensor_name} has shape {list(weights[tensor_name].shape)}, this model "
          f"needs {list(shape[::-1])} (is the adapter for another base?)"
        )
      taken.add(tensor_name)
      target = _get(out, where) if _get(out, where) is not None else _make(out, where)
      if j is None:
        target[key] = value.astype(node[key].dtype)
      else:
        target.setdefault(key, np.zeros(node[key].shape, node[key].dtype))[j] = value
  extra = sorted(set(weights) - taken)
  if extra:
    raise CheckpointError(
      f"hf_lora_adapter_path={folder}: {extra[0]} is on a module lora_module_path does not adapt ({len(extra)} such)"
    )
  return out


def _make(tree: dict, keys: list[str]) -> dict:
  for key in keys:
    tree = tree.setdefault(key, {})
  return tree

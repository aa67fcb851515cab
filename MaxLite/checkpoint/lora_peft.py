"""LoRA adapters <-> a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) for the Hugging Face
model checkpoint/hf.py exports.

A MaxLite adapter pair is A [in, r] and B [r, out], `in` and `out` the kernel's contracted and kept dims flattened in
kernel order; PEFT's are lora_A.weight [r, in] and lora_B.weight [out, r] of the Hugging Face module, scaled by
lora_alpha / r as MaxLite scales. The Hugging Face weight is the kernel flattened to [in, out], transposed, and for
some projections with its rows reordered: DeepSeek's q_b_proj / q_proj and kv_a_proj_with_mqa, whose RoPE rows
MaxLite stores in rotate-half order (models/deepseek.py). Each weight's order is read off the family's own weight
conversion, and moves the adapters with it: an output row order reorders B's rows (A is untouched), an input
column order A's columns. A weight that is not one projection's kernel (a fused qkv or gate/up kernel, experts)
has no PEFT adapter: the export and the import name it and stop.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
from absl import logging

from MaxLite import models, storage
from MaxLite.checkpoint.safetensors_io import read_file, write_file
from MaxLite.cli.errors import CheckpointError
from MaxLite.models.hf_layout import layer_slot

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
    stack, j = layer_slot(family, config, i)
    for t in family.hf.layer_tensors(config, i):
      one = isinstance(t.path, str)  # a tensor of several MaxLite weights (paths) is no one projection's kernel
      if not (one and t.path.endswith("/kernel") and t.hf_name.endswith(".weight")) or "{e}" in t.hf_name:
        continue
      module = t.path.removesuffix("/kernel").split("/")
      where = ["decoder", stack.name, *module] if config.scan_layers else ["decoder", f"{stack.name}_{j}", *module]
      yield f"model.layers.{i}.{t.hf_name.removesuffix('.weight')}", where, j if config.scan_layers else None, t


def _orders(name: str, tensor: Any, rows: int, cols: int, seen: dict) -> tuple[np.ndarray, np.ndarray]:
  """(hf_in, hf_out): the kernel flattened to K [rows, cols] ([in, out]) is the Hugging Face weight W [cols, rows]
  with K[i, o] = W[hf_out[o], hf_in[i]]. Read off the family's conversion applied to W's own flat indices; a weight
  whose conversion is not such a row and column reordering has no PEFT adapter. `seen`: the orders already read,
  by weight (every layer of a stack has the same)."""
  key = (tensor.path, tensor.hf_name, rows, cols)
  if key not in seen:
    seen[key] = _read_orders(name, tensor, rows, cols)
  return seen[key]


def _read_orders(name: str, tensor: Any, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
  if tensor.part is None:
    indices = np.arange(rows * cols, dtype=np.int64).reshape(cols, rows)  # W[p, q] = p * rows + q
    k = np.asarray(tensor.to_maxlite(indices))
    if k.size == rows * cols:
      k = k.reshape(rows, cols)
      hf_in, hf_out = k[:, 0] % rows, k[0, :] // rows
      orders = np.array_equal(np.sort(hf_in), np.arange(rows)) and np.array_equal(np.sort(hf_out), np.arange(cols))
      if orders and np.array_equal(k, hf_out[None, :] * rows + hf_in[:, None]):
        return hf_in, hf_out
  raise CheckpointError(
    f"{name}: this weight is not one projection's kernel in MaxLite (fused_qkv / fused_mlp), so its adapter has no "
    "PEFT equivalent; train the LoRA run with fused_qkv=false fused_mlp=false"
  )


def adapter_tensors(config: Any, base: dict, adapters: dict) -> tuple[dict[str, np.ndarray], list[str]]:
  """({PEFT tensor name: array}, target module names) of MaxLite adapters on model `config` (base: its kernels)."""
  out: dict[str, np.ndarray] = {}
  targets, used, seen = set(), set(), {}
  for name, where, j, tensor in _projections(config):
    node = _get(adapters, where)
    if not node:
      continue
    a, b = np.asarray(node["kernel_lora_a"]), np.asarray(node["kernel_lora_b"])
    kernel = np.asarray(_get(base, [*where, "kernel"]))
    if j is not None:
      a, b, kernel = a[j], b[j], kernel[j]
    if kernel.size != a.shape[0] * b.shape[1]:
      raise CheckpointError(
        f"{name}: adapters A {list(a.shape)}, B {list(b.shape)} do not fit its kernel {kernel.shape}"
      )
    hf_in, hf_out = _orders(name, tensor, a.shape[0], b.shape[1], seen)
    out[f"{PREFIX}{name}.lora_A.weight"] = a.T[:, np.argsort(hf_in)]
    out[f"{PREFIX}{name}.lora_B.weight"] = b.T[np.argsort(hf_out)]
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


def write_adapter(
  output_dir: str, config: Any, base: dict, adapters: dict, rank: int, alpha: float, base_model: str | None = None
) -> list[str]:
  """The PEFT folder. base_model: the base_model_name_or_path that peft's AutoPeftModelForCausalLM loads the base
  from: the weights the adapters were trained on, unmerged (with the merged ones it would add them twice). peft hands
  it to from_pretrained as written, so a relative path would resolve against the reader's working directory."""
  tensors, targets = adapter_tensors(config, base, adapters)
  if config.decoder_block == "deepseek" and {"gate_proj", "up_proj", "down_proj"} & set(targets):
    logging.warning(
      "PEFT adapter: peft 0.21 on transformers 5 moves DeepseekV3's gate_proj/up_proj/down_proj targets to the routed "
      "experts (huggingface/peft#3711) and so leaves out these adapters of the dense MLPs and shared experts: with "
      "it, use the merged weights, or train with lora_module_path on self_attention only"
    )
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
    "base_model_name_or_path": base_model,
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
  taken, seen = set(), {}
  for name, where, j, tensor in _projections(config):
    node = _get(abstract_adapters, where)
    if not node:
      continue
    rows, cols = node["kernel_lora_a"].shape[-2], node["kernel_lora_b"].shape[-1]
    hf_in, hf_out = _orders(name, tensor, rows, cols, seen)
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
      value = value[hf_in] if side == "A" else value[:, hf_out]  # the weight's row orders, as its kernel has them
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

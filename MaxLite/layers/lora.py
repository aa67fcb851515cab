"""LoRA and QLoRA through Qwix's LoRA provider, with MaxText's keys (enable_lora, lora_rank, lora_alpha,
lora_module_path, lora_weight_qtype, lora_tile_size).

Qwix intercepts the matmuls of the modules `lora_module_path` matches and adds (x A) B * lora_alpha / lora_rank to
each, creating the adapters next to the module's kernel: `kernel_lora_a` [in, rank] (He-uniform) and `kernel_lora_b`
[rank, out] (zeros, so a fresh adapter changes nothing), `in` and `out` being the kernel's contracted and kept dims,
each flattened. PEFT's adapters are the same two matrices transposed, their rows in the order of the Hugging Face
weight where it has another (checkpoint/lora_peft.py). With lora_weight_qtype (QLoRA) the frozen kernel is stored
quantized (nf4, int8, int4) and dequantized in each matmul.

The parameter tree of a LoRA model is the base model's plus the adapters; `split` and `merge` separate and join
them: training differentiates and updates the adapters only (training/train_state.py), the base stays frozen.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

from flax import traverse_util

from MaxLite.cli.errors import ConfigError
from MaxLite.config.choices import LORA_DEFAULT_MODULES
from MaxLite.layers import quantization

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")
MOE_BLOCK = "moe"  # the name every family gives its layers.moe.MoeBlock: the routed experts and their router


def module_path(config: Any) -> str:
  return config.lora_module_path or LORA_DEFAULT_MODULES


def with_lora(model: Any, config: Any, adapters: bool = True) -> Any:
  """`model` with adapters on the projections `lora_module_path` matches, or itself without enable_lora.
  adapters=False: the base alone (DPO's reference), which with QLoRA still reads its kernels quantized."""
  if not config.enable_lora or not (adapters or config.lora_weight_qtype):
    return model
  import qwix  # only a LoRA run loads it

  quantization.round_the_same_in_every_layout()  # QLoRA's base: as a quantized run rounds
  if not adapters:
    base_rule = qwix.QuantizationRule(
      module_path=module_path(config),
      weight_qtype=config.lora_weight_qtype,
      tile_size=config.lora_tile_size or None,
      op_names=("dot_general", "einsum"),
    )
    return qwix.quantize_model(model, qwix.PtqProvider([base_rule]))
  rule = qwix.LoraRule(
    module_path=module_path(config),
    rank=config.lora_rank,
    alpha=float(config.lora_alpha),
    weight_qtype=config.lora_weight_qtype or None,
    tile_size=config.lora_tile_size or None,
    op_names=("dot_general", "einsum"),
  )
  return qwix.apply_lora_to_model(model, qwix.LoraProvider([rule]))


def init_scope(config: Any) -> Any:
  """Where a LoRA model is initialised: without logical axis rules. Qwix reads a kernel's shape through flax's
  unbox, which applies the kernel's logical sharding constraint, and inside nn.scan that names the stacked layers
  axis too, one more than the layer's slice has. Without rules flax applies no constraint; the parameters are placed
  by the init's out_shardings all the same."""
  if not config.enable_lora:
    return contextlib.nullcontext()
  from flax.linen import partitioning as nn_partitioning

  return nn_partitioning.axis_rules(())


def is_adapter(path: tuple[str, ...]) -> bool:
  return str(path[-1]).endswith(ADAPTER_SUFFIXES)


def split(params: Any) -> tuple[dict, dict]:
  """(adapters, frozen base): the LoRA model's parameter tree in two trees of the same nesting."""
  flat = traverse_util.flatten_dict(params)
  adapters = {k: v for k, v in flat.items() if is_adapter(k)}
  base = {k: v for k, v in flat.items() if not is_adapter(k)}
  return traverse_util.unflatten_dict(adapters), traverse_util.unflatten_dict(base)


def merge(base: Any, adapters: Any) -> dict:
  """The LoRA model's parameter tree from its two parts (no copy: the same arrays)."""
  flat = traverse_util.flatten_dict(base)
  flat.update(traverse_util.flatten_dict(adapters))
  return traverse_util.unflatten_dict(flat)


def count(adapters: Any) -> int:
  import jax

  return sum(leaf.size for leaf in jax.tree.leaves(adapters))


def check_matches(adapters: Any, config: Any) -> None:
  """A lora_module_path that matches no projection is a config error, not a run that trains nothing."""
  if not traverse_util.flatten_dict(adapters):
    raise ConfigError(
      f"lora_module_path={module_path(config)!r} matches no projection of the model: module paths look like "
      'decoder/layers/self_attention/query or decoder/layers/mlp/wi_0 ("" = every attention and MLP projection)'
    )
  check_no_routed_experts(adapters, config)


def check_no_routed_experts(adapters: Any, config: Any) -> None:
  """A MoE layer's routed experts multiply through a grouped matmul (ragged_dot or the megablox kernel) that Qwix's
  LoRA provider does not intercept, so adapters there would silently not apply: refused by name (the router too,
  whose adapter alone would change which experts the tokens go to). The MoE block is a module named `moe` in every
  family (models/llama.py, models/deepseek.py): matched as a whole path component, as `moe_layers` (DeepSeek's stack
  of MoE layers, attention and shared experts included) is a different module."""
  routed = [m for m in adapted_modules(adapters) if MOE_BLOCK in m.split("/")]
  if routed:
    raise ConfigError(
      f"lora_module_path={module_path(config)!r} puts adapters on the routed experts ({routed[0]}): LoRA on routed "
      "experts is not supported; adapt attention, dense MLPs and shared experts (the default)"
    )


def adapted_modules(adapters: Any) -> list[str]:
  """'decoder/layers/self_attention/query', ... : the modules that carry adapters, sorted."""
  names = {"/".join(map(str, k[:-1])) for k in traverse_util.flatten_dict(adapters)}
  return sorted(names)


def scale(config: Any) -> float:
  return float(config.lora_alpha) / config.lora_rank


def kernel_name(adapter: str) -> str:
  """'kernel_lora_a' -> 'kernel'."""
  return re.sub(r"_lora_[ab]$", "", adapter)


def merged(base: Any, adapters: Any, scale_: float) -> dict:
  """The base with each adapted kernel replaced by kernel + (A B) * scale, reshaped to the kernel: the weights the
  LoRA model computes with, as a plain model's parameters (pure; jit it for sharded arrays)."""
  import jax.numpy as jnp

  flat = traverse_util.flatten_dict(base)
  pieces = traverse_util.flatten_dict(adapters)
  for path, a in pieces.items():
    if not str(path[-1]).endswith("_lora_a"):
      continue
    kernel_path = (*path[:-1], kernel_name(path[-1]))
    b = pieces[(*path[:-1], f"{kernel_name(path[-1])}_lora_b")]
    kernel = flat[kernel_path]
    delta = jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32)) * scale_
    flat[kernel_path] = (kernel.astype(jnp.float32) + delta.reshape(kernel.shape)).astype(kernel.dtype)
  return traverse_util.unflatten_dict(flat)


def quantize_base(params: Any, abstract_frozen: Any) -> dict:
  """QLoRA: full-precision base parameters -> the quantized tree Qwix reads (`abstract_frozen`, the LoRA model's base
  part). qwix.quantize_params would apply each kernel's per-layer quantization to a scanned stack as a whole, one axis
  off; here a stack is quantized layer by layer (vmap over its leading axis)."""
  import jax
  from qwix._src.core import qarray
  from qwix._src.providers.ptq import WithAux

  quantization.round_the_same_in_every_layout()

  def one(value: Any, abstract: Any) -> Any:
    if not isinstance(abstract, WithAux):
      return value
    quantize = lambda v: qarray.quantize(v, abstract.how)  # noqa: E731
    try:
      fits = jax.eval_shape(quantize, value).scale.shape == abstract.array.scale.shape
    except ValueError:  # the per-layer tiling does not divide the stacked shape
      fits = False
    return abstract.replace(array=(quantize if fits else jax.vmap(quantize))(value))

  flat = traverse_util.flatten_dict(params)
  wanted = traverse_util.flatten_dict(abstract_frozen)
  return traverse_util.unflatten_dict({k: one(flat[k], wanted[k]) for k in wanted})

"""The configured model and its parameters, built from a config (and a mesh): the one place training, AOT compilation,
evaluation, DPO's reference pass, decoding and the Hugging Face converter get them, so each applies the same model.
The training pieces on top (optimizer, abstract state, jitted step) are training/builder.py's.

The model is `models.transformer.Transformer`, whose layers come from the decoder family registered for
`config.decoder_block`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from MaxLite.config import Config
from MaxLite.layers.lora import init_scope, with_lora
from MaxLite.layers.quantization import quantized
from MaxLite.models.transformer import Transformer
from MaxLite.parallel import sharding as sharding_lib


def model(
  config: Config, *, deterministic: bool = True, decode: bool = False, adapters: bool = True, stored: bool = True
) -> Transformer:
  """The configured decoder, its projections quantized by Qwix with `quantization` (layers/quantization.py) or
  carrying LoRA adapters with enable_lora (layers/lora.py; adapters=False: the base model alone, DPO's reference;
  stored=False: neither adapters nor QLoRA's quantized kernels, the model of the weights a checkpoint holds).
  deterministic=False applies dropout (training with dropout_rate > 0); decode=True keeps a KV cache (apply with
  mutable=["cache"])."""
  decoder = quantized(Transformer(config, deterministic=deterministic, decode=decode), config)
  return with_lora(decoder, config, adapters) if stored else decoder


@dataclasses.dataclass(frozen=True)
class Parameters:
  """The parameters alone, for runs that only apply the model (decoding, conversion): shapes, their logical axes and
  where each lives on the mesh."""

  model: Transformer
  abstract: Any
  logical: Any
  shardings: Any


def _variables(model_: Transformer, config: Config, rng: jax.Array) -> Any:
  # lazy_init traces shapes only and keeps just the parameter computations: no forward pass is compiled.
  ids = jax.ShapeDtypeStruct((config.micro_batch_size, config.max_target_length), jnp.int32)
  with init_scope(config):
    return model_.lazy_init({"params": rng, "dropout": rng}, ids, ids, ids)["params"]


def _boxed_parameters(model_: Transformer, config: Config) -> Any:
  # The key is made inside eval_shape: nothing runs on a device, so this works for an AOT target too.
  return jax.eval_shape(lambda: _variables(model_, config, jax.random.key(config.init_weights_seed)))


def abstract_parameters(config: Config, adapters: bool = True) -> Any:
  """The parameters' shapes and dtypes, without a mesh (adapters=False: without LoRA's)."""
  return sharding_lib.unbox(_boxed_parameters(model(config, adapters=adapters), config))


def parameters(config: Config, mesh: Mesh, adapters: bool = True, stored: bool = True) -> Parameters:
  """adapters=False: the model without LoRA's adapters (decoding applies them merged into the weights); stored=False:
  also without QLoRA's quantized storage, i.e. the parameters as a checkpoint holds them."""
  model_ = model(config, adapters=adapters, stored=stored)
  boxed = _boxed_parameters(model_, config)
  logical = nn.get_partition_spec(boxed)
  return Parameters(model_, sharding_lib.unbox(boxed), logical, sharding_lib.logical_to_sharding(logical, mesh, config))


def random_parameters(config: Config, params: Parameters) -> Any:
  """Freshly initialised parameters (init_weights_seed), made sharded inside jit: the same values a training run's
  step 0 has."""
  init = jax.jit(functools.partial(_variables, params.model, config), out_shardings=params.shardings)
  return sharding_lib.unbox(init(jax.random.key(config.init_weights_seed)))

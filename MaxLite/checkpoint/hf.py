"""Hugging Face Llama/Mistral checkpoints <-> MaxLite checkpoints (the logic of convert_hf.py).

to_maxlite writes CKPT/0/state (params only, what load_parameters_path reads) and CKPT/0/config/config.json
(the model settings inferred from config.json), so training, decode.py and to_hf need no model
arguments: `load_parameters_path=CKPT/0`. Tensors are read one at a time from the safetensors files
and written into the one output copy; orbax's save then stages serialisation buffers next to it
(measured peak ~1.9x the model on a 1B checkpoint, end_to_end/bench_convert.py).

MaxLite's RoPE rotates the two halves of each head (the Hugging Face Llama layout) and scales q by
head_dim**-0.5 inside attention, as transformers does, so q/k weights need no permutation; the
conversion is transposes and reshapes only.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from MaxLite import config as config_lib
from MaxLite import paths
from MaxLite.checkpoint import STATE, saved_config_path
from MaxLite.checkpoint.safetensors_io import SafetensorsReader, write_checkpoint
from MaxLite.errors import InputError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")

Shapes = dict[str, int]


def model_settings_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
  """config.json -> MaxLite model keys; anything MaxLite does not model is refused by name."""
  arch = (hf.get("architectures") or ["?"])[0]
  if arch not in ARCHITECTURES:
    raise InputError(f"{source}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
  if hf.get("hidden_act", "silu") != "silu":
    raise InputError(f"{source}: hidden_act={hf['hidden_act']!r}; MaxLite's Llama MLP is SwiGLU (silu)")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise InputError(f"{source}: {key}=true is not supported (MaxLite's projections have no bias)")
  rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    raise InputError(
      f"{source}: rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported (plain RoPE only)"
    )
  heads = hf["num_attention_heads"]
  return {
    "base_emb_dim": hf["hidden_size"],
    "base_num_query_heads": heads,
    "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
    "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
    "base_mlp_dim": hf["intermediate_size"],
    "base_num_decoder_layers": hf["num_hidden_layers"],
    "vocab_size": hf["vocab_size"],
    "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
    "rope_max_timescale": float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
    "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
  }


def hf_config_from_model(config: Any) -> dict[str, Any]:
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": config.base_emb_dim,
    "intermediate_size": config.base_mlp_dim,
    "num_attention_heads": config.base_num_query_heads,
    "num_key_value_heads": config.base_num_kv_heads,
    "head_dim": config.head_dim,
    "num_hidden_layers": config.base_num_decoder_layers,
    "vocab_size": config.vocab_size,
    "rms_norm_eps": config.normalization_layer_epsilon,
    "rope_theta": config.rope_max_timescale,
    "tie_word_embeddings": config.logits_via_embedding,
    "max_position_embeddings": config.max_target_length,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": config.weight_dtype,
  }


def layer_tensors(d: Shapes) -> list[tuple[str, str, Callable, Callable]]:
  """(MaxLite path inside a layer, HF name inside a layer, hf->maxlite, maxlite->hf) per weight."""
  e, h, kv, hd = d["emb"], d["heads"], d["kv"], d["head_dim"]
  project = lambda n: (lambda w: w.T.reshape(e, n, hd), lambda k: k.reshape(e, n * hd).T)
  same = (lambda w: w, lambda k: k)
  return [
    ("self_attention/query/kernel", "self_attn.q_proj.weight", *project(h)),
    ("self_attention/key/kernel", "self_attn.k_proj.weight", *project(kv)),
    ("self_attention/value/kernel", "self_attn.v_proj.weight", *project(kv)),
    (
      "self_attention/out/kernel",
      "self_attn.o_proj.weight",
      lambda w: w.T.reshape(h, hd, e),
      lambda k: k.reshape(h * hd, e).T,
    ),
    ("mlp/wi_0/kernel", "mlp.gate_proj.weight", np.transpose, np.transpose),
    ("mlp/wi_1/kernel", "mlp.up_proj.weight", np.transpose, np.transpose),
    ("mlp/wo/kernel", "mlp.down_proj.weight", np.transpose, np.transpose),
    ("pre_self_attention_norm/scale", "input_layernorm.weight", *same),
    ("post_self_attention_norm/scale", "post_attention_layernorm.weight", *same),
  ]


def global_tensors(tied: bool) -> list[tuple[str, str, Callable, Callable]]:
  same = (lambda w: w, lambda k: k)
  out = [
    ("token_embedder/embedding", "model.embed_tokens.weight", *same),
    ("decoder_norm/scale", "model.norm.weight", *same),
  ]
  if not tied:
    out.append(("logits_dense/kernel", "lm_head.weight", np.transpose, np.transpose))
  return out


def dims(config: Any) -> Shapes:
  return {
    "emb": config.base_emb_dim,
    "heads": config.base_num_query_heads,
    "kv": config.base_num_kv_heads,
    "head_dim": config.head_dim,
    "mlp": config.base_mlp_dim,
  }


def _get(tree: dict, path: str) -> Any:
  for key in path.split("/"):
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
  config_json = paths.join(hf_path, "config.json")
  if not paths.isfile(config_json):
    raise InputError(f"--hf_path={hf_path}: no config.json there")
  settings = model_settings_from_hf(json.loads(paths.read_text(config_json)), config_json)
  reader = SafetensorsReader(hf_path)
  config = _load_config(argv, [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in settings.items()])
  explicit = dict(a.split("=", 1) for a in argv if "=" in a)
  for key, value in settings.items():  # given model keys must agree with the checkpoint
    if key in explicit and config_lib.coerce(key, explicit[key], value, "command line") != value:
      raise InputError(f"{key}={explicit[key]} was given but {config_json} has {value}")
  dtype = np.dtype(config.weight_dtype)
  params: dict = {}
  n = config.base_num_decoder_layers
  for ml_path, hf_name, to_ml, _ in global_tensors(config.logits_via_embedding):
    _set(params, ml_path, _checked(to_ml(reader.read(hf_name)), hf_name).astype(dtype))
  for ml_path, hf_name, to_ml, _ in layer_tensors(dims(config)):
    stacked = None
    for i in range(n):
      name = f"model.layers.{i}.{hf_name}"
      value = _checked(to_ml(reader.read(name)), name)
      if not config.scan_layers:
        _set(params, f"decoder/layers_{i}/{ml_path}", value.astype(dtype))
        continue
      if stacked is None:
        stacked = np.empty((n, *value.shape), dtype)
      stacked[i] = value
    if config.scan_layers:
      _set(params, f"decoder/layers/{ml_path}", stacked)
  _check_against_model(params, config)
  return _save(params, config, output_path)


def _checked(value: np.ndarray, name: str) -> np.ndarray:
  if not np.issubdtype(value.dtype, np.floating) and value.dtype.name != "bfloat16":
    raise InputError(f"tensor {name!r} has dtype {value.dtype}, expected floating point")
  return value


def _abstract_params(config: Any) -> Any:
  import jax

  from MaxLite.layers.decoder import Transformer
  from MaxLite.training.train_state import _unbox

  ids = jax.ShapeDtypeStruct((1, config.max_target_length), np.int32)
  return _unbox(jax.eval_shape(lambda: Transformer(config).lazy_init(jax.random.key(0), ids, ids, ids))["params"])


def _check_against_model(params: dict, config: Any) -> None:
  """Every converted tensor has the shape the configured model expects (a config.json / weights mismatch)."""
  import jax

  from MaxLite.checkpoint.manager import path_name

  expected = {path_name(p): leaf.shape for p, leaf in jax.tree_util.tree_flatten_with_path(_abstract_params(config))[0]}
  got = {path_name(p): leaf.shape for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  for name, shape in expected.items():
    if got.get(name) != tuple(shape):
      raise InputError(
        f"converted weight '{name}' has shape {got.get(name)} but the model from config.json "
        f"expects {tuple(shape)} (the safetensors do not match config.json)"
      )


def _to_jax(tree: dict) -> dict:
  """numpy leaves -> jax arrays one at a time, dropping each numpy copy as soon as it is converted."""
  import jax

  for key in list(tree):
    tree[key] = _to_jax(tree[key]) if isinstance(tree[key], dict) else jax.device_put(tree.pop(key))
  return tree


def _save(params: dict, config: Any, output_path: str) -> str:
  import orbax.checkpoint as ocp

  step_dir = paths.join(paths.absolute(output_path), "0")
  if paths.exists(step_dir):
    raise InputError(f"--output_path={output_path}: {step_dir} already exists; choose a new directory")
  # Converted to jax arrays leaf by leaf and at most 1 GB in flight: with numpy leaves and default
  # limits orbax stages copies of the whole model (peak ~3x the model; this way ~1.9x).
  handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=1, save_device_host_concurrent_gb=1)
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(paths.join(step_dir, STATE), args=ocp.args.PyTreeSave({"params": _to_jax(params)}))
  settings = {k: getattr(config, k) for k in (*config_lib.MODEL_KEYS, "weight_dtype")}
  paths.write_text(saved_config_path(step_dir), json.dumps(settings, indent=2, sort_keys=True))
  return step_dir


def to_hf(checkpoint_path: str, output_path: str, argv: Sequence[str]) -> list[str]:
  """Writes config.json + safetensors that transformers' from_pretrained loads."""
  import jax

  from MaxLite.checkpoint import manager as checkpointing

  config = _load_config(argv, [f"load_parameters_path={checkpoint_path}"])
  abstract = _abstract_params(config)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
  params = jax.tree.map(np.asarray, checkpointing.load_params(checkpoint_path, target))
  dtype = np.dtype(config.weight_dtype)
  tensors = []
  for ml_path, hf_name, _, to_hf_fn in global_tensors(config.logits_via_embedding):
    value = _get(params, ml_path)
    tensors.append((hf_name, to_hf_fn(value).shape, dtype, lambda v=value, f=to_hf_fn: f(v)))
  for i in range(config.base_num_decoder_layers):
    for ml_path, hf_name, _, to_hf_fn in layer_tensors(dims(config)):
      value = (
        _get(params, f"decoder/layers/{ml_path}")[i]
        if config.scan_layers
        else _get(params, f"decoder/layers_{i}/{ml_path}")
      )
      tensors.append((f"model.layers.{i}.{hf_name}", to_hf_fn(value).shape, dtype, lambda v=value, f=to_hf_fn: f(v)))
  files = write_checkpoint(output_path, tensors)
  paths.write_text(paths.join(output_path, "config.json"), json.dumps(hf_config_from_model(config), indent=2))
  return ["config.json", *files]

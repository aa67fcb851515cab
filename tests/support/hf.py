"""Tiny transformers models of each family, saved as safetensors, and what MaxLite makes of a converted step: its
config, parameters and logits, and the RoPE its exported config.json carries. Needs torch and transformers: a test
file that imports this at module level is skipped without them."""

import copy
import math

import jax
import numpy as np
import pytest

from MaxLite.checkpoint import hf as convert_hf
from MaxLite.checkpoint import manager as checkpointing
from MaxLite.config import load_config
from MaxLite.models import build
from MaxLite.models.transformer import Transformer
from support.config import BASE_YML, first_devices

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 24


SMALL = dict(  # transformers config arguments of a small model of any family
  vocab_size=384,
  hidden_size=64,
  intermediate_size=160,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=128,
  rms_norm_eps=1e-5,
)


def hf_model(tmp_path, name="hf", shard=False, **overrides):
  """A small random LlamaForCausalLM built with transformers' own config class, saved as safetensors."""
  settings = dict(SMALL, rope_theta=10000.0, tie_word_embeddings=False)
  settings.update(overrides)
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()
  with torch.no_grad():  # norm scales away from 1, so a mixed-up norm cannot pass
    for name_, param in model.named_parameters():
      if "norm" in name_:
        param.add_(0.1 * torch.randn_like(param))
  path = str(tmp_path / name)
  model.save_pretrained(path, **({"max_shard_size": "100KB"} if shard else {}))
  return model, path


def maxlite_config(step_dir, *overrides):
  return load_config(
    [BASE_YML, f"load_parameters_path={step_dir}", f"max_target_length={SEQ}", *overrides],
    num_devices=1,
    num_slices=1,
    process_count=1,
  )


def maxlite_params(config, step_dir):
  device = jax.sharding.SingleDeviceSharding(first_devices(1)[0])
  abstract = build.abstract_parameters(config)
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract)
  return checkpointing.load_params(step_dir, target)


def token_ids(vocab, batch=2):
  return np.random.default_rng(1).integers(0, vocab, (batch, SEQ))


def maxlite_logits(config, params, ids):
  pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
  # Compiled as one program: run op by op, an unscanned model compiles each of its many small ops on first use
  # (several seconds each time a test process meets a new shape), and a scanned one retraces its scan every call.
  forward = jax.jit(Transformer(config).apply)
  return np.asarray(forward({"params": params}, ids, pos, np.ones_like(ids)))


def transformers4_rope(hf):
  """RoPE as transformers 4.x and vLLM read config.json: rope_theta, rope_scaling (rope_type, or type) and Gemma 3's
  rope_local_base_freq; they never read transformers 5's rope_parameters. YaRN's cos/sin factor and DeepSeek's
  softmax factor by 4.x's rules (an attention_factor, else the mscale / mscale_all_dim ratio when both are set)."""
  scaling = hf.get("rope_scaling") or {}
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  out = {"theta": float(hf.get("rope_theta", 10000.0)), "type": kind}
  if "rope_local_base_freq" in hf:
    out["local_theta"] = float(hf["rope_local_base_freq"])
  if kind == "default":
    return out
  factor = float(scaling["factor"])
  out["factor"] = factor
  if kind == "llama3":
    out.update(
      low=float(scaling["low_freq_factor"]),
      high=float(scaling["high_freq_factor"]),
      original=int(scaling["original_max_position_embeddings"]),
    )
  elif kind == "yarn":
    get_mscale = lambda m=1.0: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    cos_sin = scaling.get("attention_factor")
    if cos_sin is None:
      cos_sin = get_mscale(mscale) / get_mscale(all_dim) if mscale and all_dim else get_mscale()
    out.update(
      original=int(scaling["original_max_position_embeddings"]),
      beta_fast=float(scaling.get("beta_fast") or 32),
      beta_slow=float(scaling.get("beta_slow") or 1),
      truncate=bool(scaling.get("truncate", True)),
      cos_sin=float(cos_sin),
    )
    if hf["model_type"] == "deepseek_v3":
      out["softmax"] = get_mscale(all_dim) ** 2 if all_dim else 1.0
  elif kind != "linear":
    raise ValueError(f"rope type {kind} is not read here")
  return out


def maxlite_rope(config):
  """transformers4_rope's quantities from a MaxLite config: what MaxLite computes."""
  from MaxLite.layers.mla import mla_query_scale
  from MaxLite.layers.rope import rope_frequencies

  kind = {"default": "default", "llama3.1": "llama3", "yarn": "yarn"}[config.rope_type]
  if config.rope_linear_scaling_factor != 1.0:
    kind = "linear"
  out = {"theta": float(config.rope_max_timescale), "type": kind}
  if config.decoder_block == "gemma3":
    local = config.local_rope_max_timescale
    out["local_theta"] = float(local if local > 0 else config.rope_max_timescale)
  if kind == "linear":
    out["factor"] = float(config.rope_linear_scaling_factor)
  elif kind == "llama3":
    out.update(
      factor=float(config.rope_factor),
      low=float(config.rope_low_freq_factor),
      high=float(config.rope_high_freq_factor),
      original=int(config.original_max_position_embeddings),
    )
  elif kind == "yarn":
    out.update(
      factor=float(config.rope_factor),
      original=int(config.original_max_position_embeddings),
      beta_fast=float(config.beta_fast),
      beta_slow=float(config.beta_slow),
      truncate=bool(config.rope_truncate),
      cos_sin=rope_frequencies(config)[1],
    )
    if config.attention_type == "mla":
      out["softmax"] = mla_query_scale(config) * (config.qk_nope_head_dim + config.qk_rope_head_dim) ** 0.5
  return out


def check_both_rope_forms(hf, config):
  """An exported config.json carries MaxLite's RoPE in transformers 5's rope_parameters and in the keys transformers
  4.x and vLLM read, and transformers 5 reads the same from either form alone."""
  assert hf.get("rope_parameters"), "no rope_parameters"
  assert "rope_theta" in hf and "rope_scaling" in hf, "no rope_theta / rope_scaling"
  assert transformers4_rope(hf) == pytest.approx(maxlite_rope(config), rel=1e-12)
  legacy = {k: v for k, v in hf.items() if k != "rope_parameters"}
  current = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_scaling", "rope_local_base_freq")}
  standardized = lambda d: transformers.AutoConfig.for_model(**copy.deepcopy(d)).rope_parameters
  assert standardized(legacy) == standardized(current)


def export_gives_maxlite_logits(step_dir, output_path):
  """Exports a MaxLite step with to_hf and asserts transformers' logits are MaxLite's (1e-4); returns (the exported
  transformers model, the step's config, its parameters)."""
  convert_hf.to_hf(step_dir, output_path, [])
  model = transformers.AutoModelForCausalLM.from_pretrained(output_path).eval()
  loaded = maxlite_config(step_dir)
  ids = token_ids(loaded.vocab_size)
  with torch.no_grad():
    expected = model(torch.tensor(ids)).logits.numpy()
  params = maxlite_params(loaded, step_dir)
  assert np.abs(maxlite_logits(loaded, params, ids) - expected).max() <= 1e-4
  return model, loaded, params


def transformers_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor(ids)).logits.numpy()


# The tiny models of the families with test files of their own, also rows of tests/checkpoint/test_hf_models.py's table.
TINY_GEMMA3 = dict(  # Gemma3TextConfig arguments of a tiny Gemma 3
  vocab_size=384,
  hidden_size=64,
  intermediate_size=160,
  num_hidden_layers=7,  # layers 0-4 and 6 local, 5 global
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  max_position_embeddings=128,
  sliding_window=5,  # shorter than the test's 24 tokens: the window decides the local layers' output
)
TINY_DEEPSEEK = dict(  # DeepseekV3Config arguments of a tiny DeepSeek-V3
  vocab_size=384,
  hidden_size=64,
  intermediate_size=128,
  moe_intermediate_size=32,
  num_hidden_layers=3,
  first_k_dense_replace=1,
  num_attention_heads=4,
  num_key_value_heads=4,
  n_routed_experts=8,
  num_experts_per_tok=2,
  n_group=4,
  topk_group=2,
  n_shared_experts=1,
  routed_scaling_factor=2.5,
  q_lora_rank=32,
  kv_lora_rank=16,
  qk_nope_head_dim=16,
  qk_rope_head_dim=8,
  v_head_dim=12,
  max_position_embeddings=256,
)
TINY_GPT_OSS = dict(  # GptOssConfig arguments of a tiny GPT-OSS
  vocab_size=384,
  hidden_size=64,
  intermediate_size=48,
  num_hidden_layers=3,  # layers 0 and 2 sliding, 1 full
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  num_local_experts=4,
  num_experts_per_tok=2,
  sliding_window=5,  # shorter than the test's 24 tokens
  swiglu_limit=0.2,  # below the tiny model's gate and up values: the clamp decides the experts' output
  max_position_embeddings=64,
  rope_parameters=dict(
    rope_type="yarn",
    rope_theta=150000.0,
    factor=4.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=16,  # < SEQ: the interpolated frequencies matter
  ),
)
DEEPSEEK_YARN = dict(
  rope_type="yarn",
  rope_theta=10000.0,
  factor=4.0,
  original_max_position_embeddings=16,
  beta_fast=32,
  beta_slow=1,
  mscale=0.707,
  mscale_all_dim=0.707,
)


def tiny_hf_model(path: str, architecture: str, config_class: str, settings: dict, eager: bool = False):
  """A small random model of transformers' `architecture` class (its `config_class` given `settings`), saved as
  safetensors in `path`. Norms, biases, routers and DeepSeek's routing bias are moved off their initialisation
  (norms 1 or 0, the rest 0), so a swapped or dropped tensor cannot pass."""
  settings = copy.deepcopy(settings)  # the table's nested dicts (rope_parameters) are shared between rows
  config = getattr(transformers, config_class)(**settings, **({"attn_implementation": "eager"} if eager else {}))
  torch.manual_seed(0)
  model = getattr(transformers, architecture)(config).eval()
  with torch.no_grad():
    for name, param in model.named_parameters():
      if "norm" in name or "bias" in name or "gate.weight" in name or "sinks" in name:
        param.add_(0.3 * torch.randn_like(param))
    for name, buffer in model.named_buffers():
      if "e_score_correction_bias" in name:
        buffer.copy_(0.05 * torch.randn_like(buffer))
  model.save_pretrained(path)
  return model, path


def hf_gemma3(tmp_path, name="gemma3", **overrides):
  """The tiny Gemma3ForCausalLM (eager attention, norms off their init), with `overrides`."""
  settings = {**TINY_GEMMA3, **overrides}
  return tiny_hf_model(str(tmp_path / name), "Gemma3ForCausalLM", "Gemma3TextConfig", settings, eager=True)


def hf_deepseek(tmp_path, **overrides):
  """The tiny DeepseekV3ForCausalLM (eager attention; norms, router and routing bias off their init), with
  `overrides`."""
  settings = {**TINY_DEEPSEEK, **overrides}
  return tiny_hf_model(str(tmp_path / "deepseek"), "DeepseekV3ForCausalLM", "DeepseekV3Config", settings, eager=True)

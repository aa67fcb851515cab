"""Generating text with a KV cache: batched prefill, then one token per step, with MaxText's sampling strategies.

The cache lives in flax's "cache" collection, [batch, kv_heads, max_target_length, head_dim] per layer, sharded by
the logical rules. `run` is decode.py's body: load the checkpoint's parameters, tokenize the prompts, generate.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import partitioning as nn_partitioning

from MaxLite import config as config_lib
from MaxLite import storage
from MaxLite.checkpoint import lora_steps, run_tokenizer
from MaxLite.checkpoint import manager as checkpointing
from MaxLite.cli.errors import ConfigError
from MaxLite.config import objectives
from MaxLite.data.chat import ChatTemplate
from MaxLite.data.tokenizer import continuation_text, load_tokenizer
from MaxLite.models import build, sampling
from MaxLite.parallel import sharding
from MaxLite.parallel.mesh import create_mesh
from MaxLite.storage.layout import step_numbers

PROMPT_SEPARATOR = " ||| "


def sample(logits: jax.Array, rng: jax.Array, config: Any) -> jax.Array:
  """Next token ids [batch] from last-position logits [batch, vocab]."""
  logits = logits.astype(jnp.float32)
  if config.decode_sampling_strategy == "greedy":
    return jnp.argmax(logits, axis=-1)
  logits = logits / config.decode_sampling_temperature
  if config.decode_sampling_strategy == "topk":
    logits = sampling.top_k_logits(logits, config.decode_sampling_top_k)
  elif config.decode_sampling_strategy == "nucleus":
    logits = sampling.top_p_logits(logits, config.decode_sampling_nucleus_p)
  return jax.random.categorical(rng, logits, axis=-1)


def check_cache_fits(config: Any) -> None:
  """The prompt and the new tokens must fit the KV cache, whose length is max_target_length."""
  if config.max_prefill_predict_length + config.max_decode_steps > config.max_target_length:
    raise ConfigError(
      f"max_prefill_predict_length={config.max_prefill_predict_length} + max_decode_steps={config.max_decode_steps} "
      f"exceeds max_target_length={config.max_target_length} (the KV cache length)"
    )


def fit_prompt(tokens: Sequence[int], limit: int, keep_first: bool) -> list[int]:
  """The prompt cut to its last `limit` tokens; with `keep_first` its first token (BOS) stays at position 0, where
  the model always saw it in training."""
  if len(tokens) <= limit:
    return list(tokens)
  head = list(tokens[:1]) if keep_first else []
  return head + list(tokens[len(tokens) - (limit - len(head)) :])


def generate(
  config: Any, params: Any, prompts: Sequence[Sequence[int]], eos_id: int | None = None, return_logits: bool = False
) -> tuple[list[list[int]], list[np.ndarray]]:
  """Token ids of each prompt's continuation (stopping after eos_id), and optionally each step's logits."""
  check_cache_fits(config)
  prefill_len = config.max_prefill_predict_length
  for row, prompt in enumerate(prompts):
    if len(prompt) > prefill_len:
      print(
        f"warning: prompt [{row}] is {len(prompt)} tokens, longer than max_prefill_predict_length={prefill_len}: "
        f"the model sees only its last {prefill_len}",
        file=sys.stderr,
      )
  prompts = [fit_prompt(p, prefill_len, keep_first=False) for p in prompts]
  if not all(prompts):
    raise ConfigError("every prompt needs at least one token")
  ids = np.zeros((len(prompts), prefill_len), np.int32)
  for row, prompt in enumerate(prompts):
    ids[row, : len(prompt)] = prompt
  lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
  model = build.model(config, decode=True, stored=False)  # LoRA's adapters come merged into the weights
  prefill = jax.jit(functools.partial(sampling.prefill, model=model))
  rules = sharding.decode_axis_rules(config)
  step = sharding.traced_under(rules, jax.jit(functools.partial(sampling.decode_step, model=model), donate_argnums=1))
  logits, cache = sharding.traced_under(rules, prefill)(params, jnp.asarray(ids), lengths)
  rng = jax.random.key(config.decode_seed)
  outputs: list[list[int]] = [[] for _ in prompts]
  done = np.zeros(len(prompts), bool)
  all_logits = []
  for i in range(config.max_decode_steps):
    if return_logits:
      all_logits.append(np.asarray(logits))
    tokens = sample(logits, jax.random.fold_in(rng, i), config)
    for row, token in enumerate(np.asarray(tokens).tolist()):
      if not done[row]:
        outputs[row].append(token)
        done[row] = token == eos_id
    if done.all() or i == config.max_decode_steps - 1:
      break
    logits, cache = step(params, cache, tokens.astype(jnp.int32), lengths + i)
  return outputs, all_logits


def load_params(config: Any, mesh: Any) -> Any:
  """The checkpoint's params placed by the logical rules, or a random init when no path is given. A LoRA step comes
  with its adapters merged (checkpoint/lora_steps.py); with enable_lora, a PEFT adapter (hf_lora_adapter_path) is
  merged into the loaded base the same way."""
  params = build.parameters(config, mesh, stored=False)
  if not config.load_parameters_path:
    print("warning: no load_parameters_path: decoding with randomly initialised weights", file=sys.stderr)
    return build.random_parameters(config, params)
  target = checkpointing.sharded_target(params.abstract, params.shardings)
  loaded = lora_steps.load_params(config.load_parameters_path, target, config.ensemble_member)
  if not (config.enable_lora and config.hf_lora_adapter_path):
    return loaded
  from MaxLite.checkpoint import lora_peft
  from MaxLite.layers import lora

  abstract_adapters, _ = lora.split(build.parameters(config, mesh).abstract)
  adapters = lora_peft.read_adapter(config.hf_lora_adapter_path, config, abstract_adapters)
  merge = jax.jit(lambda b, a: lora.merged(b, a, lora.scale(config)), out_shardings=params.shardings)
  return merge(loaded, adapters)


def _fit_prompts(config: Any, tokenizer: Any, texts: Sequence[str]) -> tuple[list[list[int]], list[str]]:
  """Each prompt's tokens as the model gets them, and its text as the output shows it: a prompt cut to
  max_prefill_predict_length is shown as what the model saw, after "…", with a warning naming both lengths."""
  limit, bos = config.max_prefill_predict_length, tokenizer.bos_id
  head = [bos] if config.add_bos and bos >= 0 else []
  prompts, shown = [], []
  for row, text in enumerate(texts):
    tokens = head + tokenizer.encode(text)
    fitted = fit_prompt(tokens, limit, keep_first=bool(head))
    if len(fitted) < len(tokens):
      print(
        f"warning: prompt [{row}] is {len(tokens)} tokens, longer than max_prefill_predict_length={limit}: the model "
        f"sees only its last {len(fitted) - len(head)}{' after BOS' if head else ''}, shown after '…' (raise "
        "max_prefill_predict_length, with max_decode_steps within max_target_length, to keep it whole)",
        file=sys.stderr,
      )
      text = "…" + tokenizer.decode(fitted[len(head) :])
    prompts.append(fitted)
    shown.append(text)
  return prompts, shown


def chat_messages(prompt: str) -> list[dict[str, str]]:
  """A decode prompt as chat messages: a JSON list of {"role", "content"} objects as given, any other text as one
  user turn."""
  if prompt.lstrip().startswith("["):
    try:
      messages = json.loads(prompt)
    except json.JSONDecodeError as e:
      raise ConfigError(f"prompt starts with '[' but is not a JSON list of messages ({e})") from None
    if not (
      isinstance(messages, list) and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages)
    ):
      raise ConfigError('prompt: a JSON list of messages holds {"role": ..., "content": ...} objects')
    return messages
  return [{"role": "user", "content": prompt}]


def chat_prompt_ids(tokenizer: Any, template: ChatTemplate, prompt: str) -> list[int]:
  """The prompt's ids as a chat model reads them: its messages rendered by the template with the assistant's turn
  opened (apply_chat_template(..., add_generation_prompt=True)); the template writes its own special tokens."""
  return tokenizer.encode(template.render(chat_messages(prompt), add_generation_prompt=True))


def _quoted(text: str) -> str:
  """Text as one JSON string: its first and last characters (a leading space, a trailing newline) are visible, and a
  multi-line text stays on its labeled line."""
  return json.dumps(text, ensure_ascii=False)


def _run_checkpoint(argv: Sequence[str], raw: dict[str, Any]) -> dict[str, Any]:
  """`decode.py CONFIG run_name=R [base_output_directory=D]` without load_parameters_path decodes R's newest complete
  checkpoint, the one its training would resume; a run with none is one error line, not random weights."""
  if raw["load_parameters_path"] or "run_name" not in raw["explicit_keys"] or not raw["run_name"]:
    return raw
  folder = storage.join(storage.join(storage.absolute(raw["base_output_directory"]), raw["run_name"]), "checkpoints")
  steps = step_numbers(folder) if storage.isdir(folder) else []
  if not steps:
    raise ConfigError(
      f"run_name={raw['run_name']}: no complete checkpoint in {folder} to decode; name one with "
      "load_parameters_path=STEP_DIR (or leave run_name out to decode random weights)"
    )
  step_dir = storage.join(folder, str(steps[-1]))
  print(f"decoding run_name={raw['run_name']}'s newest checkpoint: {step_dir}", file=sys.stderr)
  return config_lib.load_raw([*argv, f"load_parameters_path={step_dir}"])


def run(argv: Sequence[str]) -> list[str]:
  """decode.py: prints each prompt (with chat templates, each message) and its completion on labeled lines,
  `[i] prompt: "..."` then `[i] completion: "..."` (chat: `[i] user: "..."` ... `[i] assistant: "..."`), texts as
  JSON strings; returns the completions."""
  raw = _run_checkpoint(argv, config_lib.load_raw(argv))
  # The tokenizer comes with the checkpoint as the model keys do (unless the command line or config file names one).
  origin = run_tokenizer.take_from_checkpoint(raw)
  if origin:
    logging.info(
      "tokenizer %s: tokenizer_type=%s tokenizer_path=%s", origin, raw["tokenizer_type"], raw["tokenizer_path"]
    )
  texts = raw["prompt"].split(PROMPT_SEPARATOR)
  # The batch is the prompts; the mesh splits it like a training batch.
  raw["per_device_batch_size"] = len(texts) / jax.device_count()
  # A chat template renders the prompts here. An objective that reads plain text refuses it (it is about training
  # data there), so it is taken out of the config; one that reads records (a fine-tuning command reused) keeps it.
  chat = raw["use_chat_template"]
  if chat and raw["tokenizer_type"] != "huggingface":
    raise ConfigError(
      f"use_chat_template=true needs tokenizer_type=huggingface (a tokenizer.json directory with its chat template), "
      f"got {raw['tokenizer_type']!r}"
    )
  if not objectives.select(raw).reads_records:
    raw["use_chat_template"] = False
  config = config_lib.build(raw)
  if config.num_pipeline_stages > 1:
    raise ConfigError("decode.py does not pipeline; set ici/dcn_pipeline_parallelism=1")
  check_cache_fits(config)  # before a checkpoint is read
  tokenizer = load_tokenizer(storage.resolve(config.tokenizer_path), config.tokenizer_type)
  run_tokenizer.check_vocabulary(tokenizer, config, origin)  # before a checkpoint is read
  eos = tokenizer.eos_id  # a chat tokenizer's is its end-of-turn token (Qwen's <|im_end|>)
  mesh = create_mesh(config)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding.axis_rules(config)):
    params = load_params(config, mesh)
    if chat:
      template = ChatTemplate.load(storage.resolve(config.tokenizer_path), config.chat_template_path)
      # generate() keeps a long conversation's last max_prefill_predict_length tokens and warns.
      prompts = [chat_prompt_ids(tokenizer, template, text) for text in texts]
      shown = [[(m["role"], str(m["content"])) for m in chat_messages(text)] for text in texts]
    else:
      prompts, texts = _fit_prompts(config, tokenizer, texts)
      shown = [[("prompt", text)] for text in texts]
    outputs, _ = generate(config, params, prompts, eos_id=eos if eos >= 0 else None)
  # Ids past the tokenizer's vocabulary (a model's padded embedding rows, e.g. Qwen's) have no text.
  completions = [
    continuation_text(tokenizer, prompt, [t for t in out if t != eos and t < tokenizer.vocab_size])
    for prompt, out in zip(prompts, outputs)
  ]
  for i, (lines, completion) in enumerate(zip(shown, completions)):
    for label, text in lines:
      print(f"[{i}] {label}: {_quoted(text)}")
    print(f"[{i}] {'assistant' if chat else 'completion'}: {_quoted(completion)}", flush=True)
  return completions

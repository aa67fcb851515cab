"""Validation of a merged config across its groups, and the values derived from it.

A key's own bounds sit on its Field (gt/ge/lt/le: `schema.check_range`) and a group's checks among its own keys are
that group's model validator (keys_model.py, keys_train.py, keys_job.py); here are the checks that join several
groups or need the devices (the mesh against the model, emergency checkpoints, vocab slices, GRPO's batch) and the
derived values' math.
Every check raises ConfigError with one line naming the keys involved and what would be valid. Derived keys are added
to the returned dict; they are not settable from YAML or the command line.
"""

from __future__ import annotations

import datetime
import math
import re
import types
from collections.abc import Sequence
from typing import Any

from MaxLite import storage
from MaxLite.cli.errors import ConfigError
from MaxLite.config import attention_choice, ensembles, families, post_training, schema
from MaxLite.config.choices import (
  AXIS_KEY,
  LORA_DEFAULT_MODULES,
  MESH_AXES,
)


def default_run_name() -> str:
  """`run_name=""` becomes the start time; a multi-process job picks it once and shares it."""
  return datetime.datetime.now().strftime("maxlite_%Y%m%d_%H%M%S")


def resolve_parallelism(prefix: str, values: dict[str, int], total: int, what: str) -> dict[str, int]:
  """Fill the single -1 in {axis: size} so the product equals `total`."""
  keys = {axis: f"{prefix}_{AXIS_KEY[axis]}_parallelism" for axis in values}
  for axis, value in values.items():
    if value == 0 or value < -1:
      raise ConfigError(f"{keys[axis]} must be a positive integer or -1, got {value}")
  fill = [a for a, v in values.items() if v == -1]
  if len(fill) > 1:
    raise ConfigError(f"at most one {prefix}_*_parallelism may be -1, got {', '.join(keys[a] for a in fill)}")
  known = math.prod(v for v in values.values() if v != -1)
  shown = " x ".join(f"{keys[a]}={v}" for a, v in values.items() if v != 1) or "all 1"
  if fill:
    if total % known:
      raise ConfigError(f"{prefix}_*_parallelism ({shown}) cannot fill {total} {what}: {known} does not divide {total}")
    return {a: (total // known if v == -1 else v) for a, v in values.items()}
  if known != total:
    raise ConfigError(
      f"{prefix}_*_parallelism product is {known} ({shown}) but there are {total} {what}; "
      f"make the product {total} or set one of them to -1"
    )
  return dict(values)


def _device_counts(num_devices: int | None, num_slices: int | None, process_count: int | None) -> tuple[int, int, int]:
  if num_devices is None or num_slices is None or process_count is None:
    import jax

    devices = jax.devices()
    num_devices = len(devices) if num_devices is None else num_devices
    process_count = jax.process_count() if process_count is None else process_count
    if num_slices is None:
      num_slices = len({getattr(d, "slice_index", 0) for d in devices})
  return num_devices, num_slices, process_count


def rule_mesh_axes(rules: Sequence[Sequence[Any]], logical: str) -> tuple[str, ...]:
  """Mesh axes the first rule for `logical` maps it to (() when no rule names it)."""
  for name, axes in rules:
    if name == logical:
      return tuple([axes] if isinstance(axes, str) else axes or ())
  return ()


def _activation_shards(rules: Sequence[Sequence[Any]], logical: str, mesh: dict[str, int]) -> int:
  """How many ways the logical activation axis `logical` is split under `rules` on this mesh."""
  return math.prod(mesh[a] for a in rule_mesh_axes(rules, logical))


def _check_choices(c: dict[str, Any]) -> None:
  """Every key with a closed set of values (its Literal in the schema) holds one of them, defaults and values set in
  code included (a value set in a file was checked as read); decoder_block's set is the family registry."""
  closed = {key: schema.allowed_values(key) for key in schema.FIELDS if schema.allowed_values(key) is not None}
  closed["decoder_block"] = families.decoder_blocks()
  for key, choices in closed.items():
    if c[key] not in choices:
      raise schema.not_one_of(key, c[key], choices)
  if list(c["mlp_activations"]) not in (["silu", "linear"], ["gelu", "linear"]):
    raise ConfigError(
      f"mlp_activations={c['mlp_activations']} is not supported; use ['silu', 'linear'] (SwiGLU) or "
      "['gelu', 'linear'] (GeGLU)"
    )
  for rule in c["logical_axis_rules"]:
    if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ConfigError(f"logical_axis_rules entry {rule!r} must be [logical_name, mesh_axis or list of mesh axes]")
    axes = [rule[1]] if isinstance(rule[1], str) else (rule[1] or [])
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown:
      raise ConfigError(
        f"logical_axis_rules: {rule[0]!r} maps to unknown mesh axis {unknown[0]!r}; "
        f"mesh axes are {', '.join(MESH_AXES)}"
      )


def _check_lora_with_others(c: dict[str, Any]) -> None:
  """How LoRA meets the other groups (the Lora group's own checks are its model validator)."""
  if not c["enable_lora"]:
    return
  if c["quantization"]:
    raise ConfigError(
      f"enable_lora=true with quantization={c['quantization']}: the frozen base is quantized with lora_weight_qtype "
      "(QLoRA); quantized training of the adapters is not supported"
    )
  if c["enable_emergency_checkpoint"]:
    raise ConfigError("enable_lora=true with enable_emergency_checkpoint=true is not supported: use orbax checkpoints")


def qlora_contractions(c: dict[str, Any]) -> list[tuple[str, str, int]]:
  """(module path, size's key, size) of every projection LoRA can adapt: the innermost dimension its matmul contracts
  in the kernel's own shape (the one QLoRA multiplies with), the axis Qwix quantizes in tiles of lora_tile_size.
  Paths as Qwix matches lora_module_path against them: decoder/<stack>/... scanned, decoder/<stack>_<i>/...
  unrolled, and also the bare layer's when pipelined (each stage applies its layers as modules of their own)."""
  emb = ("base_emb_dim", c["base_emb_dim"])
  if c["attention_type"] == "mla":
    attention = (
      [("wq_a", *emb), ("wq_b", "q_lora_rank", c["q_lora_rank"])] if c["q_lora_rank"] > 0 else [("query", *emb)]
    )
    attention += [("wkv_a", *emb), ("wkv_b", "kv_lora_rank", c["kv_lora_rank"]), ("out", "v_head_dim", c["v_head_dim"])]
  else:
    attention = [("qkv_proj", *emb)] if c["fused_qkv"] else [(n, *emb) for n in ("query", "key", "value")]
    attention.append(("out", "head_dim", c["head_dim"]))
  modules = [(f"self_attention/{name}", key, size) for name, key, size in attention]
  dense = [(f"mlp/{n}", *emb) for n in (("wi",) if c["fused_mlp"] else ("wi_0", "wi_1"))]
  dense.append(("mlp/wo", "base_mlp_dim", c["base_mlp_dim"]))
  shared = []
  if c["shared_experts"] > 0:  # only families that build shared experts accept the key (their checks)
    shared = [(f"shared_experts/{n}", *emb) for n in ("wi_0", "wi_1")]
    shared.append(("shared_experts/wo", "shared_experts x moe_mlp_dim", c["shared_experts"] * moe_mlp_dim(c)))
  pipelined = c["ici_pipeline_parallelism"] != 1 or c["dcn_pipeline_parallelism"] != 1
  out = [] if c["logits_via_embedding"] else [("logits_dense", *emb)]
  for stack in families.family(c["decoder_block"]).stacks(types.SimpleNamespace(**c)):
    moe = stack.options.get("moe", c["num_experts"] > 1)
    prefixes = (
      [f"decoder/{stack.name}/"] if c["scan_layers"] else [f"decoder/{stack.name}_{j}/" for j in range(stack.count)]
    )
    for module, key, size in modules + (shared if moe else dense):
      out += [(f"{prefix}{module}", key, size) for prefix in prefixes + ([""] if pipelined else [])]
  return out


def _check_qlora_tiles(c: dict[str, Any]) -> None:
  """Qwix quantizes each QLoRA kernel in tiles of lora_tile_size along its innermost contracted dimension, and a
  tile that does not divide it ends in a traceback deep in the first matmul: named here instead."""
  tile = c["lora_tile_size"]
  if not (c["enable_lora"] and c["lora_weight_qtype"] and tile > 0):
    return
  pattern = c["lora_module_path"] or LORA_DEFAULT_MODULES
  adapted = [(path, key, size) for path, key, size in qlora_contractions(c) if re.fullmatch(pattern, path)]
  for path, key, size in adapted:
    if size % tile:
      fits = math.gcd(*(s for _, _, s in adapted))
      raise ConfigError(
        f"lora_tile_size={tile} must divide {key}={size}, the dimension {path} contracts (QLoRA quantizes its kernel "
        f"in tiles along it): use a divisor of {fits} (it divides every adapted projection's), or 0 for one scale a "
        "channel"
      )


def _check_segments(c: dict[str, Any]) -> None:
  segments = c["max_segments_per_seq"]
  if segments == 0 or segments < -1 or (c["use_dpo"] and segments == 1):
    least = 2 if c["use_dpo"] else 1
    raise ConfigError(
      f"max_segments_per_seq={segments} must be -1 (no cap) or >= {least}"
      + (" (a DPO pair is two documents in one row)" if c["use_dpo"] else "")
    )


def _check_model_vs_mesh(c: dict[str, Any], mesh: dict[str, int]) -> None:
  q, kv = c["base_num_query_heads"], c["base_num_kv_heads"]
  if q % kv:
    raise ConfigError(f"base_num_kv_heads={kv} must divide base_num_query_heads={q} (GQA groups must be whole)")
  tp = mesh["tensor"]
  for key in ("base_num_query_heads", "base_num_kv_heads"):
    if c[key] % tp:
      raise ConfigError(
        f"{key}={c[key]} is not divisible by tensor parallelism {tp} (ici_tensor_parallelism x dcn_tensor_parallelism)"
      )
  if c["max_target_length"] % mesh["sequence"]:
    raise ConfigError(
      f"max_target_length={c['max_target_length']} is not divisible by sequence parallelism {mesh['sequence']}"
    )
  stages, layers = mesh["stage"], c["base_num_decoder_layers"]
  if layers % stages:
    raise ConfigError(
      f"base_num_decoder_layers={layers} is not divisible by pipeline parallelism {stages} "
      "(ici_pipeline_parallelism x dcn_pipeline_parallelism); each stage needs the same number of layers"
    )
  if stages > 1 and not c["scan_layers"]:
    raise ConfigError(f"pipeline parallelism {stages} needs scan_layers=true (stages are slices of the scanned layers)")
  experts, top_k = c["num_experts"], c["num_experts_per_tok"]
  if experts < 1:
    raise ConfigError(f"num_experts must be >= 1 (1 = dense MLP), got {experts}")
  if experts > 1 and not 1 <= top_k <= experts:
    raise ConfigError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={experts}")
  if experts > 1 and experts % mesh["expert"]:
    raise ConfigError(
      f"num_experts={experts} is not divisible by expert parallelism {mesh['expert']} "
      "(ici_expert_parallelism x dcn_expert_parallelism)"
    )


def _check_megablox(c: dict[str, Any], platform: str) -> bool:
  """megablox as this run uses it: base.yml's default (true, MaxText's) means the TPU kernel where it runs and
  jax.lax.ragged_dot on a GPU; set explicitly on a GPU it is refused."""
  if not (c["megablox"] and c["sparse_matmul"]) or c["num_experts"] == 1:
    return c["megablox"]
  if platform not in ("tpu", "cpu"):
    if "megablox" not in c.get("explicit_keys", ()):
      return False
    raise ConfigError(
      f"megablox=true is a TPU kernel (interpreted on CPU for tests); this run's devices are {platform}: "
      "use megablox=false (jax.lax.ragged_dot)"
    )
  return True


def _check_vocab_tiling(c: dict[str, Any], sequence_shards: int) -> None:
  n = c["num_vocab_tiling"]
  if n > 1 and c["final_logits_soft_cap"] > 0:
    raise ConfigError(f"final_logits_soft_cap > 0 needs num_vocab_tiling=1, got {n} (the cap is on whole logits)")
  if n > 1 and c["max_target_length"] % (n * sequence_shards):
    raise ConfigError(
      f"num_vocab_tiling={n} must divide max_target_length={c['max_target_length']} / sequence parallelism "
      f"{sequence_shards} (each chunk takes every {n}-th token of every sequence shard)"
    )


# Above this many bytes of logits per device the head and its loss work a vocabulary slice at a time (auto):
# on a pod slice the head's whole weights, its logits, their gradient and the head's unreduced weight gradient are
# then 1/n as large. MaxText's v5e 32B recipe (500 MiB of bfloat16 logits per chip) drops from 16.33 to 15.13 GiB.
AUTO_SLICE_LOGITS_BYTES = 256 * 2**20


def _vocab_slices(c: dict[str, Any], micro_batch: int, num_devices: int) -> int:
  """num_vocab_slices resolved; -1 = the fewest power-of-2 slices with at most AUTO_SLICE_LOGITS_BYTES of logits."""
  n, vocab = c["num_vocab_slices"], c["vocab_size"]
  if n == -1:
    if c["num_vocab_tiling"] > 1 or c["use_dpo"] or c["final_logits_soft_cap"] > 0:
      return 1
    float32 = c["logits_dot_in_fp32"] or c["dtype"] == "float32"
    # An ensemble's devices hold every member's logits.
    rows = micro_batch * c["ensemble_size"]
    logits_bytes = rows * c["max_target_length"] * vocab * (4 if float32 else 2) / num_devices
    n = 1
    while logits_bytes / n > AUTO_SLICE_LOGITS_BYTES and vocab % (2 * n) == 0:
      n *= 2
    return n
  if n < 1 or vocab % n:
    raise ConfigError(f"num_vocab_slices={n} must be -1 (auto) or a positive divisor of vocab_size={vocab}")
  if n > 1 and c["num_vocab_tiling"] > 1:
    raise ConfigError(
      f"num_vocab_slices={n} and num_vocab_tiling={c['num_vocab_tiling']} split the logits two ways; "
      "set one of them to 1"
    )
  if n > 1 and c["final_logits_soft_cap"] > 0:
    raise ConfigError(f"final_logits_soft_cap > 0 needs num_vocab_slices=1 or -1, got {n} (the cap is on whole logits)")
  if n > 1 and c["use_dpo"]:
    raise ConfigError(f"use_dpo=true needs num_vocab_slices=1 or -1, got {n} (DPO sums log-probabilities per response)")
  return n


def _mlp_chunks(c: dict[str, Any], sequence_shards: int) -> int:
  n, seq = c["num_mlp_chunks"], c["max_target_length"]
  if n < 1 or seq % (n * sequence_shards):
    raise ConfigError(
      f"num_mlp_chunks={n} must be a positive number that divides max_target_length={seq} / "
      f"sequence parallelism {sequence_shards} (each part is 1/{n} of every sequence shard)"
    )
  return n


def _pipeline_microbatches(c: dict[str, Any], stages: int, micro_batch: int, batch_shards: int) -> int:
  n = c["num_pipeline_microbatches"]
  if n == -1:
    n = stages
  if n <= 0:
    raise ConfigError(f"num_pipeline_microbatches must be positive or -1 (= number of stages), got {n}")
  if stages > 1 and (micro_batch % n or (micro_batch // n) % batch_shards):
    raise ConfigError(
      f"batch {micro_batch} cannot be split into num_pipeline_microbatches={n} microbatches that "
      f"each divide over the {batch_shards} batch shards; use a multiple of {n * batch_shards}"
    )
  return n


def _check_model_features(c: dict[str, Any]) -> None:
  families.family(c["decoder_block"]).check(c)
  if c["fused_mlp"] and c["num_experts"] > 1:
    raise ConfigError("fused_mlp=true fuses the dense MLP's kernels; with num_experts > 1 there is none, set it false")


def moe_mlp_dim(c: dict[str, Any]) -> int:
  return c["base_moe_mlp_dim"] if c["base_moe_mlp_dim"] > 0 else c["base_mlp_dim"]


def parameter_count(c: dict[str, Any]) -> int:
  """Exact number of parameters of the decoder, counted by its family (tested against the real model and
  transformers' own)."""
  return families.family(c["decoder_block"]).parameter_count(c)


def _check_emergency_checkpoints(c: dict[str, Any], mesh: dict[str, int]) -> None:
  if not c["enable_emergency_checkpoint"]:
    return
  if not c["enable_checkpointing"]:
    raise ConfigError("enable_emergency_checkpoint=true needs enable_checkpointing=true")
  if not c["local_checkpoint_directory"] or storage.is_url(c["local_checkpoint_directory"]):
    raise ConfigError(
      f"enable_emergency_checkpoint=true needs local_checkpoint_directory, a directory on each host's own disk "
      f"(got {c['local_checkpoint_directory']!r})"
    )
  if c["local_checkpoint_period"] <= 0:
    raise ConfigError(
      f"enable_emergency_checkpoint=true needs local_checkpoint_period > 0 (got {c['local_checkpoint_period']})"
    )
  if mesh["data"] < 2:
    raise ConfigError(
      "enable_emergency_checkpoint=true needs at least 2 data-parallel replicas on the data axis (each "
      "restores the others' local checkpoints); set dcn_data_parallelism or ici_data_parallelism >= 2"
    )


def _mesh_axes(c: dict[str, Any], num_devices: int, detected_slices: int) -> tuple[int, dict, dict]:
  """(slices, ici sizes, dcn sizes) per mesh axis, the -1 entries filled in."""
  dcn = {a: c[f"dcn_{AXIS_KEY[a]}_parallelism"] for a in MESH_AXES}
  slices = c["num_slices"]
  if slices == -1:
    slices = detected_slices if detected_slices > 1 or -1 in dcn.values() else math.prod(dcn.values())
  if slices <= 0 or num_devices % slices:
    raise ConfigError(f"num_slices={slices} must be positive and divide the {num_devices} devices")
  dcn = resolve_parallelism("dcn", dcn, slices, "slices")
  ici = resolve_parallelism(
    "ici", {a: c[f"ici_{AXIS_KEY[a]}_parallelism"] for a in MESH_AXES}, num_devices // slices, "devices per slice"
  )
  return slices, ici, dcn


def _micro_batch(c: dict[str, Any], num_devices: int, mesh: dict[str, int]) -> tuple[int, tuple, int]:
  """(sequences per microbatch, the mesh axes the batch is split on, their product). An ensemble's devices are
  shared by its members: each member's batch is per_device_batch_size on each of the devices it spans."""
  devices = num_devices // mesh["ensemble"]
  micro_batch = c["per_device_batch_size"] * devices
  if not float(micro_batch).is_integer() or micro_batch < 1:
    raise ConfigError(
      f"per_device_batch_size={c['per_device_batch_size']} x {devices} devices = {micro_batch} "
      "is not a whole number of sequences"
    )
  micro_batch = int(micro_batch)
  batch_axes = rule_mesh_axes(c["logical_axis_rules"], "activation_batch")
  batch_shards = math.prod(mesh[a] for a in batch_axes)
  if micro_batch % batch_shards:
    raise ConfigError(
      f"batch {micro_batch} (per_device_batch_size={c['per_device_batch_size']} x "
      f"{devices} devices) is not divisible by the {batch_shards} batch shards "
      f"({' x '.join(f'{a}={mesh[a]}' for a in batch_axes)})"
    )
  return micro_batch, batch_axes, batch_shards


def _check_grpo_batch(c: dict[str, Any], mesh: dict[str, int], global_batch: int) -> None:
  """A GRPO batch is whole groups of num_generations completions, sampled on the training mesh (no pipeline)."""
  if not c["use_grpo"]:
    return
  if global_batch % c["num_generations"]:
    raise ConfigError(
      f"use_grpo=true: the global batch of {global_batch} completions (per_device_batch_size x devices x "
      f"gradient_accumulation_steps) is not a multiple of num_generations={c['num_generations']}"
    )
  if mesh["stage"] > 1:
    raise ConfigError(
      "use_grpo=true samples with the KV-cache decoder, which does not pipeline: set ici/dcn_pipeline_parallelism=1"
    )


def validate_and_derive(
  c: dict[str, Any],
  *,
  num_devices: int | None = None,
  num_slices: int | None = None,
  process_count: int | None = None,
  platform: str | None = None,
) -> dict[str, Any]:
  """`platform` (cpu, tpu, gpu) decides what attention=autoselected means; None = this process's jax backend."""
  c = dict(c)
  _check_choices(c)
  # Each key's bounds (its Field's; values set in a file were checked as read), then each group's own checks (its
  # model validator, beside its keys).
  schema.check_cross_keys(c)
  _check_lora_with_others(c)
  c.update(post_training.derive(c))
  _check_segments(c)
  _check_model_features(c)
  _check_qlora_tiles(c)
  c.update(ensembles.check(c))
  num_devices, detected_slices, process_count = _device_counts(num_devices, num_slices, process_count)
  slices, ici, dcn = _mesh_axes(c, num_devices, detected_slices)
  mesh = {a: ici[a] * dcn[a] for a in MESH_AXES}
  _check_model_vs_mesh(c, mesh)
  _check_emergency_checkpoints(c, mesh)
  ensembles.check_mesh(c, mesh)
  micro_batch, batch_axes, batch_shards = _micro_batch(c, num_devices, mesh)
  microbatches = _pipeline_microbatches(c, mesh["stage"], micro_batch, batch_shards)
  _check_grpo_batch(c, mesh, micro_batch * c["gradient_accumulation_steps"])
  gpu_capability = ""
  if platform is None:
    import jax

    platform = jax.default_backend()
    if platform in ("gpu", "cuda"):
      gpu_capability = getattr(jax.devices()[0], "compute_capability", "")
  sequence_shards = _activation_shards(c["logical_axis_rules"], "activation_length", mesh)
  head_shards = _activation_shards(c["logical_axis_rules"], "activation_heads", mesh)
  kernel, kernel_reason = attention_choice.choose_attention(c, platform, sequence_shards, head_shards, gpu_capability)
  max_segments, attention_segments = attention_choice.segments_per_row(c, kernel)
  _check_vocab_tiling(c, sequence_shards)
  c["megablox"] = _check_megablox(c, platform)

  run_name = c["run_name"] or default_run_name()
  run_dir = storage.join(storage.absolute(c["base_output_directory"]), run_name)
  # A GRPO step makes num_iterations optimizer updates on its batch of completions.
  updates = c["steps"] * (c["num_iterations"] if c["use_grpo"] else 1)
  schedule_steps = updates if c["learning_rate_schedule_steps"] == -1 else c["learning_rate_schedule_steps"]
  c.update(
    run_name=run_name,
    learning_rate_schedule_steps=schedule_steps,
    num_devices=num_devices,
    num_slices=slices,
    process_count=process_count,
    ici_mesh_shape=[ici[a] for a in MESH_AXES],
    dcn_mesh_shape=[dcn[a] for a in MESH_AXES],
    mesh_shape=[mesh[a] for a in MESH_AXES],
    batch_mesh_axes=list(batch_axes),
    num_pipeline_stages=mesh["stage"],
    num_pipeline_microbatches=microbatches,
    # One optimizer step sees gradient_accumulation_steps microbatches of micro_batch_size each.
    micro_batch_size=micro_batch,
    global_batch_size_to_train_on=micro_batch * c["gradient_accumulation_steps"],
    # Rows the input pipeline reads per step: with ensemble_data=distinct every member gets a batch of its own.
    global_batch_size_to_load=micro_batch
    * c["gradient_accumulation_steps"]
    * (c["ensemble_size"] if c["ensemble_data"] == "distinct" else 1),
    run_dir=run_dir,
    tensorboard_dir=storage.join(run_dir, "tensorboard"),
    checkpoint_dir=storage.join(run_dir, "checkpoints"),
    metrics_file=storage.join(run_dir, "metrics.jsonl"),
    vocab_slices=_vocab_slices(c, micro_batch, num_devices),
    mlp_chunks=_mlp_chunks(c, sequence_shards),
    sequence_shards=sequence_shards,  # how many pieces activation_length is split into
    activation_batch_shards=_activation_shards(c["logical_axis_rules"], "activation_batch", mesh),
    num_params=parameter_count(c),
    moe_mlp_dim=moe_mlp_dim(c),
    attention_kernel=kernel,
    attention_choice=kernel_reason,
    max_segments_per_seq=max_segments,
    attention_segments=attention_segments,
    # Off TPU the splash kernel runs in Pallas interpret mode (same numerics, for tests and CPU runs).
    attention_interpret=kernel == "splash" and platform != "tpu",
    megablox_interpret=c["megablox"] and platform != "tpu",  # Pallas interpret mode: same numerics, slower
  )
  return c

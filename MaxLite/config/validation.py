"""Validation of a merged config across its groups, then its derived values.

A key's own bounds sit on its Field (gt/ge/lt/le: `schema.check_range`) and a group's checks among its own keys are
that group's model validator (keys_model.py, keys_train.py, keys_job.py); here are the checks that join several
groups or need the devices (the mesh against the model, emergency checkpoints, vocab tiling, GRPO's batch). The
derived values are `keys_derived.Derived`'s computed fields, with their math.
Every check raises ConfigError with one line naming the keys involved and what would be valid. Derived keys are added
to the returned dict; they are not settable from YAML or the command line.
"""

from __future__ import annotations

import math
import re
import types
from typing import Any

from MaxLite import storage
from MaxLite.cli.errors import ConfigError
from MaxLite.config import ensembles, families, objectives, schema
from MaxLite.config.choices import LORA_DEFAULT_MODULES, MESH_AXES
from MaxLite.config.keys_derived import Derived, Devices, moe_mlp_dim


def _check_choices(c: dict[str, Any]) -> None:
  """Every key with a closed set of values (its Literal in the schema) holds one of them, defaults and values set in
  code included (a value set in a file was checked as read); decoder_block's set is the family registry."""
  closed = {**schema.closed_sets(), "decoder_block": families.decoder_blocks()}
  for key, choices in closed.items():
    if c[key] not in choices:
      raise schema.not_one_of(key, c[key], choices)
  computed = families.family(c["decoder_block"]).mlp_activations  # the family's gated units
  if tuple(c["mlp_activations"]) not in computed:
    raise ConfigError(
      f"mlp_activations={c['mlp_activations']} is not supported by decoder_block={c['decoder_block']}; use "
      + " or ".join(str(list(pair)) for pair in computed)
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


def _check_segments(c: dict[str, Any], objective: objectives.Objective) -> None:
  segments, least = c["max_segments_per_seq"], objective.min_segments
  if segments == 0 or segments < -1 or 0 < segments < least:
    raise ConfigError(
      f"max_segments_per_seq={segments} must be -1 (no cap) or >= {least}"
      + (f" ({objective.name} packs the {least} documents of a pair in one row)" if least > 1 else "")
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
  heads_over = tp * mesh["sequence"]
  if mesh["sequence"] > 1 and c["context_parallel_strategy"] == "ulysses" and q % heads_over:
    raise ConfigError(
      f"context_parallel_strategy=ulysses splits the query heads over tensor x context parallelism = {tp} x "
      f"{mesh['sequence']}: base_num_query_heads={q} does not divide by {heads_over} (use all_gather, or a layout "
      "whose product divides the heads)"
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


def _check_vocab_tiling(c: dict[str, Any], sequence_shards: int) -> None:
  n = c["num_vocab_tiling"]
  if n > 1 and c["final_logits_soft_cap"] > 0:
    raise ConfigError(f"final_logits_soft_cap > 0 needs num_vocab_tiling=1, got {n} (the cap is on whole logits)")
  if n > 1 and c["max_target_length"] % (n * sequence_shards):
    raise ConfigError(
      f"num_vocab_tiling={n} must divide max_target_length={c['max_target_length']} / sequence parallelism "
      f"{sequence_shards} (each chunk takes every {n}-th token of every sequence shard)"
    )


def _check_family_keys(c: dict[str, Any]) -> None:
  """A key group a family declares for itself (its `decoder_blocks` ClassVar) set away from its defaults under another
  family is one line: that family would silently not compute it."""
  for group in schema.GROUPS:
    owners = getattr(group, "decoder_blocks", None)
    if not owners or c["decoder_block"] in owners:
      continue
    for key, field in group.model_fields.items():
      if c[key] != field.default:
        shown, default = (str(v).lower() if isinstance(v, bool) else v for v in (c[key], field.default))
        raise ConfigError(
          f"{key}={shown} is a key of decoder_block={' | '.join(owners)}; decoder_block={c['decoder_block']} does not "
          f"compute it (leave it at {default})"
        )


def _check_model_features(c: dict[str, Any]) -> None:
  _check_family_keys(c)
  families.family(c["decoder_block"]).check(c)
  if c["fused_mlp"] and c["num_experts"] > 1:
    raise ConfigError("fused_mlp=true fuses the dense MLP's kernels; with num_experts > 1 there is none, set it false")


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


def _devices(
  num_devices: int | None, num_slices: int | None, process_count: int | None, platform: str | None
) -> Devices:
  """The job's devices as the caller names them; what it leaves None is read from jax."""
  gpu_capability = ""
  if None in (num_devices, num_slices, process_count, platform):
    import jax

    devices = jax.devices()
    num_devices = len(devices) if num_devices is None else num_devices
    process_count = jax.process_count() if process_count is None else process_count
    if num_slices is None:
      num_slices = len({getattr(d, "slice_index", 0) for d in devices})
    if platform is None:
      platform = jax.default_backend()
      if platform in ("gpu", "cuda"):
        gpu_capability = getattr(devices[0], "compute_capability", "")
  return Devices(
    num_devices=num_devices,
    detected_slices=num_slices,
    process_count=process_count,
    platform=platform,
    gpu_capability=gpu_capability,
  )


def validate_and_derive(
  c: dict[str, Any],
  *,
  num_devices: int | None = None,
  num_slices: int | None = None,
  process_count: int | None = None,
  platform: str | None = None,
) -> dict[str, Any]:
  """The checked config with the values this run resolves and the derived keys (`keys_derived.Derived`'s computed
  fields). `platform` (cpu, tpu, gpu) decides what attention=autoselected means; None = this process's jax backend."""
  c = dict(c)
  _check_choices(c)
  # Each key's bounds (its Field's; values set in a file were checked as read), then each group's own checks (its
  # model validator, beside its keys).
  schema.check_cross_keys(c)
  _check_lora_with_others(c)
  objective = objectives.select(c)
  c.update(objective.derive(c))
  _check_segments(c, objective)
  _check_model_features(c)
  _check_qlora_tiles(c)
  c.update(ensembles.check(c))
  derived = Derived(keys=c, devices=_devices(num_devices, num_slices, process_count, platform))
  mesh = derived.mesh  # ici/dcn_*_parallelism that do not fill the devices stop here
  _check_model_vs_mesh(c, mesh)
  _check_emergency_checkpoints(c, mesh)
  ensembles.check_mesh(c, mesh)
  objective.check_mesh(c, mesh, derived.global_batch_size_to_train_on)
  _check_vocab_tiling(c, derived.sequence_shards)
  return c | derived.resolved_keys() | derived.model_dump()

"""The keys a Config holds that nobody sets, each a computed field of `Derived`: worked out from the checked settable
keys and the job's devices, with its type and description where its math is.

`validation.validate_and_derive` checks the settable keys, builds `Derived(keys=..., devices=...)`, runs the checks
that need the mesh, and returns the settable keys, the few of them this run resolves (`Derived.resolved_keys`:
run_name="" becomes a timestamp, num_slices=-1 a count, ...) and `Derived.model_dump()`. A computed value that cannot
be (ici_*_parallelism that do not fill the devices, a batch that does not split over its shards) raises the same
one-line ConfigError the check always did. `--describe mesh_shape` answers as for any key.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, computed_field

from MaxLite import storage
from MaxLite.cli.errors import ConfigError
from MaxLite.config import attention_choice, families, objectives
from MaxLite.config.choices import AXIS_KEY, MESH_AXES

AttentionKernel = Literal["dot_product", "splash", "cudnn"]
DataKind = Literal["text", "chat", "prompt_completion", "preference", "prompts"]

# Above this many bytes of logits per device the head and its loss work a vocabulary slice at a time (auto):
# on a pod slice the head's whole weights, its logits, their gradient and the head's unreduced weight gradient are
# then 1/n as large. MaxText's v5e 32B recipe (500 MiB of bfloat16 logits per chip) drops from 16.33 to 15.13 GiB.
AUTO_SLICE_LOGITS_BYTES = 256 * 2**20


def default_run_name() -> str:
  """`run_name=""` becomes the start time; a multi-process job picks it once and shares it."""
  return datetime.datetime.now().strftime("maxlite_%Y%m%d_%H%M%S")


def axis_settings(keys: Mapping[str, Any], prefix: str) -> tuple[dict[str, int], dict[str, str]]:
  """({mesh axis: size as set}, {mesh axis: the key that set it}) of the ici or dcn keys. The sequence axis has two
  names: MaxLite's {prefix}_sequence_parallelism and MaxText's {prefix}_context_parallelism; a config sets one."""
  values, names = {}, {}
  for axis in MESH_AXES:
    name = f"{prefix}_{AXIS_KEY[axis]}_parallelism"
    value = keys[name]
    alias = f"{prefix}_context_parallelism"
    if axis == "sequence" and keys.get(alias, 1) != 1:
      if value != 1:
        raise ConfigError(
          f"{alias}={keys[alias]} and {name}={value} both set the sequence axis (MaxText calls it context): set one"
        )
      name, value = alias, keys[alias]
    values[axis], names[axis] = value, name
  return values, names


def resolve_parallelism(
  prefix: str, values: dict[str, int], total: int, what: str, names: Mapping[str, str] | None = None
) -> dict[str, int]:
  """Fill the single -1 in {axis: size} so the product equals `total`; `names`: the key each axis was set by."""
  keys = {axis: (names or {}).get(axis, f"{prefix}_{AXIS_KEY[axis]}_parallelism") for axis in values}
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


def moe_mlp_dim(c: Mapping[str, Any]) -> int:
  return c["base_moe_mlp_dim"] if c["base_moe_mlp_dim"] > 0 else c["base_mlp_dim"]


def rule_mesh_axes(rules: Sequence[Sequence[Any]], logical: str) -> tuple[str, ...]:
  """Mesh axes the first rule for `logical` maps it to (() when no rule names it)."""
  for name, axes in rules:
    if name == logical:
      return tuple([axes] if isinstance(axes, str) else axes or ())
  return ()


class Devices(BaseModel):
  """What the job runs on (validation.py reads it from jax, or a caller names a machine it does not have)."""

  model_config = ConfigDict(extra="forbid", frozen=True)

  num_devices: int
  detected_slices: int
  process_count: int
  platform: str  # cpu | tpu | gpu: what attention=autoselected and megablox mean
  gpu_capability: str = ""  # "9.0"; "" when unknown or not a GPU


class Derived(BaseModel):
  """Worked out from the other keys and the devices; not settable from YAML or the command line."""

  model_config = ConfigDict(extra="forbid", frozen=True)

  keys: Mapping[str, Any] = Field(exclude=True, repr=False)  # the settable keys, checked
  devices: Devices = Field(exclude=True)

  # -- the settable keys this run resolves (their key is settable; resolved_keys() hands out the values) --

  def resolved_keys(self) -> dict[str, Any]:
    """Settable keys whose value this run works out: run_name "" -> a timestamp, num_slices -1 -> the count,
    learning_rate_schedule_steps -1 -> the updates, num_pipeline_microbatches -1 -> the stages, max_segments_per_seq
    as the attention kernel needs it, megablox as the platform runs it."""
    return {
      "run_name": self.run_name,
      "num_slices": self._slices,
      "learning_rate_schedule_steps": self._schedule_steps,
      "num_pipeline_microbatches": self._pipeline_microbatches,
      "max_segments_per_seq": self._segments[0],
      "megablox": self._megablox,
    }

  @cached_property
  def run_name(self) -> str:
    return self.keys["run_name"] or default_run_name()

  @cached_property
  def _slices(self) -> int:
    dcn = list(axis_settings(self.keys, "dcn")[0].values())
    slices, detected = self.keys["num_slices"], self.devices.detected_slices
    if slices == -1:
      slices = detected if detected > 1 or -1 in dcn else math.prod(dcn)
    if slices <= 0 or self.devices.num_devices % slices:
      raise ConfigError(f"num_slices={slices} must be positive and divide the {self.devices.num_devices} devices")
    return slices

  @cached_property
  def _schedule_steps(self) -> int:
    # A GRPO step makes num_iterations optimizer updates on its batch of completions.
    updates = self.keys["steps"] * objectives.select(self.keys).updates_per_batch(self.keys)
    return updates if self.keys["learning_rate_schedule_steps"] == -1 else self.keys["learning_rate_schedule_steps"]

  @cached_property
  def _pipeline_microbatches(self) -> int:
    n, stages, batch = self.keys["num_pipeline_microbatches"], self.num_pipeline_stages, self.micro_batch_size
    n = stages if n == -1 else n
    if n <= 0:
      raise ConfigError(f"num_pipeline_microbatches must be positive or -1 (= number of stages), got {n}")
    shards = self.activation_batch_shards
    if stages > 1 and (batch % n or (batch // n) % shards):
      raise ConfigError(
        f"batch {batch} cannot be split into num_pipeline_microbatches={n} microbatches that "
        f"each divide over the {shards} batch shards; use a multiple of {n * shards}"
      )
    return n

  @cached_property
  def _segments(self) -> tuple[int, int]:
    return attention_choice.segments_per_row(dict(self.keys), self.attention_kernel)

  @cached_property
  def _megablox(self) -> bool:
    """base.yml's default (true, MaxText's) means the TPU kernel where it runs and jax.lax.ragged_dot on a GPU; set
    explicitly on a GPU it is refused."""
    c, platform = self.keys, self.devices.platform
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

  # -- the job --

  @computed_field(description="the keys a config file, the model overlay or the command line set")
  @cached_property
  def explicit_keys(self) -> list[str]:
    return sorted(self.keys.get("explicit_keys", ()))

  @computed_field(description="the training objective, from use_sft/use_dpo (dpo_algo)/use_grpo (objectives/)")
  @cached_property
  def objective(self) -> str:
    return objectives.select(self.keys).name

  @computed_field(description="what a training record is, from the objective and the data columns")
  @cached_property
  def data_kind(self) -> DataKind:
    return objectives.select(self.keys).record_kind(self.keys)

  @computed_field(description="devices in the job (all slices)")
  @cached_property
  def num_devices(self) -> int:
    return self.devices.num_devices

  @computed_field(description="processes in the job")
  @cached_property
  def process_count(self) -> int:
    return self.devices.process_count

  # -- the mesh --

  @computed_field(description="devices per mesh axis within a slice, in choices.MESH_AXES order")
  @cached_property
  def ici_mesh_shape(self) -> list[int]:
    ici, names = axis_settings(self.keys, "ici")
    per_slice = self.devices.num_devices // self._slices
    return list(resolve_parallelism("ici", ici, per_slice, "devices per slice", names).values())

  @computed_field(description="slices per mesh axis, in choices.MESH_AXES order")
  @cached_property
  def dcn_mesh_shape(self) -> list[int]:
    dcn, names = axis_settings(self.keys, "dcn")
    return list(resolve_parallelism("dcn", dcn, self._slices, "slices", names).values())

  @computed_field(description="the whole mesh per axis: ici_mesh_shape x dcn_mesh_shape")
  @cached_property
  def mesh_shape(self) -> list[int]:
    dcn = self.dcn_mesh_shape  # the slices first: their error names num_slices and dcn_*
    return [i * d for i, d in zip(self.ici_mesh_shape, dcn)]

  @property
  def mesh(self) -> dict[str, int]:
    """{mesh axis: devices along it}."""
    return dict(zip(MESH_AXES, self.mesh_shape))

  def shards(self, logical: str) -> int:
    """How many ways the logical axis `logical` is split under logical_axis_rules on this mesh."""
    return math.prod(self.mesh[a] for a in rule_mesh_axes(self.keys["logical_axis_rules"], logical))

  @computed_field(description="the mesh axes the batch is split on (activation_batch's rule)")
  @cached_property
  def batch_mesh_axes(self) -> list[str]:
    return list(rule_mesh_axes(self.keys["logical_axis_rules"], "activation_batch"))

  @computed_field(description="pipeline stages: the mesh's stage axis")
  @cached_property
  def num_pipeline_stages(self) -> int:
    return self.mesh["stage"]

  @computed_field(description="how many pieces activation_length is split into on this mesh")
  @cached_property
  def sequence_shards(self) -> int:
    return self.shards("activation_length")

  @computed_field(
    description=(
      "the order context parallelism runs each sequence in: dual_chunk_swap or striped (parallel/context.py), or "
      '"" (no sequence split, or context_parallel_load_balance=false)'
    )
  )
  @cached_property
  def context_parallel_reorder(self) -> str:
    shards, k = self.sequence_shards, self.keys
    if shards <= 1 or not k["context_parallel_load_balance"]:
      return ""
    strategy = (
      "dual_chunk_swap" if k["context_parallel_reorder_strategy"] == "auto" else k["context_parallel_reorder_strategy"]
    )
    pieces = 2 * shards if strategy == "dual_chunk_swap" else shards
    if k["max_target_length"] % pieces:
      raise ConfigError(
        f"max_target_length={k['max_target_length']} does not split into {pieces} equal pieces for "
        f"context_parallel_load_balance ({strategy} over {shards} sequence shards): use a multiple of {pieces}, or "
        "context_parallel_load_balance=false"
      )
    return strategy

  @computed_field(description="how many pieces activation_batch is split into on this mesh")
  @cached_property
  def activation_batch_shards(self) -> int:
    return self.shards("activation_batch")

  # -- the batch --

  @computed_field(description="sequences per microbatch over all devices (per member of an ensemble)")
  @cached_property
  def micro_batch_size(self) -> int:
    # An ensemble's devices are shared by its members: each member's batch is per_device_batch_size on each of the
    # devices it spans.
    per_device = self.keys["per_device_batch_size"]
    devices = self.devices.num_devices // self.mesh["ensemble"]
    batch = per_device * devices
    if not float(batch).is_integer() or batch < 1:
      raise ConfigError(
        f"per_device_batch_size={per_device} x {devices} devices = {batch} is not a whole number of sequences"
      )
    shards = self.activation_batch_shards
    if int(batch) % shards:
      split = " x ".join(f"{a}={self.mesh[a]}" for a in self.batch_mesh_axes)
      raise ConfigError(
        f"batch {int(batch)} (per_device_batch_size={per_device} x {devices} devices) is not divisible by the "
        f"{shards} batch shards ({split})"
      )
    return int(batch)

  @computed_field(description="sequences one optimizer step sees: micro_batch_size x gradient_accumulation_steps")
  @cached_property
  def global_batch_size_to_train_on(self) -> int:
    return self.micro_batch_size * self.keys["gradient_accumulation_steps"]

  @computed_field(description="rows the input pipeline reads per step (x ensemble_size with ensemble_data=distinct)")
  @cached_property
  def global_batch_size_to_load(self) -> int:
    members = self.keys["ensemble_size"] if self.keys["ensemble_data"] == "distinct" else 1
    return self.global_batch_size_to_train_on * members

  # -- where the run writes --

  @computed_field(description="base_output_directory/run_name, absolute")
  @cached_property
  def run_dir(self) -> str:
    return storage.join(storage.absolute(self.keys["base_output_directory"]), self.run_name)

  @computed_field(description="run_dir/tensorboard")
  @cached_property
  def tensorboard_dir(self) -> str:
    return storage.join(self.run_dir, "tensorboard")

  @computed_field(description="run_dir/checkpoints")
  @cached_property
  def checkpoint_dir(self) -> str:
    return storage.join(self.run_dir, "checkpoints")

  @computed_field(description="run_dir/metrics.jsonl")
  @cached_property
  def metrics_file(self) -> str:
    return storage.join(self.run_dir, "metrics.jsonl")

  # -- the model as it runs on this mesh --

  @computed_field(description="num_vocab_slices resolved (-1 picks the fewest that bound the logits)")
  @cached_property
  def vocab_slices(self) -> int:
    c, n, vocab = self.keys, self.keys["num_vocab_slices"], self.keys["vocab_size"]
    if n == -1:
      whole = objectives.select(c).whole_logits
      if c["num_vocab_tiling"] > 1 or whole or c["final_logits_soft_cap"] > 0:
        return 1
      float32 = c["logits_dot_in_fp32"] or c["dtype"] == "float32"
      # An ensemble's devices hold every member's logits.
      rows = self.micro_batch_size * c["ensemble_size"]
      logits_bytes = rows * c["max_target_length"] * vocab * (4 if float32 else 2) / self.devices.num_devices
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
      raise ConfigError(
        f"final_logits_soft_cap > 0 needs num_vocab_slices=1 or -1, got {n} (the cap is on whole logits)"
      )
    if n > 1 and objectives.select(c).whole_logits:
      flag = objectives.select(c).flag
      raise ConfigError(
        f"{flag}=true needs num_vocab_slices=1 or -1, got {n} (its loss sums log-probabilities per response)"
      )
    return n

  @computed_field(description="num_mlp_chunks as checked against the sequence shards")
  @cached_property
  def mlp_chunks(self) -> int:
    n, seq, shards = self.keys["num_mlp_chunks"], self.keys["max_target_length"], self.sequence_shards
    if n < 1 or seq % (n * shards):
      raise ConfigError(
        f"num_mlp_chunks={n} must be a positive number that divides max_target_length={seq} / "
        f"sequence parallelism {shards} (each part is 1/{n} of every sequence shard)"
      )
    return n

  @computed_field(description="exact parameter count of the decoder, counted by its family")
  @cached_property
  def num_params(self) -> int:
    # Tested against the real model and transformers' own.
    return families.family(self.keys["decoder_block"]).parameter_count(self.keys)

  @computed_field(description="an expert's hidden width: base_moe_mlp_dim, else base_mlp_dim")
  @cached_property
  def moe_mlp_dim(self) -> int:
    return moe_mlp_dim(self.keys)

  @cached_property
  def _attention(self) -> tuple[str, str]:
    return attention_choice.choose_attention(
      dict(self.keys),
      self.devices.platform,
      self.sequence_shards,
      self.shards("activation_heads"),
      self.devices.gpu_capability,
    )

  @computed_field(description="the attention kernel that runs (attention resolved)")
  @cached_property
  def attention_kernel(self) -> AttentionKernel:
    return self._attention[0]

  @computed_field(description="why that kernel: one line for the log")
  @cached_property
  def attention_choice(self) -> str:
    return self._attention[1]

  @computed_field(
    description="the static segment count per row the attention kernel is built for (0 = any, 1 = one document)"
  )
  @cached_property
  def attention_segments(self) -> int:
    return self._segments[1]

  @computed_field(description="splash runs in Pallas interpret mode (off TPU)")
  @cached_property
  def attention_interpret(self) -> bool:
    return self.attention_kernel == "splash" and self.devices.platform != "tpu"

  @computed_field(description="megablox grouped matmuls run in Pallas interpret mode (off TPU)")
  @cached_property
  def megablox_interpret(self) -> bool:
    return self._megablox and self.devices.platform != "tpu"

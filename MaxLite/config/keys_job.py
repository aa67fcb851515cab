"""The job's config keys around the training (mesh, metrics, checkpoints, compilation, plan.py, decode.py, processes).

Each field is the one declaration of a key: its type, its default and its one-line description. configs/base.yml,
config_keys.py and the README's tables of keys are written from these fields (`python -m MaxLite.config.generate`);
`schema.py` composes these groups with the model's and the run's.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from MaxLite.cli.errors import ConfigError
from MaxLite.config import choices

# The closed lists are choices.py's: Literal[tuple] is a Literal of its items.
DecodeSamplingStrategy = Literal[choices.DECODE_SAMPLING_STRATEGIES]
Profiler = Literal[choices.PROFILERS]
ContextStrategy = Literal[choices.CONTEXT_PARALLEL_STRATEGIES]
ContextReorder = Literal[choices.CONTEXT_REORDER_STRATEGIES]

LOGICAL_AXIS_RULES = [
  ["ensemble", ["ensemble"]],
  ["activation_batch", ["data", "fsdp", "expert"]],
  ["activation_batch_no_exp", ["data", "fsdp"]],
  ["activation_exp", ["expert"]],
  ["activation_stage", ["stage"]],
  ["activation_length", ["sequence"]],
  ["activation_embed", ["tensor"]],
  ["activation_heads", ["tensor"]],
  ["activation_kv_heads", ["tensor"]],
  ["activation_kv", []],
  ["activation_mlp", ["tensor"]],
  ["activation_vocab", ["tensor"]],
  ["vocab", ["tensor"]],
  ["embed", ["fsdp", "sequence"]],
  ["q_lora", ["fsdp", "sequence"]],
  ["kv_lora", ["fsdp", "sequence"]],
  ["q_heads", ["tensor"]],
  ["kv_heads", ["tensor"]],
  ["heads", ["tensor"]],
  ["kv", []],
  ["qkv", []],
  ["num_activations", []],
  ["mlp", ["tensor"]],
  ["exp", ["expert"]],
  ["norm", []],
  ["layers", ["stage"]],
]


class Mesh(BaseModel):
  """The device mesh and sharding; each ici_* (within a slice) and dcn_* (across slices) set may hold one -1 = "the
  rest".
  """

  ici_ensemble_parallelism: int = Field(
    1,
    description="ensemble members split across devices (ensemble_size must divide over it)",
  )
  ici_data_parallelism: int = Field(1, description="pure data parallelism (params replicated)")
  ici_pipeline_parallelism: int = Field(
    1,
    description='pipeline stages (mesh axis "stage"); layers are split evenly over stages',
  )
  ici_fsdp_parallelism: int = Field(
    -1,
    description="fully sharded data parallelism (params + optimizer sharded, ZeRO-3)",
  )
  ici_sequence_parallelism: int = Field(
    1, description="the sequence split over devices (mesh axis sequence); MaxText's name: ici_context_parallelism"
  )
  ici_context_parallelism: int = Field(
    1,
    description=(
      "context parallelism, MaxText's key for the sequence axis: the same axis as ici_sequence_parallelism (set one)"
    ),
  )
  ici_tensor_parallelism: int = Field(1, description="Megatron-style tensor parallelism")
  ici_expert_parallelism: int = Field(1, description="experts split across devices (MoE)")
  dcn_ensemble_parallelism: int = Field(1, description="ensemble members split across slices")
  dcn_data_parallelism: int = Field(-1, description="data parallelism across slices")
  dcn_pipeline_parallelism: int = Field(1, description="pipeline stages across slices")
  dcn_fsdp_parallelism: int = Field(1, description="fsdp across slices")
  dcn_sequence_parallelism: int = Field(1, description="sequence parallelism across slices")
  dcn_context_parallelism: int = Field(1, description="context parallelism across slices (= dcn_sequence_parallelism)")
  context_parallel_strategy: ContextStrategy = Field(
    "all_gather",
    description=(
      "how attention sees the keys of other sequence shards: all_gather (each shard gathers every key and value), "
      "ring (key/value blocks pass around the shards; the dot_product kernel), ulysses (all-to-alls trade sequence "
      "shards for head shards: query heads must split over tensor x context); MaxText's usp is not in MaxLite yet"
    ),
  )
  context_parallel_load_balance: bool = Field(
    True,
    description=(
      "reorder each sequence over the sequence shards so causal attention's work is even (parallel/context.py); "
      "the loss, metrics and checkpoints see the original order"
    ),
  )
  context_parallel_reorder_strategy: ContextReorder = Field(
    "auto",
    description="the load-balancing order: dual_chunk_swap (shard i: chunks i and 2N-1-i of 2N), striped; auto = "
    "dual_chunk_swap",
  )
  dcn_tensor_parallelism: int = Field(1, description="tensor parallelism across slices")
  dcn_expert_parallelism: int = Field(1, description="expert parallelism across slices")
  num_pipeline_microbatches: int = Field(
    -1,
    description="pipeline microbatches per step (GPipe); -1 = number of stages",
  )
  num_slices: int = Field(-1, description="number of slices; -1 = from the devices (slice_index) or the dcn product")
  debug_sharding: bool = Field(
    False,
    description="print every parameter's logical axes -> mesh axes -> per-device shape at start",
  )
  logical_axis_rules: list[Any] = Field(
    LOGICAL_AXIS_RULES,
    description=(
      "[logical axis, mesh axis or list of mesh axes] pairs: the model names every parameter and activation "
      "dimension with a logical axis, and this table alone decides how they are sharded; the first rule whose mesh "
      "axes no other dimension of the same array already uses wins (flax nn_partitioning)"
    ),
    # base.yml writes a note beside these rules (by logical axis).
    json_schema_extra={
      "row_notes": {
        "ensemble": "an ensemble's leading member axis (ensemble_size > 1)",
        "activation_embed": "the residual stream between tensor-parallel matmuls (MaxText's rule)",
        "q_lora": "MLA's bottlenecks, where embed does not already take those axes",
      }
    },
  )

  @model_validator(mode="after")
  def _context_strategy(self) -> Mesh:
    if self.context_parallel_strategy == "usp":
      raise ConfigError(
        "context_parallel_strategy=usp is not in MaxLite yet: all_gather (each sequence shard gathers the keys and "
        "values of the others), ring (they pass around the shards) and ulysses (all-to-alls trade sequence shards "
        "for head shards) are"
      )
    return self


class Metrics(BaseModel):
  """Metrics, tensorboard and profiling."""

  enable_tensorboard: bool = Field(
    True,
    description="write tensorboard scalars under <run>/tensorboard (process 0 only)",
  )
  peak_tflops_per_device: float = Field(
    -1.0,
    description=(
      "device peak for MFU; -1 = the chip's published bf16 peak where known (TPUs by "
      "TPU_ACCELERATOR_TYPE; H100, H200, A100, B200), else MFU is not reported"
    ),
  )
  profiler: Profiler = Field("", description='"" | xplane: jax.profiler trace of chosen steps into <run>/tensorboard')
  skip_first_n_steps_for_profiler: int = Field(3, description="first step to trace")
  profiler_steps: int = Field(2, description="number of steps to trace")


class Checkpointing(BaseModel):
  """Saving, resuming and starting from checkpoints."""

  enable_checkpointing: bool = Field(
    True,
    description=(
      "save orbax checkpoints (state + data iterator) under <run>/checkpoints; resume from the latest (MaxText default)"
    ),
  )
  async_checkpointing: bool = Field(True, description="save in the background while training continues")
  checkpoint_period: int = Field(100, gt=0, description="save after every N-th step (and after the last step)")
  max_num_checkpoints_to_keep: int = Field(3, description="retention; -1 = keep all")
  enable_emergency_checkpoint: bool = Field(
    False,
    description=(
      "MaxText's: frequent saves to each host's local disk, rare ones (checkpoint_period) to "
      "base_output_directory; needs >= 2 data-parallel replicas (data axis)"
    ),
  )
  local_checkpoint_directory: str = Field(
    "",
    description="emergency checkpoints: a directory on each host's own disk (or RAM disk)",
  )
  local_checkpoint_period: int = Field(
    0,
    description="emergency checkpoints: save to local_checkpoint_directory every N steps",
  )
  load_parameters_path: str = Field(
    "",
    description="start from these params (a step dir; a checkpoints dir = its newest): fresh optimizer, step 0",
  )
  load_full_state_path: str = Field(
    "",
    description="start from another run's whole train state (step dir, or newest); data starts over",
  )

  @model_validator(mode="after")
  def _one_start(self) -> Checkpointing:
    if self.load_parameters_path and self.load_full_state_path:
      raise ConfigError(
        "load_parameters_path and load_full_state_path are mutually exclusive (params only vs the "
        "whole train state); set only one"
      )
    return self


class Compilation(BaseModel):
  """Ahead-of-time compilation (train_compile.py) and the compilation cache."""

  compile_topology: str = Field(
    "",
    description="train_compile.py target: v4-N, v5p-N, v5e-N, v6e-N (Cloud TPU names) or cpu-N",
  )
  compile_topology_num_slices: int = Field(
    -1,
    description="train_compile.py: number of slices of compile_topology (-1 = 1)",
  )
  compiled_trainstep_file: str = Field(
    "",
    description='train_compile.py: also save the serialized compiled step here ("" = don\'t)',
  )
  jax_cache_dir: str = Field(
    "~/jax_cache",
    description='persistent XLA compilation cache (re-launches skip compiling); "" = off',
  )
  gpu_triton_gemm: bool = Field(
    False,
    description=(
      "on a GPU, XLA may compile dots as Triton GEMM fusions (true) or must call cuBLAS (false: faster on H200; "
      "MaxText's GPU recipes set the same); --xla_gpu_enable_triton_gemm in XLA_FLAGS wins"
    ),
  )


class Planning(BaseModel):
  """plan.py: the search for the fastest sharding and memory plan."""

  plan_time_budget_s: float = Field(
    600.0,
    description="plan.py: stop compiling candidate plans after this many seconds",
  )
  plan_workers: int = Field(
    2,
    description="plan.py: compiles in parallel (each worker holds one compile's host memory)",
  )
  plan_top_n: int = Field(8, description="plan.py: rows of the ranked table")
  plan_global_batch_size: int = Field(
    -1,
    description="plan.py: sequences per optimizer step to keep fixed (-1 = free per-device batch)",
  )
  plan_cache_dir: str = Field("", description='plan.py: compiled-plan results; "" = ~/.cache/maxlite/plans')
  plan_quantizations: list[str] = Field(
    [],
    description=(
      'plan.py: quantizations to search as a dimension, e.g. ["", int8] for bf16 and int8 side by side; '
      "[] = the config's quantization only"
    ),
  )
  plan_hbm_gib: float = Field(
    -1.0,
    description="plan.py: device memory to plan within (e.g. headroom below the chip's); -1 = the chip's",
  )

  @model_validator(mode="after")
  def _known_quantizations(self) -> Planning:
    for value in self.plan_quantizations:
      if value not in choices.QUANTIZATIONS:
        shown = ", ".join(repr(q) for q in choices.QUANTIZATIONS)
        raise ConfigError(f"plan_quantizations: {value!r} is not one of: {shown}")
    return self


class Decoding(BaseModel):
  """decode.py: prompts, lengths and sampling."""

  prompt: str = Field(
    "The Python tutorial",
    description='text to continue; several prompts separated by " ||| " decode as one batch',
  )
  max_prefill_predict_length: int = Field(
    64,
    description="prompt tokens per row, >= 1 (a longer prompt keeps BOS + its last tokens, warned)",
  )
  max_decode_steps: int = Field(
    32,
    description="new tokens per row, >= 1; prefill + decode must fit in max_target_length",
  )
  decode_sampling_strategy: DecodeSamplingStrategy = Field(
    "greedy",
    description="greedy | weighted (temperature sampling) | topk | nucleus (MaxText's names)",
  )
  decode_sampling_temperature: float = Field(
    1.0,
    description="softmax temperature, > 0 for the sampling strategies (greedy ignores it)",
  )
  decode_sampling_top_k: int = Field(40, description="top_k: sample among the k most likely tokens, >= 1")
  decode_sampling_nucleus_p: float = Field(
    0.9,
    description="nucleus: sample among the most likely tokens whose probabilities sum to p, in (0, 1]",
  )
  decode_seed: int = Field(0, description="sampling seed, in [0, 2**32)")

  @model_validator(mode="after")
  def _in_range(self) -> Decoding:
    """Refused at load like the rest: out of range they fail deep in JAX (top_k=0) or decode garbage (temperature 0
    divides the logits by zero) after the checkpoint has been read."""
    for key in ("max_prefill_predict_length", "max_decode_steps"):
      if getattr(self, key) < 1:
        raise ConfigError(f"{key} must be at least 1, got {getattr(self, key)}")
    # A top_k above the vocabulary samples among every token (sample() clamps it), so only the lower end is refused.
    if self.decode_sampling_top_k < 1:
      raise ConfigError(
        f"decode_sampling_top_k must be in [1, inf) (the most likely tokens kept), got {self.decode_sampling_top_k}"
      )
    if not 0.0 < self.decode_sampling_nucleus_p <= 1.0:  # NaN fails too
      raise ConfigError(
        f"decode_sampling_nucleus_p must be in (0, 1] (probability mass kept), got {self.decode_sampling_nucleus_p}"
      )
    strategy, temperature = self.decode_sampling_strategy, self.decode_sampling_temperature
    # Greedy never reads the temperature, and 0 is how other tools spell greedy: accepted there, refused elsewhere.
    if strategy != "greedy" and not 0.0 < temperature < math.inf:
      raise ConfigError(
        f"decode_sampling_temperature must be in (0, inf) for decode_sampling_strategy={strategy!r}, got "
        f"{temperature}; for the most likely token at every step use decode_sampling_strategy=greedy"
      )
    # JAX keeps 32 bits of a seed (without jax_enable_x64): other seeds repeat one of these or overflow.
    if not 0 <= self.decode_seed < 2**32:
      raise ConfigError(f"decode_seed must be in [0, 2**32), got {self.decode_seed}")
    return self


class Distributed(BaseModel):
  """Joining a multi-process job (jax.distributed)."""

  skip_jax_distributed_system: bool = Field(
    False,
    description=(
      "false = join jax.distributed when the environment has several hosts (TPU VM, SLURM with >1 task, "
      "coordinator_address / JAX_COORDINATOR_ADDRESS); true = never"
    ),
  )
  coordinator_address: str = Field("", description='host:port of process 0 ("" = auto-detect on TPU/SLURM/GKE)')
  num_processes: int = Field(-1, description="total processes (-1 = auto-detect)")
  process_id: int = Field(-1, description="this process's index (-1 = auto-detect)")
  jax_distributed_initialization_timeout: int = Field(300, description="seconds to wait for all processes to join")

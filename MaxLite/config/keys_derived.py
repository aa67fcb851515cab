"""The keys a Config holds that nobody sets: the values the loader and `validation.validate_and_derive` work out.

They are declared here, beside the settable groups, so that every key a Config can hold is named, typed and described
in one place (`schema.py` composes them; `--describe mesh_shape` answers as for any key). The math stays in
validation.py, where the checks it depends on run; tests/test_schema.py derives real configs and fails when the derive
code adds a key this group does not declare, or one of a type it does not say. Some settable keys are also resolved
there (run_name="" becomes a timestamp, num_slices=-1 a count, ...): those keep their own group.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

AttentionKernel = Literal["dot_product", "splash", "cudnn"]
DataKind = Literal["text", "chat", "prompt_completion", "preference"]


class Derived(BaseModel):
  """Worked out from the other keys and the devices; not settable from YAML or the command line."""

  model_config = ConfigDict(extra="forbid", frozen=True)

  explicit_keys: list[str] = Field(description="the keys a config file, the model overlay or the command line set")
  data_kind: DataKind = Field(description="what a training record is, from use_sft/use_dpo and the data columns")
  num_devices: int = Field(description="devices in the job (all slices)")
  process_count: int = Field(description="processes in the job")
  ici_mesh_shape: list[int] = Field(description="devices per mesh axis within a slice, in choices.MESH_AXES order")
  dcn_mesh_shape: list[int] = Field(description="slices per mesh axis, in choices.MESH_AXES order")
  mesh_shape: list[int] = Field(description="the whole mesh per axis: ici_mesh_shape x dcn_mesh_shape")
  batch_mesh_axes: list[str] = Field(description="the mesh axes the batch is split on (activation_batch's rule)")
  num_pipeline_stages: int = Field(description="pipeline stages: the mesh's stage axis")
  micro_batch_size: int = Field(description="sequences per microbatch over all devices (per member of an ensemble)")
  global_batch_size_to_train_on: int = Field(
    description="sequences one optimizer step sees: micro_batch_size x gradient_accumulation_steps"
  )
  global_batch_size_to_load: int = Field(
    description="rows the input pipeline reads per step (x ensemble_size with ensemble_data=distinct)"
  )
  run_dir: str = Field(description="base_output_directory/run_name, absolute")
  tensorboard_dir: str = Field(description="run_dir/tensorboard")
  checkpoint_dir: str = Field(description="run_dir/checkpoints")
  metrics_file: str = Field(description="run_dir/metrics.jsonl")
  vocab_slices: int = Field(description="num_vocab_slices resolved (-1 picks the fewest that bound the logits)")
  mlp_chunks: int = Field(description="num_mlp_chunks as checked against the sequence shards")
  sequence_shards: int = Field(description="how many pieces activation_length is split into on this mesh")
  activation_batch_shards: int = Field(description="how many pieces activation_batch is split into on this mesh")
  num_params: int = Field(description="exact parameter count of the decoder, counted by its family")
  moe_mlp_dim: int = Field(description="an expert's hidden width: base_moe_mlp_dim, else base_mlp_dim")
  attention_kernel: AttentionKernel = Field(description="the attention kernel that runs (attention resolved)")
  attention_choice: str = Field(description="why that kernel: one line for the log")
  attention_segments: int = Field(
    description="the static segment count per row the attention kernel is built for (0 = any, 1 = one document)"
  )
  attention_interpret: bool = Field(description="splash runs in Pallas interpret mode (off TPU)")
  megablox_interpret: bool = Field(description="megablox grouped matmuls run in Pallas interpret mode (off TPU)")

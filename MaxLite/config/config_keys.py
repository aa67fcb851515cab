"""Written from MaxLite/config/schema.py by `python -m MaxLite.config.generate`: do not edit.

The type of every key a Config holds (lists arrive as tuples), so that `config.steps` is an int to an editor and
a type checker. Declarations only: `Config.__getattr__` still serves every value. tests/config/test_schema.py fails
when this file and the schema differ.
"""

from __future__ import annotations

from typing import Any, Literal


class ConfigKeys:
  """The keys of `Config`, each with its type; schema.py describes each."""

  # RunInfo (`--describe RunInfo`)
  run_name: str
  base_output_directory: str
  steps: int
  log_period: int
  seed: int
  init_weights_seed: int

  # ModelArchitecture (`--describe ModelArchitecture`)
  model_name: str
  decoder_block: str
  base_emb_dim: int
  base_num_query_heads: int
  base_num_kv_heads: int
  head_dim: int
  base_mlp_dim: int
  base_num_decoder_layers: int
  vocab_size: int
  mlp_activations: tuple[str, ...]
  normalization_layer_epsilon: float
  attention_bias: bool
  use_qk_norm: bool
  use_iota_embed: bool
  logits_via_embedding: bool
  fused_qkv: bool
  fused_mlp: bool
  dropout_rate: float
  dense_init_scale: float

  # Rope (`--describe Rope`)
  rope_max_timescale: float
  rope_type: Literal["default", "llama3.1", "yarn"]
  rope_factor: float
  rope_low_freq_factor: float
  rope_high_freq_factor: float
  original_max_position_embeddings: int
  max_position_embeddings: int
  beta_fast: float
  beta_slow: float
  rope_truncate: bool
  rope_attention_factor: float

  # Gemma (`--describe Gemma`)
  sliding_window_size: int
  local_rope_max_timescale: int
  rope_linear_scaling_factor: float
  query_pre_attn_scalar: int
  use_post_attn_norm: bool
  use_post_ffw_norm: bool
  attn_logits_soft_cap: float
  final_logits_soft_cap: float

  # DataTypes (`--describe DataTypes`)
  dtype: Literal["float32", "bfloat16"]
  weight_dtype: Literal["float32", "bfloat16"]
  logits_dot_in_fp32: bool

  # Quantization (`--describe Quantization`)
  quantization: Literal["", "int8", "fp8", "fp8_full"]
  use_qwix_quantization: bool
  weight_quantization_calibration_method: str
  act_quantization_calibration_method: str
  bwd_quantization_calibration_method: str

  # Remat (`--describe Remat`)
  remat_policy: Literal[
    "none",
    "full",
    "minimal",
    "minimal_with_context",
    "save_dot_with_context_except_mlp",
    "save_dot_except_mlpwi",
    "save_dot_except_mlp",
    "save_qkv_proj",
    "save_out_proj",
    "qkv_proj_offloaded",
    "minimal_offloaded",
    "save_dot_except_mlp_offloaded",
    "custom",
  ]
  decoder_layer_input: Literal["remat", "device", "offload"]
  query_proj: Literal["remat", "device", "offload"]
  key_proj: Literal["remat", "device", "offload"]
  value_proj: Literal["remat", "device", "offload"]
  qkv_proj: Literal["remat", "device", "offload"]
  context: Literal["remat", "device", "offload"]
  out_proj: Literal["remat", "device", "offload"]
  mlpwi_0: Literal["remat", "device", "offload"]
  mlpwi_1: Literal["remat", "device", "offload"]
  mlpwi: Literal["remat", "device", "offload"]
  mlpwo: Literal["remat", "device", "offload"]
  moe_mlpwi_0: Literal["remat", "device", "offload"]
  moe_mlpwi_1: Literal["remat", "device", "offload"]
  moe_mlpwo: Literal["remat", "device", "offload"]

  # SplashAttention (`--describe SplashAttention`)
  attention: Literal["autoselected", "dot_product", "splash", "cudnn", "flash", "cudnn_flash_jax"]
  sa_block_q: int
  sa_block_kv: int
  sa_block_kv_compute: int
  sa_block_q_dkv: int
  sa_block_kv_dkv: int
  sa_block_kv_dkv_compute: int
  sa_block_q_dq: int
  sa_block_kv_dq: int
  sa_use_fused_bwd_kernel: bool

  # MemoryLayout (`--describe MemoryLayout`)
  scan_layers: bool
  donate_params: bool
  num_vocab_tiling: int
  num_vocab_slices: int
  num_mlp_chunks: int
  parameter_memory_host_offload: bool
  optimizer_memory_host_offload: bool

  # MoEGeneral (`--describe MoEGeneral`)
  num_experts: int
  num_experts_per_tok: int
  base_moe_mlp_dim: int
  norm_topk_prob: bool
  float32_gate_logits: bool
  capacity_factor: float
  sparse_matmul: bool
  megablox: bool
  ragged_buffer_factor: float
  load_balance_loss_weight: float

  # DeepSeekMoE (`--describe DeepSeekMoE`)
  first_num_dense_layers: int
  shared_experts: int
  routed_score_func: str
  routed_bias: bool
  routed_bias_update_rate: float
  routed_scaling_factor: float
  n_routing_groups: int
  topk_routing_group: int

  # MlaAttention (`--describe MlaAttention`)
  attention_type: str
  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  mscale: float

  # Optimizer (`--describe Optimizer`)
  per_device_batch_size: float
  max_target_length: int
  gradient_accumulation_steps: int
  learning_rate: float
  warmup_steps_fraction: float
  learning_rate_final_fraction: float
  learning_rate_schedule_steps: int
  adam_b1: float
  adam_b2: float
  adam_eps: float
  adam_weight_decay: float
  gradient_clipping_threshold: float
  z_loss_multiplier: float

  # Ensemble (`--describe Ensemble`)
  ensemble_size: int
  ensemble_learning_rates: tuple[float, ...]
  ensemble_data: Literal["same", "distinct"]
  ensemble_member: int

  # Dataset (`--describe Dataset`)
  dataset_type: Literal["synthetic", "grain"]
  synthetic_tokens: Literal["patterns", "uniform"]
  grain_train_files: str
  grain_eval_files: str
  grain_file_type: Literal["arrayrecord", "parquet", "jsonl"]
  grain_text_column: str
  grain_worker_count: int
  tokenizer_path: str
  tokenizer_type: Literal["sentencepiece", "huggingface", "tiktoken"]
  add_bos: bool
  add_eos: bool
  max_segments_per_seq: int
  data_shuffle_seed: int
  eval_interval: int
  eval_steps: int

  # PostTraining (`--describe PostTraining`)
  train_data_columns: tuple[str, ...]
  eval_data_columns: tuple[str, ...]
  use_chat_template: bool
  chat_template_path: str

  # Lora (`--describe Lora`)
  enable_lora: bool
  lora_rank: int
  lora_alpha: float
  lora_module_path: str
  lora_weight_qtype: Literal["", "nf4", "int8", "int4"]
  lora_tile_size: int
  lora_restore_path: str
  hf_lora_adapter_path: str

  # Sft (`--describe Sft`)
  use_sft: bool
  sft_train_on_completion_only: bool

  # Dpo (`--describe Dpo`)
  use_dpo: bool
  dpo_algo: str
  dpo_beta: float
  dpo_label_smoothing: float

  # Orpo (`--describe Orpo`)
  orpo_lambda: float

  # Grpo (`--describe Grpo`)
  use_grpo: bool
  num_generations: int
  num_iterations: int
  grpo_beta: float
  grpo_epsilon: float
  epsilon_high: float
  loss_algo: Literal["grpo", "gspo-token"]
  loss_agg_mode: Literal["sequence-mean-token-mean", "token-mean", "sequence-mean"]
  reward_functions: tuple[str, ...]
  reward_weights: tuple[float, ...]
  rollout_temperature: float
  rollout_top_k: int
  rollout_top_p: float

  # GptOss (`--describe GptOss`)
  attention_sink: bool
  mlp_bias: bool
  mlp_activations_limit: float

  # Mesh (`--describe Mesh`)
  ici_ensemble_parallelism: int
  ici_data_parallelism: int
  ici_pipeline_parallelism: int
  ici_fsdp_parallelism: int
  ici_sequence_parallelism: int
  ici_context_parallelism: int
  ici_tensor_parallelism: int
  ici_expert_parallelism: int
  dcn_ensemble_parallelism: int
  dcn_data_parallelism: int
  dcn_pipeline_parallelism: int
  dcn_fsdp_parallelism: int
  dcn_sequence_parallelism: int
  dcn_context_parallelism: int
  context_parallel_strategy: Literal["all_gather", "ring", "ulysses", "usp"]
  context_parallel_load_balance: bool
  context_parallel_reorder_strategy: Literal["auto", "dual_chunk_swap", "striped"]
  dcn_tensor_parallelism: int
  dcn_expert_parallelism: int
  num_pipeline_microbatches: int
  num_slices: int
  debug_sharding: bool
  logical_axis_rules: tuple[Any, ...]

  # Metrics (`--describe Metrics`)
  enable_tensorboard: bool
  peak_tflops_per_device: float
  profiler: Literal["", "xplane"]
  skip_first_n_steps_for_profiler: int
  profiler_steps: int

  # Checkpointing (`--describe Checkpointing`)
  enable_checkpointing: bool
  async_checkpointing: bool
  checkpoint_period: int
  max_num_checkpoints_to_keep: int
  enable_emergency_checkpoint: bool
  local_checkpoint_directory: str
  local_checkpoint_period: int
  load_parameters_path: str
  load_full_state_path: str

  # Compilation (`--describe Compilation`)
  compile_topology: str
  compile_topology_num_slices: int
  compiled_trainstep_file: str
  jax_cache_dir: str
  gpu_triton_gemm: bool

  # Planning (`--describe Planning`)
  plan_time_budget_s: float
  plan_workers: int
  plan_top_n: int
  plan_global_batch_size: int
  plan_cache_dir: str
  plan_quantizations: tuple[str, ...]
  plan_hbm_gib: float

  # Decoding (`--describe Decoding`)
  prompt: str
  max_prefill_predict_length: int
  max_decode_steps: int
  decode_sampling_strategy: Literal["greedy", "weighted", "topk", "nucleus"]
  decode_sampling_temperature: float
  decode_sampling_top_k: int
  decode_sampling_nucleus_p: float
  decode_seed: int

  # Distributed (`--describe Distributed`)
  skip_jax_distributed_system: bool
  coordinator_address: str
  num_processes: int
  process_id: int
  jax_distributed_initialization_timeout: int

  # Derived (`--describe Derived`)
  explicit_keys: tuple[str, ...]
  objective: str
  data_kind: Literal["text", "chat", "prompt_completion", "preference", "prompts"]
  num_devices: int
  process_count: int
  ici_mesh_shape: tuple[int, ...]
  dcn_mesh_shape: tuple[int, ...]
  mesh_shape: tuple[int, ...]
  batch_mesh_axes: tuple[str, ...]
  num_pipeline_stages: int
  sequence_shards: int
  context_parallel_reorder: str
  activation_batch_shards: int
  micro_batch_size: int
  global_batch_size_to_train_on: int
  global_batch_size_to_load: int
  run_dir: str
  tensorboard_dir: str
  checkpoint_dir: str
  metrics_file: str
  vocab_slices: int
  mlp_chunks: int
  num_params: int
  moe_mlp_dim: int
  attention_kernel: Literal["dot_product", "splash", "cudnn"]
  attention_choice: str
  attention_segments: int
  attention_interpret: bool
  megablox_interpret: bool

"""The model's config keys (shape, positions, precision, memory, experts), grouped by concern.

Each field is the one declaration of a key: its type, its default, its one-line description, and whether a checkpoint
saves it. configs/base.yml, config_keys.py and the README's tables of keys are written from these fields
(`python -m MaxLite.config.generate`); `schema.py` composes these groups with the run's.

Every key here says whether a checkpoint saves it (`json_schema_extra={"saved": ...}`; tests/config/test_schema.py fails
on one that does not). True for a key that changes the parameters (their shapes and layout) or the function they compute
from the tokens: a checkpoint stores it, a run that loads the checkpoint takes it from there unless it sets the key
itself, and a resume may not change it (`loader.MODEL_KEYS` lists these). False for a key that changes how or at what
precision the same function is computed (dtypes, quantized matmuls, kernels, tiling, rematerialisation, token dropping
by capacity) or only how it is trained (dropout, initialisation, auxiliary losses): a run may choose it anew.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from MaxLite.cli.errors import ConfigError
from MaxLite.config import choices

# The closed lists are choices.py's (validation's messages name them too): Literal[tuple] is a Literal of its items.
AttentionKernel = Literal[choices.ATTENTION]
Dtype = Literal[choices.DTYPES]
Placement = Literal[choices.PLACEMENTS]
QuantizationType = Literal[choices.QUANTIZATIONS]
RematPolicy = Literal[choices.REMAT_POLICIES]
RopeType = Literal[choices.ROPE_TYPES]


class ModelArchitecture(BaseModel):
  """The network's shape: family, widths, heads, layers, vocabulary and activations."""

  model_name: str = Field(
    "default",
    description='"default" = the values below; else overlays configs/models/<model_name>.yml',
    json_schema_extra={"saved": False},
  )
  decoder_block: str = Field(
    "llama2",
    description="decoder family: one registered in MaxLite/models/ (llama2 = mistral: Llama 2/3, Mistral, Qwen, MoE; "
    "the others by their module's name; a wrong name lists them)",
    json_schema_extra={"saved": True},
  )
  base_emb_dim: int = Field(256, gt=0, description="model (embedding) width", json_schema_extra={"saved": True})
  base_num_query_heads: int = Field(4, gt=0, description="attention query heads", json_schema_extra={"saved": True})
  base_num_kv_heads: int = Field(
    4, gt=0, description="key/value heads (< query heads = GQA, 1 = MQA)", json_schema_extra={"saved": True}
  )
  head_dim: int = Field(64, gt=0, description="width of one attention head", json_schema_extra={"saved": True})
  base_mlp_dim: int = Field(1024, gt=0, description="SwiGLU hidden width", json_schema_extra={"saved": True})
  base_num_decoder_layers: int = Field(4, gt=0, description="transformer blocks", json_schema_extra={"saved": True})
  vocab_size: int = Field(
    8192, gt=0, description="embedding rows; must be >= the tokenizer's vocabulary", json_schema_extra={"saved": True}
  )
  mlp_activations: list[str] = Field(
    ["silu", "linear"],
    description="gated MLP act(x W_gate) * (x W_up): silu,linear (SwiGLU) | gelu,linear (GeGLU)",
    json_schema_extra={"saved": True},
  )
  normalization_layer_epsilon: float = Field(
    1e-05, gt=0, description="RMSNorm epsilon", json_schema_extra={"saved": True}
  )
  attention_bias: bool = Field(
    False,
    description="learned biases on the query, key and value projections (Qwen2.5)",
    json_schema_extra={"saved": True},
  )
  use_qk_norm: bool = Field(
    False,
    description="RMSNorm over each query and key head's features before RoPE (Qwen3)",
    json_schema_extra={"saved": True},
  )
  use_iota_embed: bool = Field(
    False,
    description="the token lookup as a one-hot matmul (its gradient a matmul, not a scatter-add)",
    json_schema_extra={"saved": False},
  )
  logits_via_embedding: bool = Field(
    False,
    description="true = tied embeddings (output head reuses the token embedding)",
    json_schema_extra={"saved": True},
  )
  fused_qkv: bool = Field(
    False,
    description="one [embed, 3, heads, head_dim] q/k/v kernel (query heads must equal kv heads)",
    json_schema_extra={"saved": True},
  )
  fused_mlp: bool = Field(
    False, description="one [embed, 2, mlp] gate+up kernel (dense MLP only)", json_schema_extra={"saved": True}
  )
  dropout_rate: float = Field(
    0.0,
    ge=0,
    lt=1,
    description="dropout on attention output and MLP output (0 = off)",
    json_schema_extra={"saved": False},
  )
  dense_init_scale: float = Field(
    1.0,
    ge=0,
    description="multiplier on the default (fan-in scaled) weight initialisation",
    json_schema_extra={"saved": False},
  )

  @model_validator(mode="after")
  def _shapes(self) -> ModelArchitecture:
    if self.head_dim % 2:
      raise ConfigError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs of features)")
    if self.fused_qkv and self.base_num_kv_heads != self.base_num_query_heads:
      raise ConfigError(
        f"fused_qkv=true needs base_num_kv_heads == base_num_query_heads (one head count for q, k and v), got "
        f"{self.base_num_kv_heads} and {self.base_num_query_heads}; set fused_qkv=false for GQA/MQA"
      )
    return self


class Rope(BaseModel):
  """Rotary position embeddings: theta and the long-context scalings (llama3.1, yarn)."""

  rope_max_timescale: float = Field(
    10000.0, gt=0, description="RoPE theta (Llama 2: 10000, Llama 3: 500000)", json_schema_extra={"saved": True}
  )
  rope_type: RopeType = Field(
    "default",
    description="default | llama3.1 (Llama 3.1+ frequency scaling) | yarn (YaRN); see layers/rope.py",
    json_schema_extra={"saved": True},
  )
  rope_factor: float = Field(
    8.0,
    description="llama3.1 / yarn: how much longer the context is than original_max_position_embeddings",
    json_schema_extra={"saved": True},
  )
  rope_low_freq_factor: float = Field(
    1.0,
    description="llama3.1: wavelengths over original / this are divided by rope_factor",
    json_schema_extra={"saved": True},
  )
  rope_high_freq_factor: float = Field(
    4.0,
    description="llama3.1: wavelengths under original / this are kept; those between are blended",
    json_schema_extra={"saved": True},
  )
  original_max_position_embeddings: int = Field(
    8192,
    description=(
      "llama3.1 / yarn: the context length the model was first trained at (rope_factor 8 / 8192 are "
      "Llama 3.1's; MaxText's yarn defaults are 40 / 4096)"
    ),
    json_schema_extra={"saved": True},
  )
  max_position_embeddings: int = Field(
    -1,
    description="the context length a Hugging Face export declares; -1 = from the RoPE settings",
    json_schema_extra={"saved": True},
  )
  beta_fast: float = Field(
    32.0,
    description="yarn: pairs turning more often than this over the original context keep their frequency",
    json_schema_extra={"saved": True},
  )
  beta_slow: float = Field(
    1.0,
    description="yarn: pairs turning less often than this are interpolated by rope_factor",
    json_schema_extra={"saved": True},
  )
  rope_truncate: bool = Field(
    True,
    description="yarn: round the ramp's ends to whole pairs (transformers' default)",
    json_schema_extra={"saved": True},
  )
  rope_attention_factor: float = Field(
    -1.0,
    description=(
      "yarn: cos/sin times this (HF attention_factor); -1 = as transformers derives it: 1 for mla with "
      "mscale != 0 (mscale = mscale_all_dim), else 0.1 ln(rope_factor) + 1"
    ),
    json_schema_extra={"saved": True},
  )

  @model_validator(mode="after")
  def _scaling(self) -> Rope:
    """The scaling's own numbers, each refused where transformers would compute nonsense from it."""
    if self.rope_type == "default":
      return self
    if self.rope_factor < 1 or self.original_max_position_embeddings < 1:
      raise ConfigError(
        f"rope_type={self.rope_type} needs rope_factor >= 1 and original_max_position_embeddings >= 1, got "
        f"{self.rope_factor} and {self.original_max_position_embeddings}"
      )
    if self.rope_type == "llama3.1" and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
      raise ConfigError(
        f"rope_type=llama3.1 needs 0 < rope_low_freq_factor < rope_high_freq_factor, got "
        f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}"
      )
    if self.rope_type == "yarn" and not (self.rope_attention_factor == -1 or self.rope_attention_factor > 0):
      raise ConfigError(
        f"rope_attention_factor={self.rope_attention_factor} must be > 0 (cos/sin times it) or -1 (as transformers "
        "derives it from rope_factor and mscale)"
      )
    if self.rope_type == "yarn" and not 0 < self.beta_slow < self.beta_fast:
      raise ConfigError(f"rope_type=yarn needs 0 < beta_slow < beta_fast, got {self.beta_slow} and {self.beta_fast}")
    return self


class Gemma(BaseModel):
  """Gemma (decoder_block=gemma3; MaxText's keys and defaults; 0 / -1 / false = off)."""

  sliding_window_size: int = Field(
    0,
    description="gemma3: local layers attend to the latest N tokens (every 6th layer is global)",
    json_schema_extra={"saved": True},
  )
  local_rope_max_timescale: int = Field(
    -1,
    description="gemma3: RoPE theta of the local layers; -1 = rope_max_timescale",
    json_schema_extra={"saved": True},
  )
  rope_linear_scaling_factor: float = Field(
    1.0,
    description="gemma3: the global layers' RoPE positions divided by this (HF rope_type linear)",
    json_schema_extra={"saved": True},
  )
  query_pre_attn_scalar: int = Field(
    0, description="q is scaled by this ** -0.5; 0 = head_dim (Gemma 3 27B: 168)", json_schema_extra={"saved": True}
  )
  use_post_attn_norm: bool = Field(
    False,
    description="gemma3: RMSNorm on the attention block's output before the residual add",
    json_schema_extra={"saved": True},
  )
  use_post_ffw_norm: bool = Field(
    False,
    description="gemma3: RMSNorm on the MLP block's output before the residual add",
    json_schema_extra={"saved": True},
  )
  attn_logits_soft_cap: float = Field(
    0.0,
    description="cap * tanh(scores / cap) on the attention scores (Gemma 2); 0 = off",
    json_schema_extra={"saved": True},
  )
  final_logits_soft_cap: float = Field(
    0.0, description="the same on the output logits; 0 = off", json_schema_extra={"saved": True}
  )


class DataTypes(BaseModel):
  """Precision of activations, parameters and logits."""

  dtype: Dtype = Field(
    "float32", description="activation / compute dtype: float32 or bfloat16", json_schema_extra={"saved": False}
  )
  weight_dtype: Dtype = Field(
    "float32", description="parameter (and optimizer state) dtype", json_schema_extra={"saved": False}
  )
  logits_dot_in_fp32: bool = Field(
    True,
    description=(
      "true = float32 logits from the head's matmul (bfloat16 inputs accumulated in float32); false = "
      "logits in `dtype`, cast to float32 by the loss (MaxText's default; memory either way depending "
      "on the config: train_compile.py says)"
    ),
    json_schema_extra={"saved": False},
  )


class Quantization(BaseModel):
  """Quantized training through Qwix (layers/quantization.py): the projections' matmuls in int8 or fp8 forward and
  backward, everything stored in full precision.
  """

  quantization: QuantizationType = Field(
    "",
    description='"" (off) | int8 | fp8 (e4m3 both ways) | fp8_full (e4m3 forward, e5m2 gradients)',
    json_schema_extra={
      "saved": False,
      "unsupported": "Qwix's quantized training; int4 and MaxText's other modes are not supported",
    },
  )
  use_qwix_quantization: bool = Field(
    False,
    description="must be true with a quantization (MaxText's false means AQT, which MaxLite has not)",
    json_schema_extra={"saved": False},
  )
  weight_quantization_calibration_method: str = Field(
    "absmax",
    description="absmax[,scale] | minmax[,scale] | rms,scale | fixed,[min,]max",
    json_schema_extra={"saved": False},
  )
  act_quantization_calibration_method: str = Field(
    "absmax", description="the same for the activations", json_schema_extra={"saved": False}
  )
  bwd_quantization_calibration_method: str = Field(
    "absmax",
    description="the same for the gradients of the backward pass",
    json_schema_extra={"saved": False},
  )

  @model_validator(mode="after")
  def _qwix(self) -> Quantization:
    if self.quantization and not self.use_qwix_quantization:
      raise ConfigError(
        f"quantization={self.quantization} needs use_qwix_quantization=true (MaxLite quantizes with Qwix; MaxText's "
        "false selects AQT, which MaxLite does not have)"
      )
    for key in choices.CALIBRATION_KEYS:
      if not choices.CALIBRATION_METHOD.fullmatch(getattr(self, key).lower()):
        raise ConfigError(
          f"{key}={getattr(self, key)!r} is not a Qwix calibration method: absmax, absmax,SCALE, minmax, "
          "minmax,SCALE, rms,SCALE, fixed,MAX or fixed,MIN,MAX"
        )
    return self


class Remat(BaseModel):
  """What each layer keeps for the backward pass; with remat_policy=custom each tagged activation is remat
  (recomputed), device (kept in HBM) or offload (host memory).
  """

  remat_policy: RematPolicy = Field(
    "full",
    description=(
      "what each layer keeps for the backward pass (MaxText's names, layers/remat.py): none | full "
      "(only the layer input) | minimal (every projection) | minimal_with_context | "
      "save_dot_with_context_except_mlp | save_dot_except_mlp | save_dot_except_mlpwi | save_qkv_proj | "
      "save_out_proj | custom (the per-activation keys below); in pinned host memory instead of HBM: "
      "minimal_offloaded | qkv_proj_offloaded | save_dot_except_mlp_offloaded"
    ),
    json_schema_extra={"saved": False},
  )
  decoder_layer_input: Placement = Field(
    "device",
    description="the layer's input (always kept: offload moves it to the host)",
    json_schema_extra={"saved": False},
  )
  query_proj: Placement = Field(
    "remat", description="q as attention reads it (after q/k norm and RoPE)", json_schema_extra={"saved": False}
  )
  key_proj: Placement = Field(
    "remat", description="k as attention reads it (after q/k norm and RoPE)", json_schema_extra={"saved": False}
  )
  value_proj: Placement = Field("remat", description="v as attention reads it", json_schema_extra={"saved": False})
  qkv_proj: Placement = Field(
    "remat", description="the fused q/k/v projection (fused_qkv)", json_schema_extra={"saved": False}
  )
  context: Placement = Field(
    "remat", description="attention's output before the output projection", json_schema_extra={"saved": False}
  )
  out_proj: Placement = Field("remat", description="the attention block's result", json_schema_extra={"saved": False})
  mlpwi_0: Placement = Field("remat", description="the MLP gate projection", json_schema_extra={"saved": False})
  mlpwi_1: Placement = Field("remat", description="the MLP up projection", json_schema_extra={"saved": False})
  mlpwi: Placement = Field(
    "remat", description="the fused gate+up projection (fused_mlp)", json_schema_extra={"saved": False}
  )
  mlpwo: Placement = Field("remat", description="the MLP / MoE block's result", json_schema_extra={"saved": False})
  moe_mlpwi_0: Placement = Field(
    "remat", description="the per-expert gate projection (MoE)", json_schema_extra={"saved": False}
  )
  moe_mlpwi_1: Placement = Field(
    "remat", description="the per-expert up projection (MoE)", json_schema_extra={"saved": False}
  )
  moe_mlpwo: Placement = Field(
    "remat", description="the per-expert down projection (MoE)", json_schema_extra={"saved": False}
  )


class SplashAttention(BaseModel):
  """The attention kernel and the splash kernel's block sizes (tokens): each is capped at the sequence it tiles and
  must then be a multiple of 128 dividing it.
  """

  attention: AttentionKernel = Field(
    "autoselected",
    description=(
      "autoselected (splash on TPU, cudnn on GPU, dot_product on CPU) | dot_product | splash | cudnn "
      '(MaxText\'s "flash" = splash, "cudnn_flash_jax" = cudnn); splash off TPU runs interpreted'
    ),
    json_schema_extra={
      "saved": False,
      "unsupported": "MaxText's cudnn_flash_te (Transformer Engine), paged and vllm_rpa kernels are not in MaxLite: "
      "cudnn is cuDNN's fused attention through jax",
    },
  )
  sa_block_q: int = Field(
    512,
    description="query block of the forward pass (q blocks tile the query length per sequence shard)",
    json_schema_extra={"saved": False},
  )
  sa_block_kv: int = Field(512, description="key/value block of the forward pass", json_schema_extra={"saved": False})
  sa_block_kv_compute: int = Field(
    512,
    description="kv sub-block per inner step of the forward pass (divides sa_block_kv)",
    json_schema_extra={"saved": False},
  )
  sa_block_q_dkv: int = Field(512, description="backward dk/dv kernel: query block", json_schema_extra={"saved": False})
  sa_block_kv_dkv: int = Field(
    512, description="backward dk/dv kernel: key/value block", json_schema_extra={"saved": False}
  )
  sa_block_kv_dkv_compute: int = Field(
    512, description="backward dk/dv kernel: kv sub-block per inner step", json_schema_extra={"saved": False}
  )
  sa_block_q_dq: int = Field(
    512,
    description="backward dq kernel: query block (unused with the fused backward kernel)",
    json_schema_extra={"saved": False},
  )
  sa_block_kv_dq: int = Field(
    512,
    description="backward dq kernel: key/value block (unused with the fused backward kernel)",
    json_schema_extra={"saved": False},
  )
  sa_use_fused_bwd_kernel: bool = Field(
    False, description="one backward kernel for dq, dk and dv instead of two", json_schema_extra={"saved": False}
  )


class MemoryLayout(BaseModel):
  """Trading memory for time: layer scanning, buffer donation, chunked logits and MLPs, host offload."""

  scan_layers: bool = Field(
    True,
    description="stack layers with nn.scan (fast compile); false = unrolled python loop",
    json_schema_extra={"saved": True},
  )
  donate_params: bool = Field(
    True,
    description=(
      "true = the step overwrites the parameters in place (as MaxText does); false = a fresh buffer for "
      "the new ones (the old ones stay readable after the step)"
    ),
    json_schema_extra={"saved": False},
  )
  num_vocab_tiling: int = Field(
    1,
    gt=0,
    description=(
      "> 1: the loss computes logits in this many chunks of tokens, so the whole [tokens, vocab] "
      "float32 logits never exist at once (same loss and gradients)"
    ),
    json_schema_extra={"saved": False},
  )
  num_vocab_slices: int = Field(
    -1,
    description=(
      "> 1: the output head and the loss work on 1/N of the vocabulary at a time, forward and backward "
      "(same loss and gradients); -1 = the fewest slices (a power of 2) whose logits are at most 256 "
      "MiB per device; 1 = whole logits"
    ),
    json_schema_extra={"saved": False},
  )
  num_mlp_chunks: int = Field(
    1,
    description=(
      "> 1: each layer's RMSNorm + MLP runs on 1/N of the tokens at a time, each part rematerialised "
      "alone: its backward pass holds one part's activations (same loss and gradients; weights gathered "
      "and gradients reduced once per layer, as with 1)"
    ),
    json_schema_extra={"saved": False},
  )
  parameter_memory_host_offload: bool = Field(
    False,
    description="keep parameters in host memory between steps (moved to the device per step)",
    json_schema_extra={"saved": False},
  )
  optimizer_memory_host_offload: bool = Field(
    False,
    description="keep optimizer state in host memory between steps (moved per step)",
    json_schema_extra={"saved": False},
  )


class MoEGeneral(BaseModel):
  """Sparse mixture of experts: routing, capacity and the grouped-matmul kernels."""

  num_experts: int = Field(
    1,
    description="> 1 = Mixtral-style sparse MoE MLP in every layer (1 = dense SwiGLU)",
    json_schema_extra={"saved": True},
  )
  num_experts_per_tok: int = Field(2, description="top-k experts per token (MoE)", json_schema_extra={"saved": True})
  base_moe_mlp_dim: int = Field(
    -1, description="hidden width of each expert's SwiGLU; -1 = base_mlp_dim", json_schema_extra={"saved": True}
  )
  norm_topk_prob: bool = Field(
    True,
    description=(
      "renormalise the chosen top-k router probabilities to sum to 1 (Mixtral, Qwen3-MoE); MaxText "
      "defaults to false but renormalises Mixtral anyway"
    ),
    json_schema_extra={"saved": True},
  )
  float32_gate_logits: bool = Field(
    True,
    description="router logits computed in float32 (a bfloat16 tie would route by index); MaxText: false",
    json_schema_extra={"saved": False},
  )
  capacity_factor: float = Field(
    -1.0,
    description=(
      "<= 0 = never drop a token; else rows per expert = ceil(tokens * top_k * this / num_experts), "
      "tokens of one batch shard (sparse_matmul) or of one sequence (dispatch)"
    ),
    json_schema_extra={"saved": False},
  )
  sparse_matmul: bool = Field(
    True,
    description=(
      "MoE: sort tokens by expert and run grouped matmuls; false = one-hot dispatch over [tokens, "
      "experts, slots] (GShard), memory and FLOPs growing with the expert count"
    ),
    json_schema_extra={"saved": False},
  )
  megablox: bool = Field(
    True,
    description=(
      "sparse_matmul's grouped matmuls: jax's Pallas TPU kernel (megablox gmm), interpreted on CPU; "
      "false = jax.lax.ragged_dot (needed on GPU)"
    ),
    json_schema_extra={"saved": False},
  )
  ragged_buffer_factor: float = Field(
    -1.0,
    description=(
      "sparse_matmul with expert parallelism: rows sent to each expert shard, x its even share; <= 0 = "
      "room for every row (never drops)"
    ),
    json_schema_extra={"saved": False},
  )
  load_balance_loss_weight: float = Field(
    0.01,
    ge=0,
    description=(
      "weight of the MoE load-balancing loss added to the training loss: MaxText's (num_experts^2 * "
      "mean(density * router prob) per sequence, top_k when balanced; mean over layers), so the same "
      "weight as in MaxText"
    ),
    json_schema_extra={"saved": False},
  )

  @model_validator(mode="after")
  def _expert_width(self) -> MoEGeneral:
    if self.base_moe_mlp_dim == 0 or self.base_moe_mlp_dim < -1:
      raise ConfigError(f"base_moe_mlp_dim={self.base_moe_mlp_dim} must be positive or -1 (= base_mlp_dim)")
    return self


class DeepSeekMoE(BaseModel):
  """DeepSeek's MoE (decoder_block=deepseek; MaxText's keys and defaults)."""

  first_num_dense_layers: int = Field(
    0,
    description="the first N layers have a dense MLP (base_mlp_dim wide), the rest MoE",
    json_schema_extra={"saved": True},
  )
  shared_experts: int = Field(
    0,
    description="MoE: an always-on MLP of shared_experts * moe width beside the routed experts",
    json_schema_extra={"saved": True},
  )
  routed_score_func: str = Field(
    "", description='router scores: "" = softmax | sigmoid (DeepSeek-V3)', json_schema_extra={"saved": True}
  )
  routed_bias: bool = Field(
    False,
    description="a per-expert bias added to the scores for choosing experts only (auxiliary-loss-free)",
    json_schema_extra={"saved": True},
  )
  routed_bias_update_rate: float = Field(
    0.0,
    description="each step the bias moves by this towards balance (+ for under-, - for over-loaded)",
    json_schema_extra={"saved": False},
  )
  routed_scaling_factor: float = Field(
    1.0, description="the chosen experts' weights are multiplied by this", json_schema_extra={"saved": True}
  )
  n_routing_groups: int = Field(
    -1,
    description="experts in groups; a token chooses within its topk_routing_group best groups; -1 = no groups",
    json_schema_extra={"saved": True},
  )
  topk_routing_group: int = Field(
    -1, description="groups ranked by the sum of their two best (biased) scores", json_schema_extra={"saved": True}
  )


class MlaAttention(BaseModel):
  """Multi-head latent attention (attention_type=mla, DeepSeek)."""

  attention_type: str = Field(
    "global", description="global | mla (multi-head latent attention, DeepSeek)", json_schema_extra={"saved": True}
  )
  q_lora_rank: int = Field(
    0,
    description="mla: queries through a rank-q_lora_rank bottleneck; 0 = a full projection",
    json_schema_extra={"saved": True},
  )
  kv_lora_rank: int = Field(
    512, description="mla: keys and values from a rank-kv_lora_rank latent", json_schema_extra={"saved": True}
  )
  qk_nope_head_dim: int = Field(
    128, description="mla: per-head query/key features without RoPE", json_schema_extra={"saved": True}
  )
  qk_rope_head_dim: int = Field(
    64,
    description="mla: per-head query features with RoPE (one RoPE key shared by all heads)",
    json_schema_extra={"saved": True},
  )
  v_head_dim: int = Field(128, description="mla: per-head value features", json_schema_extra={"saved": True})
  mscale: float = Field(
    1.0,
    description="mla, yarn: softmax scale x (0.1 mscale ln(rope_factor) + 1)^2 (HF mscale_all_dim)",
    json_schema_extra={"saved": True},
  )

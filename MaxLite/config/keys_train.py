"""The training run's config keys (steps, optimizer, ensembles, data, post-training, GRPO, LoRA), grouped by concern.

Each field is the one declaration of a key: its type, its default and its one-line description. configs/base.yml,
config_keys.py and the README's tables of keys are written from these fields (`python -m MaxLite.config.generate`);
`schema.py` composes these groups with the model's and the job's.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from MaxLite.cli.errors import ConfigError
from MaxLite.config import choices

# The closed lists are choices.py's: Literal[tuple] is a Literal of its items.
DatasetType = Literal[choices.DATASET_TYPES]
SyntheticTokens = Literal[choices.SYNTHETIC_TOKENS]
FileType = Literal[choices.FILE_TYPES]
LoraWeightQtype = Literal[choices.LORA_WEIGHT_QTYPES]
EnsembleData = Literal[choices.ENSEMBLE_DATA]
TokenizerType = Literal[choices.TOKENIZER_TYPES]


class RunInfo(BaseModel):
  """The run: its name, output directory, length and seeds."""

  run_name: str = Field("", description='run directory name under base_output_directory; "" = maxlite_<timestamp>')
  base_output_directory: str = Field(
    "outputs",
    description="parent of <run_name>/ (checkpoints/, tensorboard/, metrics.jsonl)",
  )
  steps: int = Field(200, gt=0, description="number of optimizer steps to train")
  log_period: int = Field(1, gt=0, description="write a metrics row every N steps (loss is always checked for NaN)")
  seed: int = Field(0, ge=0, lt=2**32, description="seed for per-step RNG (dropout), fold_in(seed, step)")
  init_weights_seed: int = Field(0, ge=0, lt=2**32, description="seed for parameter initialisation")


class Optimizer(BaseModel):
  """Batch, sequence length, learning-rate schedule, AdamW and the loss's extra terms."""

  per_device_batch_size: float = Field(
    4.0,
    gt=0,
    description="sequences per device per step (may be fractional: the global batch must be whole)",
  )
  max_target_length: int = Field(256, gt=0, description="sequence length in tokens")
  gradient_accumulation_steps: int = Field(
    1,
    gt=0,
    description="microbatches per optimizer step; the step sees the same global batch",
  )
  learning_rate: float = Field(0.003, gt=0, description="peak learning rate")
  warmup_steps_fraction: float = Field(
    0.1,
    ge=0,
    lt=1,
    description="fraction of learning_rate_schedule_steps spent in linear warmup",
  )
  learning_rate_final_fraction: float = Field(
    0.1,
    ge=0,
    le=1,
    description="final lr = learning_rate * this, reached at learning_rate_schedule_steps",
  )
  learning_rate_schedule_steps: int = Field(-1, description="length of warmup+cosine schedule; -1 = steps")
  adam_b1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
  adam_b2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2")
  adam_eps: float = Field(1e-08, gt=0, description="AdamW epsilon")
  adam_weight_decay: float = Field(0.1, ge=0, description="AdamW decoupled weight decay (not applied to norm scales)")
  gradient_clipping_threshold: float = Field(
    1.0, ge=0, description="global-norm clipping; 0 disables (negative is refused)"
  )
  z_loss_multiplier: float = Field(
    0.0,
    ge=0,
    description="weight of the z-loss (log Z)^2 term that keeps logits from drifting",
  )

  @model_validator(mode="after")
  def _schedule(self) -> Optimizer:
    if self.learning_rate_schedule_steps != -1 and self.learning_rate_schedule_steps <= 0:
      raise ConfigError(
        f"learning_rate_schedule_steps must be positive, or -1 for steps, got {self.learning_rate_schedule_steps}"
      )
    return self


class Ensemble(BaseModel):
  """Several members of one model trained in one program (seed or learning-rate sweeps)."""

  ensemble_size: int = Field(
    1,
    gt=0,
    description="members of this model trained in one program (seed or learning-rate sweeps)",
  )
  ensemble_learning_rates: list[float] = Field(
    [],
    description="one peak learning rate per member (then all members share the seeds)",
  )
  ensemble_data: EnsembleData = Field(
    "same", description="same: every member sees the same batches | distinct: each its own"
  )
  ensemble_member: int = Field(-1, description="decode.py / to_hf: which member of an ensemble checkpoint to use")


class Dataset(BaseModel):
  """Training and eval data: files, format, tokenizer, packing and eval cadence."""

  dataset_type: DatasetType = Field(
    "grain",
    description="grain (ArrayRecord, Parquet or JSONL files) | synthetic (generated, learnable sequences)",
    json_schema_extra={
      "unsupported": "MaxText's hf and tfds pipelines are not in MaxLite: save the data set as Parquet or JSONL, or "
      "as ArrayRecord with prepare_data.py, and read it with grain"
    },
  )
  synthetic_tokens: SyntheticTokens = Field(
    "patterns",
    description=(
      "dataset_type=synthetic: patterns (each row repeats a short Zipf-drawn pattern: learnable) | uniform "
      "(independent ids, uniform over the vocabulary: MaxText's synthetic data, for benchmarks beside it)"
    ),
  )
  grain_train_files: str = Field(
    "assets/corpus/train-*.array_record",
    description="glob(s), comma-separated; relative = cwd, else repo root",
  )
  grain_eval_files: str = Field(
    "assets/corpus/eval-*.array_record",
    description='glob(s) of eval files; "" = no eval',
  )
  grain_file_type: FileType = Field(
    "arrayrecord",
    description="arrayrecord | parquet | jsonl: the format of grain_train_files and grain_eval_files",
  )
  grain_text_column: str = Field(
    "text",
    description="the string column of Parquet rows / field of JSONL objects holding each document",
  )
  grain_worker_count: int = Field(
    0,
    description="threads filling the batch rows; 0 = in the training loop's thread (rows never change)",
  )
  tokenizer_path: str = Field(
    "assets/tokenizer/maxlite_sp8k.model",
    description=(
      "tokenizer file (huggingface: tokenizer.json or its directory); shipped: a sentencepiece model of "
      "8192 pieces trained on the corpus"
    ),
  )
  tokenizer_type: TokenizerType = Field(
    "sentencepiece",
    description=(
      "sentencepiece (.model) | huggingface (tokenizer.json: Llama 3.x, Qwen) | tiktoken (Meta's Llama "
      "3 original/tokenizer.model)"
    ),
  )
  add_bos: bool = Field(
    True,
    description=("prepend BOS to each document (skipped when the tokenizer has none, e.g. Qwen; warned only if set)"),
  )
  add_eos: bool = Field(True, description="append EOS to each document (likewise skipped without one)")
  max_segments_per_seq: int = Field(
    -1,
    description=(
      "most documents (segments) packed into one row; -1 = no cap (cudnn attention: 32, the fixed count "
      "its packed layout is built for)"
    ),
  )
  data_shuffle_seed: int = Field(0, ge=0, lt=2**32, description="seed for the deterministic record shuffle")
  eval_interval: int = Field(100, description="run eval after every N-th step; -1 = never")
  eval_steps: int = Field(10, description="batches per eval")

  @model_validator(mode="after")
  def _file_types(self) -> Dataset:
    """Files whose names say another type than grain_file_type: one line now, not a reader's complaint later (the
    default eval files are the shipped ArrayRecord corpus, easy to forget when the train files are Parquet)."""
    if self.dataset_type != "grain":
      return self
    for key in ("grain_train_files", "grain_eval_files"):
      for pattern in getattr(self, key).split(","):
        named = [t for t, suffix in choices.FILE_SUFFIXES.items() if pattern.strip().endswith(suffix)]
        if named and named[0] != self.grain_file_type:
          fix = f"set grain_file_type={named[0]}"
          if key == "grain_eval_files":
            fix = f"set grain_eval_files to {self.grain_file_type} files, or '' (no eval)"
          raise ConfigError(
            f"{key}={getattr(self, key)!r} names {named[0]} files but grain_file_type={self.grain_file_type!r}; {fix}"
          )
    return self

  @model_validator(mode="after")
  def _eval(self) -> Dataset:
    if self.eval_interval != -1 and (self.eval_interval <= 0 or self.eval_steps <= 0):
      raise ConfigError(
        f"eval_interval ({self.eval_interval}) and eval_steps ({self.eval_steps}) must be positive "
        "(eval_interval=-1 disables eval)"
      )
    return self


class PostTraining(BaseModel):
  """The records post-training reads (MaxText's keys); each objective's own keys are in MaxLite/objectives/."""

  train_data_columns: list[str] = Field(
    [],
    description=(
      "record fields. SFT: ['messages'] (default) or ['prompt', 'completion']; DPO: ['prompt', "
      "'chosen', 'rejected'] (default) or ['chosen', 'rejected']; pretraining: [text column]"
    ),
  )
  eval_data_columns: list[str] = Field([], description="the same for grain_eval_files; [] = train_data_columns")
  use_chat_template: bool = Field(
    False,
    description="render records with the tokenizer's chat template (tokenizer_type=huggingface)",
  )
  chat_template_path: str = Field(
    "",
    description='a .jinja file or a tokenizer_config-style .json with "chat_template"; "" = the tokenizer\'s',
  )


class Lora(BaseModel):
  """LoRA / QLoRA (MaxText's keys, layers/lora.py): low-rank adapters on the projections, the base frozen."""

  enable_lora: bool = Field(False, description="train (or decode with) LoRA adapters instead of the full weights")
  lora_rank: int = Field(16, description="r: adapters A [in, r] and B [r, out] (B starts at zero)")
  lora_alpha: float = Field(32.0, description="the adapters' output is scaled by lora_alpha / lora_rank, as PEFT does")
  lora_module_path: str = Field(
    "",
    description='regex over module paths; "" = every attention and MLP projection of every layer',
  )
  lora_weight_qtype: LoraWeightQtype = Field(
    "",
    description='QLoRA: the frozen base stored by Qwix as nf4 | int8 | int4; "" = weight_dtype',
  )
  lora_tile_size: int = Field(0, description="QLoRA: subchannel tile of the base's contraction axis (0 = per channel)")
  lora_restore_path: str = Field(
    "",
    description="adapters to start from: a MaxLite LoRA checkpoint step dir (ignored on resume)",
  )
  hf_lora_adapter_path: str = Field(
    "",
    description="adapters to start from: a PEFT adapter folder (adapter_config.json + safetensors)",
  )

  @model_validator(mode="after")
  def _consistent(self) -> Lora:
    """Refused at load: adapters named without LoRA on would be silently ignored; the rest fail after the model is
    built (a rank of 0, a pattern that is not a regex) or start the adapters from two places at once. How LoRA meets
    the other groups (quantization, emergency checkpoints, QLoRA tiles) is validation.py's."""
    if not self.enable_lora:
      for key in ("lora_restore_path", "hf_lora_adapter_path"):
        if getattr(self, key):
          raise ConfigError(
            f"{key} is set but enable_lora=false: set enable_lora=true to train or decode with adapters"
          )
      return self
    if self.lora_rank <= 0:
      raise ConfigError(f"lora_rank must be a positive integer with enable_lora=true, got {self.lora_rank}")
    if not self.lora_alpha > 0:
      raise ConfigError(f"lora_alpha must be positive with enable_lora=true, got {self.lora_alpha}")
    if self.lora_tile_size < 0:
      raise ConfigError(f"lora_tile_size must be 0 (per channel) or a positive tile, got {self.lora_tile_size}")
    try:
      re.compile(self.lora_module_path)
    except re.error as e:
      raise ConfigError(f"lora_module_path={self.lora_module_path!r} is not a regular expression: {e}") from None
    if self.lora_restore_path and self.hf_lora_adapter_path:
      raise ConfigError("lora_restore_path and hf_lora_adapter_path are both set: start the adapters from one of them")
    return self

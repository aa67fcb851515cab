"""GPT-OSS's own config keys (decoder_block=gpt_oss), declared beside the family rather than in config/keys_model.py.

MaxText's names and defaults; each changes the function the parameters compute, so a checkpoint saves it ("saved",
config/keys_model.py says why). jax-free: the schema reads this group (through models/__init__.py's KEY_GROUPS) for
`--help` and config validation before any runtime starts; models/gpt_oss.py turns the keys into the features it asks
of the shared layers (attention sinks, expert biases, the clamped gated unit).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, Field, model_validator

from MaxLite.cli.errors import ConfigError


class GptOss(BaseModel):
  """GPT-OSS (decoder_block=gpt_oss; MaxText's keys and defaults; false / -1 = off)."""

  decoder_blocks: ClassVar[tuple[str, ...]] = ("gpt_oss",)  # set under another family, these are refused

  attention_sink: bool = Field(
    False,
    description="gpt_oss: a learned logit per query head joins each softmax's denominator (attention sinks)",
    json_schema_extra={"saved": True},
  )
  mlp_bias: bool = Field(
    False,
    description="gpt_oss: learned biases on each expert's gate, up and down projections",
    json_schema_extra={"saved": True},
  )
  mlp_activations_limit: float = Field(
    -1.0,
    description=(
      "gpt_oss: experts clamp gate to <= this and up to [-this, this] before gate * sigmoid(1.702 gate) * (up + 1); "
      "-1 = no clamp"
    ),
    json_schema_extra={"saved": True},
  )

  @model_validator(mode="after")
  def _limit(self) -> GptOss:
    if not (self.mlp_activations_limit > 0 or self.mlp_activations_limit == -1):
      raise ConfigError(f"mlp_activations_limit={self.mlp_activations_limit} must be > 0 or -1 (no clamp)")
    return self

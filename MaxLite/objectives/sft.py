"""Supervised fine-tuning (MaxText's use_sft): next-token cross-entropy on chats or prompt/completion records,
rendered by the data pipeline (data/records.py), with the prompt masked out of the loss when
sft_train_on_completion_only is set. The loss is pretraining's (objectives/pretraining.py) over the learned tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field

from MaxLite.config import objectives, post_training
from MaxLite.config.choices import SFT_COLUMNS
from MaxLite.objectives import pretraining


class Sft(BaseModel):
  """Supervised fine-tuning (MaxText's keys)."""

  use_sft: bool = Field(
    False,
    description="supervised fine-tuning on chats or prompt/completion records (train_data_columns)",
  )
  sft_train_on_completion_only: bool = Field(
    False,
    description="SFT: the loss covers only the assistant's tokens (the prompt is still attended to)",
  )


KEY_GROUPS = (Sft,)


def selects(c: Mapping[str, Any]) -> bool:
  return bool(c["use_sft"])


OBJECTIVE = objectives.register(
  objectives.Objective(
    name="sft",
    flag="use_sft",
    selects=selects,
    loss_sums=pretraining.loss_sums,
    train_metrics=pretraining.train_metrics,
    eval_metrics=pretraining.eval_metrics,
    record_kind=lambda c: post_training.data_kind(c["train_data_columns"]),
    derive=lambda c: post_training.derive_records(c, SFT_COLUMNS, "use_sft"),
    reads_records=True,
  )
)

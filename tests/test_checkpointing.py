"""Orbax checkpoints: a run stopped and resumed from its checkpoint continues exactly."""

import os

import pytest

from conftest import first_devices, make_config
from MaxLite.trainer import train

BASE = ("model_name=tiny", "max_target_length=64", "per_device_batch_size=4", "enable_tensorboard=false",
        "learning_rate=1e-2", "learning_rate_schedule_steps=8")


@pytest.mark.parametrize("data", ["dataset_type=synthetic", "dataset_type=grain"])
def test_resume_equals_uninterrupted_run(tmp_path, data):
  straight = train(make_config(*BASE, data, "steps=8", f"base_output_directory={tmp_path}", "run_name=a"),
                   first_devices(1))
  resumed_args = (*BASE, data, f"base_output_directory={tmp_path}", "run_name=b", "enable_checkpointing=true",
                  "checkpoint_period=3")
  first = train(make_config(*resumed_args, "steps=5"), first_devices(1))
  # Period 3 plus the final step: checkpoints at 3 and 5.
  assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == ["3", "5"]
  second = train(make_config(*resumed_args, "steps=8"), first_devices(1))
  assert [r["step"] for r in second] == [6, 7, 8]
  losses = lambda rows: [r["loss"] for r in rows if "loss" in r]
  assert losses(first) + losses(second) == losses(straight)  # bit for bit

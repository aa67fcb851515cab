"""A run resumes from its own checkpoint only with the data stream and model it was saved with."""

import json
import logging

import pytest
from support.config import make_config, run_train_cli

from MaxLite.checkpoint.resume_checks import check_resume, resume_differences
from MaxLite.cli.errors import CheckpointError

TINY = ("model_name=tiny", "max_target_length=64", "eval_interval=-1", "enable_tensorboard=false", "log_period=1")


def _as_saved(config) -> dict:
  return json.loads(json.dumps(config.to_dict()))


def test_only_stream_and_model_keys_count():
  saved = _as_saved(make_config(*TINY, "steps=10"))
  grown = _as_saved(make_config(*TINY, "steps=20", "learning_rate=1e-4", "checkpoint_period=7"))
  assert resume_differences(saved, grown) == []
  other_mesh = _as_saved(
    make_config(*TINY, "per_device_batch_size=1", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", num_devices=8)
  )
  single = _as_saved(make_config(*TINY, "per_device_batch_size=8"))  # the same global batch of 8 rows on 1 device
  assert resume_differences(other_mesh, single) == []
  changed = _as_saved(make_config(*TINY, "data_shuffle_seed=5", "max_target_length=32", "base_num_decoder_layers=3"))
  assert resume_differences(saved, changed) == [
    "data_shuffle_seed 0 -> 5",
    "max_target_length 64 -> 32",
    "base_num_decoder_layers 2 -> 3",
  ]
  bigger_batch = _as_saved(make_config(*TINY, "per_device_batch_size=8"))
  assert resume_differences(saved, bigger_batch) == ["global_batch_size_to_train_on 4 -> 8"]
  synthetic = _as_saved(make_config(*TINY, "dataset_type=synthetic"))
  assert (
    resume_differences(synthetic, _as_saved(make_config(*TINY, "dataset_type=synthetic", "tokenizer_path=x"))) == []
  )
  # synthetic_tokens is the synthetic stream's own key: it counts there, and only there
  uniform = ("dataset_type=synthetic", "synthetic_tokens=uniform")
  assert resume_differences(synthetic, _as_saved(make_config(*TINY, *uniform))) == [
    "synthetic_tokens 'patterns' -> 'uniform'"
  ]
  assert resume_differences(saved, _as_saved(make_config(*TINY, "synthetic_tokens=uniform"))) == []
  assert resume_differences(saved, _as_saved(make_config(*TINY, "tokenizer_path=x"))) == [
    "tokenizer_path 'assets/tokenizer/maxlite_sp8k.model' -> 'x'"
  ]
  assert resume_differences(saved, _as_saved(make_config(*TINY, "tokenizer_type=huggingface"))) == [
    "tokenizer_type 'sentencepiece' -> 'huggingface'"
  ]
  jsonl = ("grain_file_type=jsonl", "grain_text_column=content", "grain_train_files=d/*.jsonl", "grain_eval_files=")
  assert resume_differences(saved, _as_saved(make_config(*TINY, *jsonl))) == [
    "grain_train_files 'assets/corpus/train-*.array_record' -> 'd/*.jsonl'",
    "grain_file_type 'arrayrecord' -> 'jsonl'",
    "grain_text_column 'text' -> 'content'",
  ]


def _train(tmp_path, *overrides):
  return run_train_cli(
    *TINY, f"base_output_directory={tmp_path}", "run_name=r", "enable_checkpointing=true", *overrides
  )


@pytest.mark.slow
def test_a_changed_data_stream_stops_the_resume_with_one_line_and_steps_may_grow(tmp_path):
  assert _train(tmp_path, "steps=2").returncode == 0
  changed = _train(tmp_path, "steps=4", "data_shuffle_seed=9", "max_target_length=32")
  errors = [line for line in changed.stderr.splitlines() if line.startswith("error:")]
  assert changed.returncode == 2 and len(errors) == 1, changed.stderr[-3000:]
  assert "data_shuffle_seed 0 -> 9; max_target_length 64 -> 32" in errors[0]
  assert "load_full_state_path=" in errors[0] and "Traceback" not in changed.stderr
  grown = _train(tmp_path, "steps=4")
  assert grown.returncode == 0, grown.stderr[-3000:]
  assert "resumed from checkpoint at step 2" in grown.stderr


def test_a_step_without_its_saved_config_is_resumed_with_a_warning_naming_what_is_not_checked(tmp_path, caplog):
  step_dir = tmp_path / "checkpoints" / "6"
  step_dir.mkdir(parents=True)
  with caplog.at_level(logging.WARNING):
    check_resume(str(step_dir), make_config(*TINY))
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert len(warnings) == 1, warnings
  assert f"checkpoint {step_dir} has no saved config ({step_dir}/config/config.json)" in warnings[0]
  assert "data_shuffle_seed" in warnings[0] and "not checked" in warnings[0]


def test_a_resume_with_another_model_points_to_the_checkpoints_model_not_to_load_full_state_path(tmp_path):
  step_dir = tmp_path / "checkpoints" / "6"
  (step_dir / "config").mkdir(parents=True)
  (step_dir / "config" / "config.json").write_text(json.dumps(_as_saved(make_config(*TINY))))
  with pytest.raises(CheckpointError) as error:
    check_resume(str(step_dir), make_config(*TINY[1:]))  # the default model
  message = str(error.value)
  assert "base_emb_dim 64 -> 256" in message and "\n" not in message
  assert "Drop base_emb_dim, " in message and "model_name=tiny" in message
  assert "load_full_state_path" not in message

"""What a new user meets before any training matters: a shipped config named by its relative name outside
a checkout, no TPU probe in a CPU run's log, and no BOS warning where nobody asked for a BOS."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from support.config import BASE_YML, FAST_COMPILE, REPO, make_config

from MaxLite.config import load_raw
from MaxLite.data.input_pipeline import check_tokenizer
from MaxLite.runtime import platforms, preflight


def test_a_shipped_config_loads_by_its_relative_name_from_any_directory(tmp_path, monkeypatch):
  """`maxlite-train configs/base.yml` in a directory without configs/: the shipped file, as assets/... already are."""
  monkeypatch.chdir(tmp_path)
  assert load_raw(["configs/base.yml", "model_name=tiny"])["model_name"] == "tiny"
  assert load_raw(["configs/tpu/v5p/32b.yml"])["model_name"] == "maxtext-32b"  # and its base_config chain


def test_a_config_under_the_working_directory_wins_over_the_shipped_one(tmp_path, monkeypatch):
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "base.yml").write_text(f"base_config: {BASE_YML}\nsteps: 7\n")
  monkeypatch.chdir(tmp_path)
  assert load_raw(["configs/base.yml"])["steps"] == 7


def test_a_missing_config_is_still_named_as_typed(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(Exception, match=r"config file not found: .*configs/nope\.yml"):
    load_raw(["configs/nope.yml"])


def test_a_chosen_platform_or_an_accelerator_plugin_is_left_to_jax():
  """Only a machine with nothing but a CPU gets JAX_PLATFORMS=cpu: a TPU or GPU machine keeps jax's own choice."""
  assert not platforms.cpu_is_all_there_is({"JAX_PLATFORMS": "tpu"})
  assert not platforms.cpu_is_all_there_is({"PJRT_NAMES_AND_LIBRARY_PATHS": "cuda:/opt/pjrt_c_api_gpu_plugin.so"})
  environ = {"JAX_PLATFORMS": "cuda"}
  assert not platforms.use_cpu_when_it_is_all_there_is(environ) and environ == {"JAX_PLATFORMS": "cuda"}


@pytest.mark.slow
def test_a_cpu_run_does_not_probe_for_a_tpu(tmp_path):
  """With JAX_PLATFORMS unset on a machine without TPU chips, jax would try libtpu first and log its failure."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env["XLA_FLAGS"] = FAST_COMPILE
  command = [
    sys.executable,
    "MaxLite/train.py",
    "configs/base.yml",
    "model_name=tiny",
    "steps=1",
    "dataset_type=synthetic",
    "enable_checkpointing=false",
    "enable_tensorboard=false",
    "max_target_length=32",
    "per_device_batch_size=1",
    "jax_cache_dir=",
    f"base_output_directory={tmp_path}",
  ]
  done = subprocess.run(
    command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
  )
  assert done.returncode == 0, done.stderr[-3000:]
  probes = [
    line
    for line in (done.stdout + done.stderr).splitlines()
    if "libtpu" in line or "Unable to initialize backend" in line
  ]
  assert not probes, probes


# The README's SFT command (Fine-tune Qwen3-0.6B on chats), with the shipped ChatML tokenizer as
# end_to_end/test_fine_tuning.py runs it: like Qwen's, it has no BOS.
README_SFT = (
  "tokenizer_type=huggingface",
  f"tokenizer_path={os.path.join(REPO, 'assets', 'tokenizer', 'chat')}",
  "use_sft=true",
  "use_chat_template=true",
  "sft_train_on_completion_only=true",
  "grain_file_type=jsonl",
  f"grain_train_files={os.path.join(REPO, 'assets', 'post_training', 'chats-train.jsonl')}",
  f"grain_eval_files={os.path.join(REPO, 'assets', 'post_training', 'chats-eval.jsonl')}",
  "max_target_length=1024",
)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_tokenizer_without_a_bos_and_the_default_add_bos_warns_nothing(caplog):
  with caplog.at_level(logging.WARNING):
    check_tokenizer(make_config(*README_SFT))
  assert not _warnings(caplog)


def test_add_bos_set_explicitly_for_a_tokenizer_without_one_is_warned(caplog):
  with caplog.at_level(logging.WARNING):
    check_tokenizer(make_config(*README_SFT, "add_bos=true"))
  assert [m.split(" but ")[0] for m in _warnings(caplog)] == ["add_bos=true"]


def test_which_keys_were_set_explicitly_is_no_difference_between_the_processes_of_a_job():
  """The explicit keys add_bos needs are not compared across processes: typing a default on one host is the same run."""
  typed, left = make_config("run_name=r", "steps=200"), make_config("run_name=r")
  assert "steps" in typed.explicit_keys and "steps" not in left.explicit_keys
  assert preflight.config_digest(typed.to_dict()) == preflight.config_digest(left.to_dict())

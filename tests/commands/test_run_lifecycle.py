"""What a new user sees around a training run: its closing line, resuming it without repeating its model,
a resume with nothing left to do, the model a loaded checkpoint holds, and no run directory from a run that fails."""

import json
import os
import re
import shutil

import pytest
from support.config import first_devices, make_config, run_train_cli

from MaxLite.training.start import summarize
from MaxLite.training.trainer import train

# Every test here uses the module's tiny run: a real checkpoint, resumed or loaded.
RUN = (
  "dataset_type=synthetic",
  "max_target_length=32",
  "per_device_batch_size=2",
  "enable_tensorboard=false",
  "enable_checkpointing=true",
  "run_name=r",
)
TINY = ("model_name=tiny", *RUN)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A tiny run of 2 steps with an eval at step 2, checkpointed: (its output directory, its result)."""
  out = tmp_path_factory.mktemp("first_hour")
  done = run_train_cli(*TINY, f"base_output_directory={out}", "steps=2", "eval_interval=2", "eval_steps=1")
  assert done.returncode == 0, done.stderr[-3000:]
  return out, done


def _copy(finished, tmp_path) -> str:
  """The finished run's output directory, copied: each test resumes its own."""
  shutil.copytree(finished[0], tmp_path / "out")
  return str(tmp_path / "out")


def _errors(result) -> list[str]:
  return [line for line in result.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_a_run_ends_with_one_line_naming_its_step_checkpoint_eval_loss_and_metrics(finished, tmp_path, capsys):
  out, done = finished
  rows = [json.loads(line) for line in open(os.path.join(out, "r", "metrics.jsonl"))]
  eval_loss = [row["eval_loss"] for row in rows if "eval_loss" in row][-1]
  run_dir = os.path.join(out, "r")
  assert done.stdout.splitlines()[-1] == (
    f"done: step 2, saved to {run_dir}/checkpoints/2, eval loss {eval_loss:.4f} at step 2, "
    f"metrics in {run_dir}/metrics.jsonl"
  )
  config = make_config(
    "model_name=tiny", *RUN[:4], "steps=1", "enable_checkpointing=false", f"base_output_directory={tmp_path}"
  )
  rows = train(config, first_devices(1))
  last_eval = rows[-1]["eval_loss"]  # the last step is evaluated whatever eval_interval says (100 here)
  assert capsys.readouterr().out.splitlines()[-1] == (
    f"done: step 1, not saved (enable_checkpointing=false), eval loss {last_eval:.4f} at step 1, "
    f"metrics in {config.metrics_file}"
  )


@pytest.mark.slow
def test_resuming_a_run_at_its_last_step_says_there_is_nothing_to_do(finished, tmp_path):
  out = _copy(finished, tmp_path)
  metrics = open(os.path.join(out, "r", "metrics.jsonl")).read()
  again = run_train_cli(*TINY, f"base_output_directory={out}", "steps=2")
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.splitlines()[-1].startswith(f"nothing to do: step 2 of 2 already saved in {out}/r/checkpoints"), (
    again.stdout
  )
  assert "done:" not in again.stdout
  assert open(os.path.join(out, "r", "metrics.jsonl")).read() == metrics


@pytest.mark.slow
def test_resuming_without_the_model_name_takes_the_model_from_the_checkpoint(finished, tmp_path):
  out = _copy(finished, tmp_path)
  resumed = run_train_cli(*RUN, f"base_output_directory={out}", "steps=3")  # the default model_name
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  taken = [line for line in resumed.stderr.splitlines() if "model from the checkpoint" in line]
  assert len(taken) == 1, resumed.stderr[-3000:]
  assert f"model from the checkpoint {out}/r/checkpoints/2: model_name=tiny, base_emb_dim=64," in taken[0]
  assert "model tiny:" in resumed.stderr and "resumed from checkpoint at step 2" in resumed.stderr
  assert resumed.stdout.splitlines()[-1].startswith("done: step 3, ")


def test_resuming_with_a_different_model_set_on_the_command_line_is_one_error_naming_the_key(finished, tmp_path):
  out = _copy(finished, tmp_path)
  changed = run_train_cli(*RUN, f"base_output_directory={out}", "steps=3", "base_emb_dim=32")
  errors = _errors(changed)
  assert changed.returncode == 2 and len(errors) == 1, changed.stderr[-3000:]
  assert errors[0] == (
    f"error: run_name=r resumes the checkpoint {out}/r/checkpoints/2, whose model has base_emb_dim=64, but "
    "base_emb_dim=32 (set on the command line); a resumed run keeps its model: drop those settings (the model then "
    "comes from the checkpoint) or use a new run_name"
  )


def test_the_start_line_names_the_model_a_loaded_checkpoint_holds(finished, tmp_path):
  step_dir = os.path.join(finished[0], "r", "checkpoints", "2")
  assert summarize(make_config(f"load_parameters_path={step_dir}")).startswith("model tiny: ")
  # A converted checkpoint (hf.to_maxlite) saves the model keys but names no model: the line names the checkpoint.
  converted = tmp_path / "converted" / "0"
  os.makedirs(converted / "config")
  saved = json.load(open(os.path.join(step_dir, "config", "config.json")))
  saved.pop("model_name")
  json.dump(saved, open(converted / "config" / "config.json", "w"))
  assert summarize(make_config(f"load_parameters_path={converted}")).startswith(f"model of {converted}: ")


@pytest.mark.slow
def test_a_run_that_fails_its_checks_leaves_no_run_directory_and_an_existing_one_as_it_was(finished, tmp_path):
  new = tmp_path / "new_outputs"
  for failing in (
    ("model_name=tiny", "vocab_size=100"),  # the tokenizer's vocabulary is larger: refused before the lock
    (*TINY, f"load_parameters_path={tmp_path}/nowhere/5"),  # refused after the lock made the run directory
  ):
    failed = run_train_cli(*failing, f"base_output_directory={new}", "run_name=fresh", "steps=1")
    assert failed.returncode == 2 and len(_errors(failed)) == 1, failed.stderr[-3000:]
    assert not new.exists(), sorted(str(p) for p in new.rglob("*"))
  out = _copy(finished, tmp_path)
  before = {str(p): p.stat().st_size for p in (tmp_path / "out").rglob("*")}
  # Refused after the lock, in a run directory that was there before: it keeps all it had.
  failed = run_train_cli(*TINY, "dataset_type=grain", f"base_output_directory={out}", "steps=3")
  assert failed.returncode == 2 and "dataset_type 'synthetic' -> 'grain'" in _errors(failed)[0], failed.stderr[-3000:]
  assert {str(p): p.stat().st_size for p in (tmp_path / "out").rglob("*")} == before


def test_the_start_line_says_a_run_is_quantized():
  from MaxLite.training.start import summarize

  first = lambda *o: summarize(make_config("model_name=tiny", *o)).splitlines()[0]  # noqa: E731
  assert first("quantization=int8", "use_qwix_quantization=true").endswith(", int8 matmuls (Qwix)")
  assert "matmuls" not in first()


def test_a_run_says_it_is_compiling_before_its_first_step(finished):
  """Step 1 hid 10-19 s of compile on a laptop (minutes on a pod model) with nothing printed: the run says so, once."""
  err = finished[1].stderr
  assert err.count("compiling the train step ...") == 1, err[-3000:]
  assert re.search(r"compiling the train step: \d+\.\d s", err), err[-3000:]


def test_the_ticker_counts_the_seconds_of_a_long_silence():
  import io
  import time

  from MaxLite.cli import ticker

  out = io.StringIO()
  with ticker.ticking("compiling", every=0.05, out=out):
    time.sleep(0.18)
  lines = out.getvalue().splitlines()
  assert lines[0] == "compiling ..." and re.fullmatch(r"compiling: 0\.\d s", lines[-1]), lines
  assert 2 <= sum(line.startswith("... still compiling (") for line in lines) <= 4, lines
  quiet = io.StringIO()
  with ticker.ticking("compiling", out=quiet, enabled=False):
    pass
  assert quiet.getvalue() == ""


def test_a_stopped_run_says_how_to_resume_it_by_its_name():
  """Without run_name the same command starts a new timestamped run: the hint names the run to resume."""
  from MaxLite.training.checkpointer import resume_hint

  named = make_config("model_name=tiny", "run_name=mine")
  assert resume_hint(named) == "run the same command"
  unnamed = make_config("model_name=tiny")
  assert resume_hint(unnamed) == f"run the same command with run_name={unnamed.run_name}"
  assert unnamed.run_name.startswith("maxlite_")

"""decode.py from a trained checkpoint: batched prompts, greedy and sampled, printed text; bad input is one line."""

import json
import os
import subprocess
import sys

import procs
import pytest

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

DECODE = os.path.join(procs.REPO, "MaxLite", "decode.py")


def _decode(*overrides):
  return subprocess.run(
    [sys.executable, DECODE, procs.BASE_YML, "jax_cache_dir=", *overrides],
    capture_output=True,
    text=True,
    timeout=300,
    env=procs.env_with_devices(1),
  )


def test_decode_from_a_trained_checkpoint(tmp_path):
  log = str(tmp_path / "train.log")
  code = procs.run(
    procs.train_command(
      "model_name=tiny",
      "steps=30",
      "max_target_length=64",
      "eval_interval=-1",
      "enable_checkpointing=true",
      f"base_output_directory={tmp_path}",
      "run_name=t",
    ),
    log,
  )
  assert code == 0, procs.tail(log)
  step = str(tmp_path / "t" / "checkpoints" / "30")
  # No model arguments: tiny's settings come from the checkpoint.
  greedy = _decode(
    f"load_parameters_path={step}",
    "prompt=The Python ||| import",
    "max_decode_steps=8",
    "max_prefill_predict_length=16",
    "max_target_length=64",
  )
  assert greedy.returncode == 0, greedy.stderr[-3000:]
  # Each prompt, then its completion, on labeled lines (JSON strings). A barely trained model may well continue with
  # newlines; what matters is that text was added.
  printed = [line.split(": ", 1) for line in greedy.stdout.splitlines()]
  assert [label for label, _ in printed] == ["[0] prompt", "[0] completion", "[1] prompt", "[1] completion"], printed
  texts = [json.loads(text) for _, text in printed]
  assert texts[0] == "The Python" and texts[2] == "import" and texts[1] and texts[3], greedy.stdout
  again = _decode(
    f"load_parameters_path={step}",
    "prompt=The Python ||| import",
    "max_decode_steps=8",
    "max_prefill_predict_length=16",
    "max_target_length=64",
  )
  assert again.stdout == greedy.stdout  # greedy is deterministic
  sampled = _decode(
    f"load_parameters_path={step}",
    "prompt=The Python",
    "decode_sampling_strategy=nucleus",
    "max_decode_steps=8",
    "max_prefill_predict_length=16",
    "max_target_length=64",
  )
  assert sampled.returncode == 0, sampled.stderr[-3000:]
  assert sampled.stdout.startswith('[0] prompt: "The Python"\n[0] completion: "'), sampled.stdout


def test_decode_bad_input_is_one_line(tmp_path):
  missing = _decode(f"load_parameters_path={tmp_path / 'nope'}")
  assert missing.returncode == 2 and "load_parameters_path" in missing.stderr and "Traceback" not in missing.stderr
  too_long = _decode("model_name=tiny", "max_prefill_predict_length=200", "max_decode_steps=100")
  assert too_long.returncode == 2 and "exceeds max_target_length=256" in too_long.stderr, too_long.stderr[-2000:]
  bad_strategy = _decode("decode_sampling_strategy=beam")
  assert bad_strategy.returncode == 2 and "decode_sampling_strategy='beam' is not one of" in bad_strategy.stderr

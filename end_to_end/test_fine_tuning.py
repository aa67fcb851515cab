"""SFT on the shipped chats, then DPO on the shipped preference pairs from its checkpoint, as real train.py processes
(the README's own walkthrough runs in test_readme_fine_tuning.py): each run killed and resumed replays the steps
after its checkpoint bit for bit, and 2 processes x 4 devices give the losses of 1 process x 8 devices."""

import numpy as np
import procs
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

CHAT = (
  *procs.TINY,
  "max_target_length=256",
  "vocab_size=4224",
  "enable_tensorboard=false",
  "per_device_batch_size=1",
  "ici_fsdp_parallelism=4",
  "ici_tensor_parallelism=2",
  "steps=6",
  "tokenizer_type=huggingface",
  "tokenizer_path=assets/tokenizer/chat",
  "use_chat_template=true",
  "grain_file_type=jsonl",
  "grain_eval_files=",
)
SFT = (
  "use_sft=true",
  "sft_train_on_completion_only=true",
  "grain_train_files=assets/post_training/chats-train.jsonl",
)
DPO = ("use_dpo=true", "grain_train_files=assets/post_training/preferences-train.jsonl", "learning_rate=1e-3")


def _killed_and_resumed(tmp_path, args, run_name, kill_after):
  """{step: loss} and rows of a single 8-device process killed after step `kill_after` (checkpoints every 2 steps)
  and run again to the end: the killed run up to the kill, uninterrupted so far, then the rerun. The steps the rerun
  replays (those after the checkpoint it resumed from) equal the killed run's bit for bit."""
  command = procs.train_command(*args, f"run_name={run_name}", "enable_checkpointing=true", "checkpoint_period=2")
  killed_rows, resumed_rows = procs.killed_and_run_again(
    command, str(tmp_path / run_name), str(tmp_path / f"{run_name}.log"), kill_after, checkpoint_period=2, devices=8
  )
  killed = procs.losses(killed_rows)
  resumed = procs.losses(resumed_rows)
  assert min(resumed) <= kill_after and max(resumed) == 6 and max(killed) >= kill_after
  replayed = range(min(resumed), max(killed) + 1)
  assert {s: resumed[s] for s in replayed} == {s: killed[s] for s in replayed}  # bit for bit
  return {**killed, **resumed}, killed_rows


def _two_processes(tmp_path, args, run_name):
  log = str(tmp_path / f"{run_name}.log")
  assert procs.run(procs.launch_command(2, 4, *args, f"run_name={run_name}"), log) == 0, procs.tail(log)
  return procs.losses(procs.metric_rows(str(tmp_path / run_name / "metrics.jsonl")))


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
  """The SFT run on 1 process x 8 devices, killed and resumed; its last checkpoint starts DPO."""
  root = tmp_path_factory.mktemp("post_training")
  args = (*CHAT, *SFT, f"base_output_directory={root}")
  return root, args, _killed_and_resumed(root, args, "sft_killed", kill_after=3)


@pytest.mark.parametrize("mode", ["sft", "dpo"])
def test_kill_resume_and_two_processes(sft_run, mode):
  root, args, (one, rows) = sft_run
  if mode == "dpo":
    args = (*CHAT, *DPO, f"base_output_directory={root}", f"load_parameters_path={root}/sft_killed/checkpoints/6")
    one, rows = _killed_and_resumed(root, args, "dpo_killed", kill_after=3)
    np.testing.assert_allclose(one[1], np.log(2), rtol=1e-5)  # step 1: the policy is still the reference
    assert all(0 <= r["rewards/accuracies"] <= 1 and r["pairs"] > 0 for r in rows if "loss" in r)
  assert sorted(one) == list(range(1, 7))
  assert all(r["trained_tokens"] > 0 for r in rows if "loss" in r)
  two = _two_processes(root, args, f"{mode}_two")
  # Processes with another device count round differently in XLA's CPU code: rel 1e-5, not bit for bit.
  np.testing.assert_allclose([two[s] for s in sorted(one)], [one[s] for s in sorted(one)], rtol=1e-5)

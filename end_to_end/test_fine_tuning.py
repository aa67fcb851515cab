"""SFT on the shipped chats, then DPO on the shipped preference pairs from its checkpoint, as real train.py processes
(the README's own walkthrough runs in test_readme_as_written.py): each run killed and resumed equals the
uninterrupted run bit for bit, and 2 processes x 4 devices give the losses of 1 process x 8 devices (the uninterrupted
1 x 8 runs are golden files: end_to_end/golden.py)."""

import signal

import golden
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


CHECKPOINTED = ("enable_checkpointing=true", "checkpoint_period=6")
# The uninterrupted runs on 1 process x 8 devices (end_to_end/golden.py); the SFT one's last checkpoint started the
# DPO one (here the killed and resumed SFT run's last checkpoint starts DPO: it must be the same bits).
SFT_GOLDEN = golden.Golden("sft_chat_1x8", (*CHAT, *SFT, *CHECKPOINTED), devices=8)
DPO_GOLDEN = golden.Golden(
  "dpo_chat_1x8",
  (*CHAT, *DPO, *CHECKPOINTED),
  devices=8,
  note="load_parameters_path: checkpoint 6 of sft_chat_1x8's run",
)


def _killed_and_resumed(tmp_path, args, run_name, kill_after):
  """The metrics rows (each step once) of a single 8-device process killed after step `kill_after` (checkpoints
  every 2 steps) and run again to the end, and {step: loss} of the rows the second run wrote."""
  command = procs.train_command(*args, f"run_name={run_name}", "enable_checkpointing=true", "checkpoint_period=2")
  metrics, log = str(tmp_path / run_name / "metrics.jsonl"), str(tmp_path / f"{run_name}.log")
  proc = procs.start(command, log, devices=8)
  procs.wait_for_step(proc, metrics, kill_after, log)
  procs.wait_for_saved_step(proc, str(tmp_path / run_name / "checkpoints" / str(kill_after // 2 * 2)))
  procs.kill_group(proc, signal.SIGKILL)
  assert procs.run(command, log, devices=8) == 0, procs.tail(log)
  resumed = procs.losses(procs.resumed_rows(metrics, log))
  assert min(resumed) <= kill_after + 1 and max(resumed) == 6
  return procs.metric_rows(metrics), resumed


def _two_processes(tmp_path, args, run_name):
  log = str(tmp_path / f"{run_name}.log")
  assert procs.run(procs.launch_command(2, 4, *args, f"run_name={run_name}"), log) == 0, procs.tail(log)
  return procs.losses(procs.metric_rows(str(tmp_path / run_name / "metrics.jsonl")))


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
  """The SFT run on 1 process x 8 devices, killed after step 3 and resumed; its last checkpoint starts DPO."""
  root = tmp_path_factory.mktemp("post_training")
  args = (*CHAT, *SFT, f"base_output_directory={root}")
  return root, args, _killed_and_resumed(root, args, "sft_killed", kill_after=3)


@pytest.mark.parametrize("mode", ["sft", "dpo"])
def test_kill_resume_and_two_processes(sft_run, mode):
  root, args, (rows, resumed) = sft_run
  if mode == "sft":
    reference = SFT_GOLDEN.load(root)
  else:
    sft_step = root / "sft_killed" / "checkpoints" / "6"
    if golden.UPDATING:  # the reference starts from the uninterrupted SFT run's checkpoint (the sft case's, if run)
      sft_step = root / "golden_sft_chat_1x8" / "checkpoints" / "6"
      if not sft_step.exists():
        SFT_GOLDEN.run(root, "golden_sft_chat_1x8")
    reference = DPO_GOLDEN.load(root, f"load_parameters_path={sft_step}")
    args = (*CHAT, *DPO, f"base_output_directory={root}", f"load_parameters_path={root}/sft_killed/checkpoints/6")
    rows, resumed = _killed_and_resumed(root, args, "dpo_killed", kill_after=3)
    np.testing.assert_allclose(procs.losses(rows)[1], np.log(2), rtol=1e-5)  # step 1: the policy is the reference
    assert all(0 <= r["rewards/accuracies"] <= 1 and r["pairs"] > 0 for r in rows if "loss" in r)
  assert all(r["trained_tokens"] > 0 for r in rows if "loss" in r)
  reference.check(resumed)  # bit for bit
  reference.check(procs.losses(rows), steps=range(1, 7))
  two = _two_processes(root, args, f"{mode}_two")
  one = reference.losses
  # Processes with another device count round differently in XLA's CPU code: rel 1e-5, not bit for bit.
  np.testing.assert_allclose([two[s] for s in range(1, 7)], [one[s] for s in range(1, 7)], rtol=1e-5)

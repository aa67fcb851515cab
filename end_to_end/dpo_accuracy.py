"""SFT then DPO of the default model on the shipped sets, and DPO's preference accuracy on held-out pairs.

  python end_to_end/dpo_accuracy.py [--workdir=DIR] [--sft_steps=400] [--dpo_steps=800]

Runs two train.py processes on this machine's CPU (27 min on 2 cores here): SFT on assets/post_training/
chats-train.jsonl (completion-only loss), then DPO from its last checkpoint (also the frozen reference) on
preferences-train.jsonl, evaluating every 100 steps on preferences-eval-trained-sections.jsonl: 60 pairs that
the train set does not hold, each asking about a trained section and setting its paragraph against another trained
section's. Every paragraph in them is chosen (and rejected) in the train pairs too, so only a policy that matches the
answer to the question prefers the right one. Prints one line per eval (TRL's names) and exits 1 if the last
`eval_rewards/accuracies` is not above 0.9.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from train_runs import train

CHAT = (
  "tokenizer_type=huggingface",
  "tokenizer_path=assets/tokenizer/chat",
  "vocab_size=4096",
  "use_chat_template=true",
  "grain_file_type=jsonl",
  "per_device_batch_size=8",
  "max_target_length=256",
  "enable_tensorboard=false",
  "log_period=100",
)
EVAL_STEPS = 7  # batches of 8 rows, one pair each: 56 of the 60 pairs


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default=None)
  parser.add_argument("--sft_steps", type=int, default=400)
  parser.add_argument("--dpo_steps", type=int, default=800)
  args = parser.parse_args()
  workdir = args.workdir or tempfile.mkdtemp(prefix="dpo_accuracy_")
  os.makedirs(workdir, exist_ok=True)
  sft = train(
    workdir,
    "sft",
    *CHAT,
    "use_sft=true",
    "sft_train_on_completion_only=true",
    "grain_train_files=assets/post_training/chats-train.jsonl",
    "grain_eval_files=assets/post_training/chats-eval.jsonl",
    f"steps={args.sft_steps}",
    f"eval_interval={args.sft_steps}",
    "eval_steps=6",
    "learning_rate=3e-3",
    f"checkpoint_period={args.sft_steps}",
  )
  print(json.dumps({"sft_eval_loss": [r["eval_loss"] for r in sft if "eval_loss" in r][-1]}))
  dpo = train(
    workdir,
    "dpo",
    *CHAT,
    "use_dpo=true",
    f"load_parameters_path={workdir}/sft/checkpoints/{args.sft_steps}",
    "grain_train_files=assets/post_training/preferences-train.jsonl",
    "grain_eval_files=assets/post_training/preferences-eval-trained-sections.jsonl",
    f"steps={args.dpo_steps}",
    f"eval_interval={min(100, args.dpo_steps)}",
    f"eval_steps={EVAL_STEPS}",
    "learning_rate=1e-3",
    f"checkpoint_period={args.dpo_steps}",
  )
  evals = [r for r in dpo if "eval_loss" in r]
  for row in evals:
    print(json.dumps({k: round(v, 4) for k, v in row.items() if k == "step" or k.startswith("eval_")}))
  accuracy = evals[-1]["eval_rewards/accuracies"]
  print(f"held-out pairs: eval_rewards/accuracies {accuracy:.4f} after {args.dpo_steps} DPO steps (> 0.9 asked)")
  return 0 if accuracy > 0.9 else 1


if __name__ == "__main__":
  sys.exit(main())

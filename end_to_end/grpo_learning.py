"""SFT then GRPO of the default model on the shipped arithmetic problems, and the exact-match rate on held-out ones.

  python end_to_end/grpo_learning.py [--workdir=DIR] [--sft_steps=400] [--grpo_steps=200] [--learning_rate=2e-4]

Runs two train.py processes on this machine's CPU (13 min on 2 cores here): a short SFT on
assets/grpo/arithmetic-train.jsonl (the worked completions, completion-only loss), then GRPO from its last checkpoint
on the same prompts with the shipped rewards (exact match of the final number, and the answer's format), evaluating
greedy completions of 192 held-out problems (assets/grpo/arithmetic-eval.jsonl, none of them in the train set) before
the first step and every 50 steps. Prints one line per eval and exits 1 unless the held-out exact-match rate rose by
at least 0.05.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from train_runs import train

TASK = (
  "grain_train_files=assets/grpo/arithmetic-train.jsonl",
  "grain_eval_files=assets/grpo/arithmetic-eval.jsonl",
  "grain_file_type=jsonl",
  "max_target_length=64",
  "enable_tensorboard=false",
  "log_period=50",
)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", default=None)
  parser.add_argument("--sft_steps", type=int, default=400)
  parser.add_argument("--grpo_steps", type=int, default=200)
  parser.add_argument("--learning_rate", type=float, default=2e-4)
  args = parser.parse_args()
  workdir = args.workdir or tempfile.mkdtemp(prefix="grpo_learning_")
  os.makedirs(workdir, exist_ok=True)
  sft = train(
    workdir,
    "sft",
    *TASK,
    "use_sft=true",
    "train_data_columns=['prompt','completion']",
    "sft_train_on_completion_only=true",
    "per_device_batch_size=16",
    f"steps={args.sft_steps}",
    f"eval_interval={args.sft_steps}",
    f"checkpoint_period={args.sft_steps}",
  )
  print(json.dumps({"sft_eval_loss": round([r["eval_loss"] for r in sft if "eval_loss" in r][-1], 4)}))
  grpo = train(
    workdir,
    "grpo",
    *TASK,
    "use_grpo=true",
    f"load_parameters_path={workdir}/sft/checkpoints",
    "max_prefill_predict_length=40",
    "max_decode_steps=24",
    "per_device_batch_size=64",  # 8 prompts x num_generations 8
    "num_generations=8",
    "num_iterations=2",  # two updates per batch of completions, the second clipped against the sampling policy
    "grpo_beta=0.0",  # no KL penalty (as DAPO and Dr. GRPO): the clip alone keeps each update small
    f"learning_rate={args.learning_rate}",
    # Rollouts from the whole distribution at temperature 1 (TRL's defaults, rollout_top_k=0, rollout_top_p=1.0):
    # top-k/top-p would cut the rare right answers GRPO is to find and reinforce.
    "warmup_steps_fraction=0.0",
    f"steps={args.grpo_steps}",
    "eval_interval=50",
    "eval_steps=3",  # 3 batches of 64 held-out prompts
    f"checkpoint_period={args.grpo_steps}",
  )
  evals = [r for r in grpo if "eval_reward" in r]
  for row in evals:
    print(json.dumps({k: round(v, 4) for k, v in row.items() if k == "step" or k.startswith("eval_")}))
  steps = [r for r in grpo if "reward" in r]
  print(json.dumps({"grpo_step_time_s": round(sum(r["step_time_s"] for r in steps[1:]) / max(len(steps) - 1, 1), 3)}))
  before, after = evals[0]["eval_rewards/exact_match/mean"], evals[-1]["eval_rewards/exact_match/mean"]
  print(f"held-out exact match: {before:.4f} after SFT -> {after:.4f} after {args.grpo_steps} GRPO steps")
  return 0 if after >= before + 0.05 else 1


if __name__ == "__main__":
  sys.exit(main())

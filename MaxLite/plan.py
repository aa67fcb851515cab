r"""Find the fastest layout that fits a model on a TPU slice, before booking it.

Usage:
  python MaxLite/plan.py CONFIG.yml model_name=llama2-70b compile_topology=v5p-128 [key=value ...]
      [--explain=N] [--plan_output=FILE]
Example:
  python MaxLite/plan.py configs/base.yml model_name=llama2-70b compile_topology=v5p-128 max_target_length=4096 \
      dtype=bfloat16 plan_time_budget_s=600 --explain=1
Keys given on the command line stay pinned (e.g. ici_tensor_parallelism=4, remat_policy=full,
per_device_batch_size=2); plan_global_batch_size=N fixes the sequences per optimizer step (the planner then
splits them into per-device batches and gradient accumulation). Everything else MaxLite offers is searched:
ICI splits over data/fsdp/sequence/tensor/expert/stage, remat policies (host-offloaded ones included), the
attention kernel, per-device batch, accumulation and pipeline microbatches.

Plans are pruned by the config validator and a memory lower bound, then compiled for the real topology in
plan_workers processes (results cached under plan_cache_dir) until plan_time_budget_s is spent or no plan left
can win. Prints a ranked table (predicted MFU, tokens/s/chip, memory, bottleneck), why the rest were rejected,
writes the best plan as a config file and prints the train.py command. --explain=N breaks plan N down.
"""

from collections.abc import Sequence

from absl import flags

from MaxLite import cli
from MaxLite.config import schema

_EXPLAIN = flags.DEFINE_integer("explain", 0, "print the time and memory breakdown of plan N of the table")
_OUTPUT = flags.DEFINE_string("plan_output", "", "where to write the best plan (default plans/<model>-<topology>.yml)")


def run(argv: Sequence[str]) -> int:
  from MaxLite.planning import planner  # here: --help and a usage error answer without starting jax

  return planner.run(argv, explain_plan=_EXPLAIN.value, plan_output=_OUTPUT.value)


def main() -> None:
  cli.run_config_tool(run, __doc__, keys=schema)


if __name__ == "__main__":
  main()

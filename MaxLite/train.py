"""Train a Llama-family model.

Usage:   python MaxLite/train.py CONFIG.yml [key=value ...]     (or: maxlite-train CONFIG.yml ...)
Example: python MaxLite/train.py configs/base.yml model_name=tiny steps=50 ici_fsdp_parallelism=-1

Every key of configs/base.yml can be set as key=value. The run writes <base_output_directory>/<run_name>/
(metrics.jsonl, tensorboard/, checkpoints/) and resumes from its newest checkpoint when started again.
"""

from __future__ import annotations

from MaxLite.launch import allocator

if __name__ == "__main__":
  allocator.reexec_with_tcmalloc()  # before jax is imported (the console script re-execs in script())

import os  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from absl import logging

from MaxLite import cli, derived, paths, run_lock, topologies
from MaxLite import config as config_lib
from MaxLite.launch import distributed, preflight

_SHOWN_DERIVED = (
  "run_dir",
  "num_devices",
  "num_slices",
  "process_count",
  "mesh_shape",
  "ici_mesh_shape",
  "dcn_mesh_shape",
  "batch_mesh_axes",
  "micro_batch_size",
  "global_batch_size_to_train_on",
  "learning_rate_schedule_steps",
  "num_params",
)


def summarize(config: config_lib.Config) -> str:
  mesh = " x ".join(f"{a}={n}" for a, n in zip(derived.MESH_AXES, config.mesh_shape))
  lines = [
    f"model {config.model_name}: {config.num_params / 1e6:.2f}M params, {config.base_num_decoder_layers} layers, "
    f"emb {config.base_emb_dim}, dtype {config.dtype}/{config.weight_dtype}, data {config.dataset_type}",
    f"mesh {mesh}",
  ]
  lines += [f"  {k} = {getattr(config, k)}" for k in _SHOWN_DERIVED]
  return "\n".join(lines)


def run(argv: Sequence[str]) -> None:
  raw = config_lib.load_raw(argv)
  tpu_present = distributed.tpu_chips_present()
  preflight.check_tpu_support(os.environ, tpu_present)
  flags = topologies.set_libtpu_flags(os.environ, tpu_present)  # before jax opens the TPU
  if flags:
    logging.info(flags)
  if distributed.initialize(raw):
    distributed.shared_run_name(raw)
  config = config_lib.Config(derived.validate_and_derive(raw))
  # Before anything is written: an unreachable bucket is one line now, not a traceback at the first save.
  paths.check_bucket(config.base_output_directory, "base_output_directory")
  preflight.run_all(config, tpu_present)
  if config.jax_cache_dir:
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(config.jax_cache_dir))
  logging.info("config:\n%s", summarize(config))
  logging.info("attention kernel %s (%s)", config.attention_kernel, config.attention_choice)
  from MaxLite.training.trainer import train

  with run_lock.hold(config) as guard:
    train(config, guard=guard)


def main() -> None:
  """Train with the command line in sys.argv; safe to call from another program (it never replaces the process)."""
  cli.run_config_tool(run, __doc__)


def script() -> None:
  """The `maxlite-train` console script: the process is its own, so it may re-exec under tcmalloc first."""
  allocator.reexec_with_tcmalloc()
  main()


if __name__ == "__main__":
  main()

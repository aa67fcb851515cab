"""Train a Llama-family model: python MaxLite/train.py configs/base.yml [key=value ...]."""

from __future__ import annotations

import logging as std_logging
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repo root importable
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from typing import Sequence  # pylint: disable=wrong-import-position

from absl import app, logging  # pylint: disable=wrong-import-position

from MaxLite import config as config_lib, derived, distributed  # pylint: disable=wrong-import-position
from MaxLite.errors import MaxLiteError  # pylint: disable=wrong-import-position

_SHOWN_DERIVED = ("run_dir", "num_devices", "num_slices", "process_count", "mesh_shape", "ici_mesh_shape",
                  "dcn_mesh_shape", "batch_mesh_axes", "micro_batch_size", "global_batch_size_to_train_on",
                  "learning_rate_schedule_steps", "num_params")


def summarize(config: config_lib.Config) -> str:
  mesh = " x ".join(f"{a}={n}" for a, n in zip(derived.MESH_AXES, config.mesh_shape))
  lines = [f"model {config.model_name}: {config.num_params / 1e6:.2f}M params, {config.base_num_decoder_layers} layers, "
           f"emb {config.base_emb_dim}, dtype {config.dtype}/{config.weight_dtype}, data {config.dataset_type}",
           f"mesh {mesh}"]
  lines += [f"  {k} = {getattr(config, k)}" for k in _SHOWN_DERIVED]
  return "\n".join(lines)


def run(argv: Sequence[str]) -> None:
  raw = config_lib.load_raw(argv)
  distributed.initialize(raw)
  config = config_lib.Config(derived.validate_and_derive(raw))
  if config.jax_cache_dir:
    import jax  # pylint: disable=import-outside-toplevel
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(config.jax_cache_dir))
  logging.info("config:\n%s", summarize(config))
  from MaxLite.trainer import train  # pylint: disable=import-outside-toplevel
  train(config)


def _quiet_orbax_info(record: "std_logging.LogRecord") -> bool:
  """Orbax logs several INFO lines per save on every process; keep its warnings and errors only."""
  return record.levelno >= std_logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


def _drop_closed_loop_noise(unraisable: "sys.UnraisableHookArgs") -> None:
  """After one read of a corrupt checkpoint fails, orbax closes its event loop while tensorstore is
  still finishing the sibling reads; their callbacks then fail harmlessly. Keep the error one line."""
  if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
    return
  sys.__unraisablehook__(unraisable)


def main(argv: Sequence[str]) -> None:
  logging.get_absl_handler().addFilter(_quiet_orbax_info)
  sys.unraisablehook = _drop_closed_loop_noise
  try:
    run(argv[1:])
  except MaxLiteError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  logging.set_verbosity(logging.INFO)
  app.run(main)

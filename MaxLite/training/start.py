"""Starting a training run: the TPU checks and libtpu flags before jax opens the device, joining the job, the
config, the preflight checks, then the train loop (it takes the run lock once the inputs are checked). train.py is its
command line."""

from __future__ import annotations

import os
from collections.abc import Sequence

from absl import logging

from MaxLite import config as config_lib
from MaxLite import storage
from MaxLite.cli import streams
from MaxLite.config import choices
from MaxLite.parallel import topologies
from MaxLite.runtime import compiler_options, distributed, preflight
from MaxLite.training import run_lock

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
  "global_batch_size_to_load",
  "learning_rate_schedule_steps",
  "num_params",
)


def summarize(config: config_lib.Config) -> str:
  mesh = " x ".join(f"{a}={n}" for a, n in zip(choices.MESH_AXES, config.mesh_shape))
  model = config.model_name
  loaded = config.load_parameters_path or config.load_full_state_path
  if model == "default" and loaded:  # a converted checkpoint names no model: its settings are the checkpoint's
    model = f"of {loaded}"
  lines = [
    f"model {model}: {config.num_params / 1e6:.2f}M params, {config.base_num_decoder_layers} layers, "
    f"emb {config.base_emb_dim}, dtype {config.dtype}/{config.weight_dtype}, data {config.dataset_type}"
    + (f", {config.quantization} matmuls (Qwix)" if config.quantization else ""),
    f"mesh {mesh}",
  ]
  lines += [f"  {k} = {getattr(config, k)}" for k in _SHOWN_DERIVED]
  return "\n".join(lines)


def _with_chip_peak(config: config_lib.Config) -> config_lib.Config:
  """peak_tflops_per_device=-1 on a chip whose figures are known (a TPU generation, an H100/H200/A100/B200): its
  published dense bf16 peak, so metrics report MFU there without the key."""
  if config.peak_tflops_per_device > 0:
    return config
  import jax

  device = jax.devices()[0]
  chip = topologies.device_chip(device)
  if chip is None:
    return config
  logging.info("MFU against %s's bf16 peak, %.1f TFLOP/s per device", chip.family, chip.peak_bf16_tflops)
  return config_lib.Config({**config.to_dict(), "peak_tflops_per_device": chip.peak_bf16_tflops})


def _say_native_path(config: config_lib.Config) -> None:
  import jax

  from MaxLite.layers.quantization import native_path_note

  device = jax.devices()[0]
  chip = topologies.device_chip(device)
  name = chip.family if chip else device.platform
  note = native_path_note(config.quantization, name, *((chip.peak_int8_tops, chip.peak_fp8_tflops) if chip else (0, 0)))
  if note and jax.process_index() == 0:
    print(note, flush=True)


def run(argv: Sequence[str]) -> int:
  """Train with the config of `argv` (CONFIG.yml key=value ...), in this process; the exit status: 0, or 130 / 129
  for a run that Ctrl-C / a hang-up stopped (after saving its step)."""
  streams.outlive_broken_streams()  # a log pipe or disk that fails must not stop the run before it saves
  raw = config_lib.load_raw(argv, resuming=True)
  tpu_present = distributed.tpu_chips_present()
  preflight.check_tpu_support(os.environ, tpu_present)
  flags = topologies.set_libtpu_flags(os.environ, tpu_present)  # before jax opens the TPU
  if flags:
    logging.info(flags)
  if distributed.initialize(raw):
    distributed.shared_run_name(raw)
  config = _with_chip_peak(config_lib.build(raw))
  # Before anything is written: an unreachable bucket is one line now, not a traceback at the first save.
  storage.check_bucket(config.base_output_directory, "base_output_directory")
  preflight.run_all(config, tpu_present)
  if config.jax_cache_dir:
    compiler_options.use_compilation_cache(config.jax_cache_dir)
  logging.info("config:\n%s", summarize(config))
  logging.info("attention kernel %s (%s)", config.attention_kernel, config.attention_choice)
  if config.quantization:
    _say_native_path(config)
  from MaxLite.training import preemption
  from MaxLite.training.trainer import train

  train(config, lock=run_lock.hold)  # taken once the run's inputs are checked: a failing run writes nothing
  return preemption.exit_code()

"""Per-step metrics: read from the device one step late, checked for NaN/Inf, written as a log line, to
metrics.jsonl and as tensorboard scalars (process 0 only)."""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from MaxLite import storage
from MaxLite.cli.errors import MaxLiteError
from MaxLite.config import Config, objectives
from MaxLite.models import flops


class NonFiniteLossError(MaxLiteError):
  """Loss or gradient norm became NaN/Inf."""


# Objects in a bucket cannot be appended to: metrics.jsonl there is rewritten whole, at most this often
# (and at every checkpoint and at the end, so rows up to a saved step always survive a kill).
_OBJECT_REWRITE_S = 10.0


def rows_up_to(text: str, step: int) -> str:
  """The complete rows of a metrics.jsonl text whose step is at most `step`. A run resumed at `step` replays the
  steps after it, so the rows it wrote for them before it stopped go (with a last line a kill cut short): one row
  per logged step, the replayed run's."""
  kept = []
  for line in text.splitlines(keepends=True):
    try:
      row = json.loads(line) if line.endswith("\n") else None
    except ValueError:
      row = None
    if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
      kept.append(line)
  return "".join(kept)


class _ObjectLines:
  """Append-only lines kept in an object-store file by rewriting it (the rows up to a resumed step included)."""

  def __init__(self, path: str, resumed_at: int | None = None):
    self._path = path
    stored = storage.read_text(path) if storage.exists(path) else ""
    self._text = stored if resumed_at is None else rows_up_to(stored, resumed_at)
    # Rows dropped for a resume leave the store at the first rewrite, before any replayed row could be read there.
    self._dirty, self._written = self._text != stored, time.monotonic()

  def write(self, line: str) -> None:
    self._text += line
    self._dirty = True
    if time.monotonic() - self._written >= _OBJECT_REWRITE_S:
      self.flush()

  def flush(self) -> None:
    if self._dirty:
      storage.write_text(self._path, self._text)
      self._dirty, self._written = False, time.monotonic()

  def close(self, store: bool = True) -> None:
    if store:
      self.flush()


def _drop_local_rows_after(path: str, step: int) -> None:
  with open(path, encoding="utf-8") as f:
    text = f.read()
  kept = rows_up_to(text, step)
  if kept != text:  # replaced whole, so a kill now leaves either file, never half of one
    with open(f"{path}.tmp", "w", encoding="utf-8") as f:
      f.write(kept)
    os.replace(f"{path}.tmp", path)


def _summary_writer(remote: bool) -> type:
  """tensorboardX's SummaryWriter, imported without what it loads for things MaxLite never asks of it: torch (to
  accept its tensors; 1.6 s and a few hundred MiB at every start in an environment that has it) and, for a local
  directory (`remote` false), google-cloud-storage (its gs:// writer; 0.15 s of requests and google-auth at every
  start). Each is hidden only for that import and only when nothing has imported it yet; a gs:// writer later in the
  same process gets the library back."""
  unwanted = ("torch",) if remote else ("torch", "google.cloud.storage")
  hidden = [name for name in unwanted if name not in sys.modules]
  for name in hidden:
    sys.modules[name] = None  # its import raises ImportError, which tensorboardX catches
  try:
    from tensorboardX import SummaryWriter, record_writer
  finally:
    for name in hidden:
      del sys.modules[name]
  if remote and not record_writer.GCS_ENABLED:  # first imported here for a local directory
    from google.cloud import storage as gcs

    record_writer.storage, record_writer.GCS_ENABLED = gcs, True
  return SummaryWriter


class MetricsWriter:
  """Writes rows to <run_dir>/metrics.jsonl and tensorboard; no-op on processes other than 0. `resumed_at`: the step
  the run starts after (its restored checkpoint's, 0 for a fresh start); the file's rows after it are dropped, since
  the run writes them again. None keeps every row."""

  def __init__(self, config: Config, is_primary: bool, resumed_at: int | None = None):
    self._active = is_primary
    self._tensorboard = None
    self._jsonl = None
    if not is_primary:
      return
    if storage.is_url(config.metrics_file):
      self._jsonl = _ObjectLines(config.metrics_file, resumed_at)
    else:
      storage.makedirs(config.run_dir)
      if resumed_at is not None and os.path.exists(config.metrics_file):
        _drop_local_rows_after(config.metrics_file, resumed_at)
      self._jsonl = open(config.metrics_file, "a", encoding="utf-8", buffering=1)  # each row on disk at once
    if config.enable_tensorboard:
      writer = _summary_writer(storage.is_url(config.tensorboard_dir))
      self._tensorboard = writer(logdir=config.tensorboard_dir, flush_secs=30)

  def write(self, row: dict[str, Any]) -> None:
    if not self._active:
      return
    self._jsonl.write(json.dumps(row) + "\n")  # in a bucket: rewritten at most every _OBJECT_REWRITE_S
    if self._tensorboard is not None:
      step = row["step"]
      for key, value in row.items():
        if key != "step" and isinstance(value, (int, float)):
          group = "eval" if key.startswith("eval") else "learning"
          self._tensorboard.add_scalar(f"{group}/{key}", value, step)

  def flush(self) -> None:
    """Every row written so far is stored (called with each checkpoint)."""
    if self._jsonl is not None:
      self._jsonl.flush()

  def close(self, store: bool = True) -> None:
    """With `store` false, rows a bucket has not received yet are dropped (a local file has every row already)."""
    if isinstance(self._jsonl, _ObjectLines):
      self._jsonl.close(store)
    elif self._jsonl is not None:
      self._jsonl.close()
    if self._tensorboard is not None:
      self._tensorboard.close()


def compact(n: float) -> str:
  """A count in three significant figures at most: 987, 4.1K, 2.5M, 1.3B."""
  for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.1f}{unit}"
  return f"{n:.0f}"


def log_line(row: dict[str, Any], steps: int | None = None, seconds_left: float | None = None) -> str:
  """The console's line for a step's row; `steps`: the run's last step (`step 17/200`), `seconds_left`: the time to
  it at the recent step time."""
  parts = [
    f"step {row['step']:>6d}" + (f"/{steps}" if steps else ""),
    f"loss {row['loss']:.4f}",
    f"lr {row['learning_rate']:.3e}",
    f"grad_norm {row['grad_norm']:.3f}",
    f"step_time {row['step_time_s']:.3f}s",
    f"tokens/s {row['tokens_per_s']:,.0f}",
  ]
  if "trained_tokens" in row:  # this step's, as in metrics.jsonl: said so, it reads as a running total otherwise
    parts.append(f"trained_tokens/step {compact(row['trained_tokens'])}")
  parts.append(f"TFLOP/s/device {row['tflops_per_device']:.3f}")
  if "mfu" in row:
    parts.append(f"MFU {100 * row['mfu']:.1f}%")
  members: list[float] = []
  while f"loss/member_{len(members)}" in row:
    members.append(row[f"loss/member_{len(members)}"])
  if members:  # an ensemble: `loss` above is their mean
    parts.append("member losses " + " ".join(f"{loss:.4f}" for loss in members))
  if "rewards/accuracies" in row:  # DPO; margins are small at first: 4 significant digits, not 3 decimals
    parts.append(f"rewards/accuracies {row['rewards/accuracies']:.3f} margins {row['rewards/margins']:.4g}")
  if "reward" in row:  # GRPO
    parts.append(_grpo_part(row))
  if "moe_lb_loss" in row:
    parts.append(f"moe_lb_loss {row['moe_lb_loss']:.4f} dropped {100 * row['moe_dropped_fraction']:.1f}%")
  if seconds_left is not None:
    parts.append(f"{duration(seconds_left)} left")
  return " | ".join(parts)


def duration(seconds: float) -> str:
  """12s, 4m05s, 2h03m."""
  seconds = max(0, round(seconds))
  if seconds < 60:
    return f"{seconds}s"
  if seconds < 3600:
    return f"{seconds // 60}m{seconds % 60:02d}s"
  return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _grpo_part(row: dict[str, Any]) -> str:
  """GRPO's part of the log line: `reward` said to be the weighted sum of the functions (each one's mean beside it),
  `kl` only when computed (grpo_beta > 0), the completions' mean length."""
  functions = [k for k in row if k.startswith("rewards/") and k.endswith("/mean")]
  each = ", ".join(f"{k[len('rewards/') : -len('/mean')]} {row[k]:.3f}" for k in functions)
  text = f"reward {row['reward']:.3f} (weighted sum of {each})" if len(functions) > 1 else f"reward {row['reward']:.3f}"
  if "kl" in row:
    text += f" kl {row['kl']:.4g}"
  return text + f" length {row['completions/mean_length']:.1f}"


def metrics_row(
  config: Config, step: int, values: dict[str, float], step_time: float, tflops_per_step: float
) -> dict[str, Any]:
  """One step's row of metrics.jsonl from its device metrics, its wall time and its TFLOPs per device."""
  if not (np.isfinite(values["loss"]) and np.isfinite(values["grad_norm"])):
    raise NonFiniteLossError(
      f"step {step}: loss is {values['loss']} and grad_norm is {values['grad_norm']}; "
      "stopping (try a lower learning_rate or gradient_clipping_threshold)"
    )
  tflops = tflops_per_step / step_time
  row = {
    "step": step,
    "loss": values["loss"],
    "learning_rate": values["learning_rate"],
    "grad_norm": values["grad_norm"],
    "step_time_s": step_time,
    "tokens_per_s": config.global_batch_size_to_train_on * config.ensemble_size * config.max_target_length / step_time,
    "tflops_per_device": tflops,
  }
  if config.z_loss_multiplier and "z_loss" in values:
    row["z_loss"] = values["z_loss"]
  if "tokens" in values:  # tokens the loss covers: the real ones (SFT: the completions; DPO: the responses)
    row["trained_tokens"] = values["tokens"]
  row.update({k: v for k, v in values.items() if k.startswith(objectives.of(config).logged)})
  row.update({k: values[k] for k in ("moe_lb_loss", "moe_dropped_fraction") if k in values})
  row.update({k: v for k, v in values.items() if "/member_" in k})  # an ensemble's one series per member
  if config.peak_tflops_per_device > 0:
    row["mfu"] = tflops / config.peak_tflops_per_device
  return row


class StepLog:
  """The run's metrics rows. A step's metrics are read when the next step has been queued (`record`), so the host
  never waits for the step it just dispatched; `flush` reads the last one now (before a save or an eval).

  `guard` (run_lock.hold's) is asked before each row is written whether the run still owns its directory: a run
  that lost it stops there, on every process, and leaves the new owner's metrics.jsonl as it is. `resumed_at`: see
  MetricsWriter."""

  def __init__(self, config: Config, guard: Any = None, resumed_at: int | None = None):
    self._config, self._guard = config, guard
    self._writer = MetricsWriter(config, is_primary=jax.process_index() == 0, resumed_at=resumed_at)
    self._tflops_per_step = flops.tflops_per_device_per_step(config)
    self.rows: list[dict[str, Any]] = []
    self._diverged: set[str] = set()  # ensemble members already reported as stopped
    self._pending: tuple[int, Any] | None = None
    self._clock = time.perf_counter()
    self._first_step = (resumed_at or 0) + 1
    self._recent: collections.deque[float] = collections.deque(maxlen=20)  # the latest steps' times: the time left

  def record(self, step: int, metrics: Any) -> None:
    self.flush()
    self._pending = (step, metrics)

  def flush(self) -> None:
    if self._pending is None:
      return
    (step, metrics), self._pending = self._pending, None
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    now = time.perf_counter()
    row = metrics_row(self._config, step, values, now - self._clock, self._tflops_per_step)
    self._warn_diverged(step, row)
    self._clock = now
    if step > self._first_step:  # the first step's time is mostly its compile
      self._recent.append(row["step_time_s"])
    if step % self._config.log_period == 0 or step == self._config.steps:
      self._before_write(step)
      left = None
      if self._recent and step < self._config.steps:
        left = (self._config.steps - step) * sum(self._recent) / len(self._recent)
      logging.info(log_line(row, self._config.steps, left))
      self._writer.write(row)
    self.rows.append(row)

  def _warn_diverged(self, step: int, row: dict[str, Any]) -> None:
    for name, value in row.items():
      if name.startswith("loss/member_") and not np.isfinite(value) and name not in self._diverged:
        self._diverged.add(name)
        member = name.rsplit("_", 1)[1]
        logging.warning(
          "step %d: ensemble member %s diverged (loss %s): it keeps its step-%d weights while the others train on",
          step,
          member,
          value,
          step - 1,
        )

  def record_eval(self, step: int, metrics: dict[str, float]) -> None:
    self._before_write(step)
    logging.info(" | ".join([f"step {step:>6d}"] + [f"{k} {v:.4f}" for k, v in metrics.items()]))
    row = {"step": step, **metrics}
    self._writer.write(row)
    self.rows.append(row)
    self._clock = time.perf_counter()  # the eval's time is not the next step's

  def _before_write(self, step: int) -> None:
    if self._guard is not None:
      self._guard.before_metrics(step)

  def store(self) -> None:
    """Every row written so far is on disk (with each checkpoint, so a resume finds the saved step's rows)."""
    self._writer.flush()

  def __enter__(self) -> StepLog:
    return self

  def __exit__(self, *exc: object) -> None:
    self._writer.close(store=self._guard is None or self._guard.lost is None)

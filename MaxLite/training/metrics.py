"""Per-step metrics: a log line, metrics.jsonl and tensorboard scalars (process 0 only)."""

from __future__ import annotations

import json
import time
from typing import Any

from MaxLite import storage
from MaxLite.config import Config

# Objects in a bucket cannot be appended to: metrics.jsonl there is rewritten whole, at most this often
# (and at every checkpoint and at the end, so rows up to a saved step always survive a kill).
_OBJECT_REWRITE_S = 10.0


class _ObjectLines:
  """Append-only lines kept in an object-store file by rewriting it (the rows before a resume included)."""

  def __init__(self, path: str):
    self._path = path
    self._text = storage.read_text(path) if storage.exists(path) else ""
    self._dirty, self._written = False, time.monotonic()

  def write(self, line: str) -> None:
    self._text += line
    self._dirty = True
    if time.monotonic() - self._written >= _OBJECT_REWRITE_S:
      self.flush()

  def flush(self) -> None:
    if self._dirty:
      storage.write_text(self._path, self._text)
      self._dirty, self._written = False, time.monotonic()

  def close(self) -> None:
    self.flush()


class MetricsWriter:
  """Writes rows to <run_dir>/metrics.jsonl and tensorboard; no-op on processes other than 0."""

  def __init__(self, config: Config, is_primary: bool):
    self._active = is_primary
    self._tensorboard = None
    self._jsonl = None
    if not is_primary:
      return
    if storage.is_url(config.metrics_file):
      self._jsonl = _ObjectLines(config.metrics_file)
    else:
      storage.makedirs(config.run_dir)
      self._jsonl = open(config.metrics_file, "a", encoding="utf-8", buffering=1)  # each row on disk at once
    if config.enable_tensorboard:
      from tensorboardX import SummaryWriter

      self._tensorboard = SummaryWriter(logdir=config.tensorboard_dir, flush_secs=30)

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

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tensorboard is not None:
      self._tensorboard.close()


def log_line(row: dict[str, Any]) -> str:
  parts = [
    f"step {row['step']:>6d}",
    f"loss {row['loss']:.4f}",
    f"lr {row['learning_rate']:.3e}",
    f"grad_norm {row['grad_norm']:.3f}",
    f"step_time {row['step_time_s']:.3f}s",
    f"tokens/s {row['tokens_per_s']:,.0f}",
    f"TFLOP/s/device {row['tflops_per_device']:.3f}",
  ]
  if "mfu" in row:
    parts.append(f"MFU {100 * row['mfu']:.1f}%")
  if "moe_lb_loss" in row:
    parts.append(f"moe_lb_loss {row['moe_lb_loss']:.4f} dropped {100 * row['moe_dropped_fraction']:.1f}%")
  return " | ".join(parts)

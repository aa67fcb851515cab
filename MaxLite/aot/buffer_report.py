"""The largest buffers live at a compiled program's memory peak, read from XLA's own dump.

XLA writes, when asked to dump a module, a memory-usage report (the buffers live at the peak, largest first,
grouped by their offset in the temporary allocation), the buffer assignment (which HLO values share each offset)
and the optimized HLO (each instruction's source op_name). Joined, they say what the biggest temporaries are and
which model code made them: what a user needs to change when a config does not fit.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from collections.abc import Callable

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_REPORT_ROW = re.compile(r"^\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+)(\w+);\s*(\d+);\s*(\d+);\s*(.*)$")
_VALUE = re.compile(r"^\s*value: <\d+ ([^ >]+)[^>]*> \(size=\d+,offset=(\d+)\)")
_OP_NAME = re.compile(r'^\s*(?:ROOT )?%([^ ]+) = .*metadata=\{op_name="([^"]*)"')
# Transform wrappers in op names (jit(train_step), transpose(jvp(Transformer)), ...) say nothing about which
# layer made the value; the backward pass is marked instead.
_WRAPPER = re.compile(r"^\w+\(.*\)$")
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*)$")


@dataclasses.dataclass(frozen=True)
class Buffer:
  size: int  # bytes
  shapes: str  # XLA's list of the shapes sharing this buffer over time, e.g. "5×bf16[32,2,8192,4096]"
  ops: tuple[str, ...]  # source op names of the values placed there, in the buffer assignment's order


def dump_flags(dump_dir: str, module: str) -> str:
  """XLA_FLAGS that make the compiler dump `module`'s optimized HLO and buffer reports into dump_dir."""
  return f" --xla_dump_to={dump_dir} --xla_dump_hlo_module_re={module} --xla_dump_hlo_pass_re=NOTHING"


def dump_dir_in(xla_flags: str) -> str | None:
  """The directory an --xla_dump_to flag already in XLA_FLAGS names (XLA keeps the last one), or None."""
  found = re.findall(r"--xla_dump_to=(\S+)", xla_flags)
  return found[-1] if found else None


def _one(dump_dir: str, suffix: str) -> str | None:
  files = sorted(glob.glob(os.path.join(dump_dir, f"*{suffix}")), key=os.path.getsize)
  return files[-1] if files else None  # several modules: the biggest is the train step itself


def _peak_rows(path: str) -> list[tuple[int, int, str]]:
  """(size, offset, shapes) of the default memory space's live buffers at the peak, largest first."""
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      if rows and not line.strip():
        break  # the first table is the device's default memory space
      m = _REPORT_ROW.match(line)
      if m:
        size, unit, offset, _, shapes = m.groups()
        rows.append((int(float(size) * _UNITS[unit]), int(offset), shapes.strip()))
  return rows


def _values_by_offset(path: str) -> dict[int, list[str]]:
  """Offsets in the temporary allocation -> names of the HLO values placed there."""
  by_offset: dict[int, list[str]] = {}
  in_temp = False
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.startswith("allocation "):
        in_temp = "preallocated-temp" in line and "color" not in line
        continue
      m = _VALUE.match(line) if in_temp else None
      if m:
        by_offset.setdefault(int(m.group(2)), []).append(m.group(1).split("{")[0])
  return by_offset


def _op_names(path: str) -> dict[str, str]:
  names = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      m = _OP_NAME.match(line)
      if m:
        parts = m.group(2).split("/")
        kept = "/".join(p for p in parts if not _WRAPPER.match(p))
        names[m.group(1)] = ("backward: " if any(p.startswith("transpose(") for p in parts) else "") + kept
  return names


def allocated_bytes(dump_dir: str) -> int | None:
  """Device memory the compiled program's buffer assignment allocates (the default memory space): arguments,
  outputs that do not reuse a donated argument, and the block of temporaries, packed as the compiler packed them.

  This is what the chip must hold and what the compiler checks against its HBM. memory_analysis()'s
  temp_size_in_bytes is larger on TPU (llama2-7b on v5p-8, 2 x 8192: 10.36 GiB against a 7.40 GiB block), so
  its sum over-counts; None when the dump holds no buffer assignment."""
  path = _one(dump_dir, "after_optimizations-buffer-assignment.txt")
  if path is None:
    return None
  total = 0
  with open(path, encoding="utf-8") as f:
    for line in f:
      m = _ALLOCATION.match(line)
      if m and "color" not in m.group(2):  # other colors: on-chip scratch, host memory
        total += int(m.group(1))
  return total


def largest_buffers(dump_dir: str, count: int = 8) -> list[Buffer]:
  """The `count` largest buffers live at the peak; [] when the dump holds no memory report."""
  report = _one(dump_dir, "memory-usage-report.txt")
  assignment = _one(dump_dir, "after_optimizations-buffer-assignment.txt")
  hlo = _one(dump_dir, "after_optimizations.txt")
  if report is None:
    return []
  values = _values_by_offset(assignment) if assignment else {}
  op_names = _op_names(hlo) if hlo else {}
  buffers = []
  for size, offset, shapes in _peak_rows(report)[:count]:
    placed = list(dict.fromkeys(values.get(offset, [])))
    ops = list(dict.fromkeys(op_names[v] for v in placed if op_names.get(v)))
    if not ops:  # values XLA made itself (a hoisted dtype cast, a copy) carry no op name: show theirs
      ops = [f"{v} (XLA)" for v in placed[:2]]
    buffers.append(Buffer(size, shapes, tuple(ops)))
  return buffers


def format_buffers(buffers: list[Buffer], gib: Callable[[float], str]) -> list[str]:
  lines = []
  for b in buffers:
    made_by = f"  <- {'; '.join(b.ops[:2])}" if b.ops else ""
    lines.append(f"  {gib(b.size):>10}  {b.shapes}{made_by}")
  return lines


_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


def shrink_hints(buffers: list[Buffer], layers: int, vocab: int, seq: int, attention: str) -> list[str]:
  """For a config that does not fit: which keys would shrink each kind of large buffer, judged from the buffers'
  shapes and the ops that made them (largest buffers first, one line per kind)."""
  hints: dict[str, str] = {}
  for b in buffers:
    dims = [[int(d) for d in found.split(",") if d] for _, found in _SHAPE.findall(b.shapes)]
    dtypes = {t for t, _ in _SHAPE.findall(b.shapes)}
    backward = bool(b.ops) and b.ops[0].startswith("backward")  # the first value placed there: what it is for
    stacked = any(d and d[0] == layers for d in dims)
    if attention != "splash" and any(len(d) >= 4 and d[-1] == d[-2] == seq and d[0] != layers for d in dims):
      hints.setdefault("scores", "attention=splash (never holds the [seq, seq] attention scores)")
    elif any(vocab in d for d in dims) and "f32" in dtypes:
      hints.setdefault("logits", "num_vocab_tiling=N (the float32 logits a chunk of tokens at a time)")
    elif stacked and not backward and dtypes <= {"bf16", "f32"}:
      hints.setdefault(
        "saved",
        "remat_policy=full, or remat_policy=custom decoder_layer_input=offload (the activations each layer keeps for "
        "the backward pass); per_device_batch_size or max_target_length",
      )
    elif stacked and backward and "f32" in dtypes:
      hints.setdefault(
        "gradients", "more ici_fsdp_parallelism (splits the weights' gradients and optimizer state further)"
      )
  return list(hints.values())

"""Read and write Hugging Face safetensors files one tensor at a time, with numpy (bfloat16 included).

The format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the raw little-endian bytes. Reading seeks to one tensor and reads only its
bytes, so converting a large checkpoint never holds more than one source tensor at a time.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable
from typing import Any

import ml_dtypes
import numpy as np

from MaxLite import paths
from MaxLite.errors import InputError

DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": ml_dtypes.bfloat16,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U8": np.uint8,
  "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def _read_header(path: str) -> tuple[dict[str, Any], int]:
  try:
    with paths.open_file(path, "rb") as f:
      (length,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(length))
  except (OSError, struct.error, ValueError) as e:
    raise InputError(f"{path}: not a readable safetensors file ({e})") from e
  header.pop("__metadata__", None)
  return header, 8 + length


class SafetensorsReader:
  """All tensors of a checkpoint directory (model.safetensors, or shards listed in the index)."""

  def __init__(self, directory: str):
    index_path, single = paths.join(directory, INDEX), paths.join(directory, SINGLE)
    if paths.isfile(index_path):
      with paths.open_file(index_path) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    elif paths.isfile(single):
      files = [SINGLE]
    else:
      raise InputError(f"{directory}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")
    self._where: dict[str, tuple[str, dict[str, Any], int]] = {}
    for name in files:
      path = paths.join(directory, name)
      if not paths.isfile(path):
        raise InputError(f"{path}: listed in {INDEX} but missing")
      header, start = _read_header(path)
      for tensor, info in header.items():
        self._where[tensor] = (path, info, start)

  def names(self) -> list[str]:
    return sorted(self._where)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._info(name)[1]["shape"])

  def _info(self, name: str) -> tuple[str, dict[str, Any], int]:
    if name not in self._where:
      raise InputError(f"tensor {name!r} is missing from the checkpoint")
    return self._where[name]

  def read(self, name: str) -> np.ndarray:
    path, info, start = self._info(name)
    if info["dtype"] not in DTYPES:
      raise InputError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    dtype = np.dtype(DTYPES[info["dtype"]])
    begin, end = info["data_offsets"]
    out = np.empty(info["shape"], dtype)
    if out.nbytes != end - begin:
      raise InputError(f"{path}: tensor {name!r} has {end - begin} bytes, shape {info['shape']} needs {out.nbytes}")
    with paths.open_file(path, "rb") as f:
      f.seek(start + begin)
      f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    return out


def _write_file(path: str, entries: list[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]]) -> None:
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  for name, shape, dtype, _ in entries:
    size = math.prod(shape) * dtype.itemsize
    header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
  with paths.open_file(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name, shape, dtype, produce in entries:
      array = np.ascontiguousarray(produce(), dtype=dtype)
      if array.shape != tuple(shape):
        raise ValueError(f"{name}: produced shape {array.shape}, planned {shape}")
      f.write(array.tobytes())


def write_checkpoint(
  directory: str,
  tensors: Iterable[tuple[str, tuple[int, ...], Any, Callable[[], np.ndarray]]],
  max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
  """Write (name, shape, dtype, produce) tensors, producing each only when it is written.

  One model.safetensors when it fits in max_shard_bytes, else numbered shards plus the index file
  (the layout transformers' from_pretrained reads). Returns the files written.
  """
  entries = [(n, tuple(s), np.dtype(d), p) for n, s, d, p in tensors]
  shards: list[list[Any]] = [[]]
  size = 0
  for entry in entries:
    nbytes = math.prod(entry[1]) * entry[2].itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(entry)
    size += nbytes
  paths.makedirs(directory)
  if len(shards) == 1:
    _write_file(paths.join(directory, SINGLE), shards[0])
    return [SINGLE]
  names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  for name, shard in zip(names, shards):
    _write_file(paths.join(directory, name), shard)
    weight_map.update({entry[0]: name for entry in shard})
  total = sum(math.prod(e[1]) * e[2].itemsize for e in entries)
  with paths.open_file(paths.join(directory, INDEX), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return names + [INDEX]

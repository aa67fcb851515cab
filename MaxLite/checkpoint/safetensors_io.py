"""Hugging Face safetensors with numpy (bfloat16 too): read and written one tensor at a time.

Local files are read by the `safetensors` package, whose header check refuses any file whose
tensors do not tile its data exactly (header length past the end, offsets past the end, overlapping or
gapped offsets, a dtype and shape that do not match the byte length, a truncated file), so a broken file
stops with one line naming it instead of becoming garbage weights. Reads use its `pread` backend: one
copy of the tensor in memory (the default `mmap` backend measured 2x the tensor in peak RSS, the mapped
pages plus the copy).

`safe_open` needs a local file, and a conversion reads layer i of every weight in turn, hopping between
shards, so for a URL (gs://) it would have to download the whole checkpoint to local disk first. URLs are
instead read in place by `_UrlFile`, which applies the same checks as the package to the header before
reading any tensor and checks the length of every read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from typing import IO, Any, NoReturn

import ml_dtypes  # registers numpy's bfloat16, which safetensors' numpy API then returns
import numpy as np
from safetensors import SafetensorError, safe_open

from MaxLite import storage
from MaxLite.cli.errors import InputError, first_line

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
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors package's own limit
# Errors the package and numpy raise for a file they cannot read (TypeError: a dtype numpy cannot hold).
_READ_ERRORS = (SafetensorError, OSError, TypeError, ValueError)


class _LocalFile:
  """One local safetensors file, checked by the safetensors package when opened and at every read."""

  def __init__(self, path: str):
    self.path = path
    try:
      with safe_open(path, framework="numpy", backend="pread") as f:
        self.shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except _READ_ERRORS as e:
      raise InputError(f"{path}: not a valid safetensors file ({first_line(e)})") from None

  def read(self, name: str) -> np.ndarray:
    try:  # opened per read, so no file stays mapped or open while the conversion runs
      with safe_open(self.path, framework="numpy", backend="pread") as f:
        return f.get_tensor(name)
    except _READ_ERRORS as e:
      raise InputError(f"{self.path}: cannot read tensor {name!r} ({first_line(e)})") from None


class _UrlFile:
  """One safetensors file behind a URL, read in place: the package's header checks, then exact-length reads."""

  def __init__(self, path: str):
    self.path = path
    try:
      with storage.open_file(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        if size < 8:
          self._fail(f"{size} bytes, too short for the 8-byte header length")
        (length,) = struct.unpack("<Q", self._read(f, bytearray(8)))
        if length > MAX_HEADER_BYTES or 8 + length > size:
          self._fail(f"header length {length} does not fit in the file's {size} bytes")
        raw = self._read(f, bytearray(length))
    except OSError as e:
      raise InputError(f"{path}: cannot read ({first_line(e)})") from None
    try:
      header = json.loads(raw)
    except ValueError as e:  # UnicodeDecodeError is a ValueError too
      self._fail(f"header is not JSON ({first_line(e)})")
    if not isinstance(header, dict):
      self._fail("header is not a JSON object")
    header.pop("__metadata__", None)
    self.start = 8 + length
    self.tensors: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
    spans = []
    for name, info in header.items():
      dtype, shape, begin, end = self._entry(name, info)
      if end - begin != math.prod(shape) * dtype.itemsize:
        self._fail(
          f"tensor {name!r} has {end - begin} bytes but {info['dtype']} {list(shape)} needs "
          f"{math.prod(shape) * dtype.itemsize}"
        )
      self.tensors[name] = (dtype, shape, begin)
      spans.append((begin, end, name))
    # As the package requires, the tensors tile the data section exactly: no overlap, gap or tail.
    covered = 0
    for begin, end, name in sorted(spans):
      if begin != covered:
        self._fail(f"tensor {name!r} starts at data byte {begin}, expected {covered} (overlapping or gapped offsets)")
      covered = end
    if self.start + covered != size:
      self._fail(f"its tensors cover {covered} data bytes but the file holds {size - self.start}")
    self.shapes = {name: shape for name, (_, shape, _) in self.tensors.items()}

  def _fail(self, why: str) -> NoReturn:
    raise InputError(f"{self.path}: not a valid safetensors file ({why})")

  def _read(self, f: IO[bytes], buffer: Any) -> Any:
    """Fills buffer from f; a short read (a file cut or changed since its header was read) is an error,
    never a partly filled tensor."""
    view, done = memoryview(buffer).cast("B"), 0
    while done < len(view):
      got = f.readinto(view[done:])
      if not got:
        self._fail(f"it ends {len(view) - done} bytes short of a {len(view)}-byte read")
      done += got
    return buffer

  def _entry(self, name: str, info: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
    try:
      code, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    except (KeyError, TypeError, ValueError):
      self._fail(f"tensor {name!r} needs dtype, shape and two data_offsets")
    if not isinstance(code, str) or code not in DTYPES:
      self._fail(f"tensor {name!r} has unsupported dtype {code!r}")
    if not all(type(v) is int and v >= 0 for v in (*shape, begin, end)) or begin > end:
      self._fail(f"tensor {name!r} has shape {list(shape)} and data_offsets {[begin, end]}: not counts and a range")
    return np.dtype(DTYPES[code]), shape, begin, end

  def read(self, name: str) -> np.ndarray:
    dtype, shape, begin = self.tensors[name]
    out = np.empty(shape, dtype)
    try:
      with storage.open_file(self.path, "rb") as f:
        f.seek(self.start + begin)
        self._read(f, out.reshape(-1).view(np.uint8))
    except OSError as e:
      raise InputError(f"{self.path}: cannot read tensor {name!r} ({first_line(e)})") from None
    return out


class SafetensorsReader:
  """All tensors of a checkpoint directory (model.safetensors, or shards listed in the index).

  Every file's header is checked when the reader is made, so a broken checkpoint fails before any
  conversion work; `read` then holds only the one tensor it returns."""

  def __init__(self, directory: str):
    index_path, single = storage.join(directory, INDEX), storage.join(directory, SINGLE)
    if storage.isfile(index_path):
      files = _index_files(index_path)
    elif storage.isfile(single):
      files = [SINGLE]
    else:
      raise InputError(f"{directory}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")
    self._where: dict[str, _LocalFile | _UrlFile] = {}
    for name in files:
      path = storage.join(directory, name)
      if not storage.isfile(path):
        raise InputError(f"{path}: listed in {INDEX} but missing")
      file = _UrlFile(path) if storage.is_url(path) else _LocalFile(path)
      for tensor in file.shapes:
        if tensor in self._where:  # two copies: which one is meant is unknowable
          raise InputError(f"tensor {tensor!r} is in both {self._where[tensor].path} and {path}")
        self._where[tensor] = file

  def names(self) -> list[str]:
    return sorted(self._where)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._file(name).shapes[name]

  def _file(self, name: str) -> _LocalFile | _UrlFile:
    if name not in self._where:
      raise InputError(f"tensor {name!r} is missing from the checkpoint")
    return self._where[name]

  def read(self, name: str) -> np.ndarray:
    return self._file(name).read(name)


def _index_files(index_path: str) -> list[str]:
  try:
    files = json.loads(storage.read_text(index_path))["weight_map"].values()
    names = sorted({str(f) for f in files})
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise InputError(f"{index_path}: not a safetensors index (needs a weight_map object; {first_line(e)})") from None
  for name in names:  # shards sit beside the index; a path elsewhere is not part of this checkpoint
    if not name or "/" in name or "\\" in name or name in (".", ".."):
      raise InputError(f"{index_path}: weight_map names {name!r}, not a file in the same directory")
  return names


def _write_file(path: str, entries: list[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]]) -> None:
  """Streams tensors into one file, producing each only when it is written, so a conversion holds one tensor
  at a time (the package's `save_file` needs a whole shard, up to 5 GiB, in memory). The header follows the
  format's rules, and tests read every written file back with the package."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers' from_pretrained needs "format"
  offset = 0
  for name, shape, dtype, _ in entries:
    size = math.prod(shape) * dtype.itemsize
    header[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
  with storage.open_file(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name, shape, dtype, produce in entries:
      array = np.ascontiguousarray(produce(), dtype=dtype)
      if array.shape != tuple(shape):
        raise ValueError(f"{name}: produced shape {array.shape}, planned {shape}")
      f.write(array.tobytes())


def write_file(path: str, tensors: dict[str, np.ndarray]) -> None:
  """One safetensors file of in-memory arrays (a PEFT adapter)."""
  _write_file(path, [(n, a.shape, a.dtype, lambda a=a: a) for n, a in tensors.items()])


def read_file(path: str) -> dict[str, np.ndarray]:
  """Every tensor of one safetensors file."""
  if not storage.isfile(path):
    raise InputError(f"{path}: no such file")
  file = _UrlFile(path) if storage.is_url(path) else _LocalFile(path)
  return {name: file.read(name) for name in file.shapes}


def write_checkpoint(
  directory: str,
  tensors: Iterable[tuple[str, tuple[int, ...], Any, Callable[[], np.ndarray]]],
  max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
  """Write (name, shape, dtype, produce) tensors, producing each only when its shard is written.

  One model.safetensors when it fits in max_shard_bytes, else numbered shards plus the index file
  (the layout transformers' from_pretrained reads). The package serialises a whole file from arrays
  in memory, so at most one shard's tensors are held at once. Returns the files written.
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
  storage.makedirs(directory)
  if len(shards) == 1:
    _write_file(storage.join(directory, SINGLE), shards[0])
    return [SINGLE]
  names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  for name, shard in zip(names, shards):
    _write_file(storage.join(directory, name), shard)
    weight_map.update({entry[0]: name for entry in shard})
  total = sum(math.prod(e[1]) * e[2].itemsize for e in entries)
  with storage.open_file(storage.join(directory, INDEX), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return names + [INDEX]

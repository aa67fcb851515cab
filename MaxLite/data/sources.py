"""Random-access document sources over files: document i of the concatenated files, for grain.MapDataset.source.

The grain pipeline (grain_pipeline.py) shards, shuffles and resumes by global document index, so every file type
it trains on must read any document by its index. The files a glob names are taken sorted by path and their
documents in file order, so the same documents in any of these types are the same data stream:

  arrayrecord  one document (UTF-8 bytes) per record; prepare.py writes them with group_size:1, so a read
               decodes one record
  parquet      one document per row: the string column `text_column`. Row counts come from the files' footers;
               a read decodes the row group holding the row (Parquet's smallest unit of random access), and the
               last decoded groups stay cached, so reading rows in or near file order decodes each group once
  jsonl        one document per non-blank line: a JSON object whose field `text_column` is a string. One pass
               over each file finds its line offsets; a read is one ranged read of that line

Every source has __len__ and __getitem__ and pickles without its caches. A malformed row or line is found when it
is read, and is an InputError naming the file (and line).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from MaxLite import storage
from MaxLite.cli.errors import ConfigError, InputError, first_line
from MaxLite.config.choices import FILE_TYPES

_WHAT = "data files (grain_train_files / grain_eval_files)"
# Decoded Parquet row groups kept per source (at least the newest one, whatever its size).
_CACHE_BYTES = 256 << 20
# JSONL files are scanned in pieces of this size (bounded memory whatever the file size).
_SCAN_BYTES = 4 << 20
_BLANK = np.zeros(256, bool)
_BLANK[list(b" \t\r\n\f\v")] = True


class DocumentSource(Protocol):
  """What grain.MapDataset.source reads: document `index` as UTF-8 bytes or str."""

  def __len__(self) -> int: ...

  def __getitem__(self, index: int) -> bytes | str: ...


def open_source(files: str, file_type: str = "arrayrecord", text_column: str = "text") -> DocumentSource:
  """The documents of every file the comma-separated globs `files` name, as one source (see module docstring)."""
  if file_type not in FILE_TYPES:
    raise ConfigError(f"grain_file_type={file_type!r} is not one of: {', '.join(repr(t) for t in FILE_TYPES)}")
  if file_type == "arrayrecord":
    return ArrayRecordSource(resolve_files(files))
  if not text_column:
    raise ConfigError(f"grain_text_column is empty; name the {file_type} column/field that holds the text")
  found = storage.expand_globs(files, _WHAT)
  return ParquetSource(found, [text_column]) if file_type == "parquet" else JsonlSource(found, text_column)


def open_records(files: str, file_type: str, columns: Sequence[str]) -> DocumentSource:
  """Records of several columns (conversations, preference pairs): item i is {column: value} of record i. JSONL
  objects and Parquet rows hold the columns as fields; an ArrayRecord record is one JSON object."""
  if file_type not in FILE_TYPES:
    raise ConfigError(f"grain_file_type={file_type!r} is not one of: {', '.join(repr(t) for t in FILE_TYPES)}")
  if file_type == "arrayrecord":
    return RecordSource(ArrayRecordSource(resolve_files(files)), columns)
  found = storage.expand_globs(files, _WHAT)
  if file_type == "parquet":
    return ParquetSource(found, list(columns), text=False)
  return RecordSource(JsonlSource(found, None), columns)


class RecordSource:
  """The named fields of the JSON objects another source gives (JSONL objects, or ArrayRecord records of JSON)."""

  def __init__(self, source: Any, columns: Sequence[str]):
    self._source, self._columns = source, tuple(columns)

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> dict[str, Any]:
    record = self._source[index]
    if isinstance(record, bytes):
      try:
        record = json.loads(record.decode("utf-8"))
      except ValueError:
        record = None
      if not isinstance(record, dict):
        raise InputError(f"data files: record {index} is not a JSON object (train_data_columns needs one per record)")
    missing = [c for c in self._columns if c not in record]
    if missing:
      raise InputError(
        f"data files: record {index} has no field {missing[0]!r} (train_data_columns); its fields: "
        f"{', '.join(list(record)[:20])}"
      )
    return {c: record[c] for c in self._columns}


def _locate(ends: np.ndarray, index: int) -> tuple[int, int]:
  """(part, index inside it) of a global index, given the cumulative sizes `ends` of the parts."""
  index = int(index)  # grain may pass numpy integers
  if not 0 <= index < (int(ends[-1]) if len(ends) else 0):
    raise IndexError(f"document {index} is out of range")
  part = int(np.searchsorted(ends, index, side="right"))
  return part, index - (int(ends[part - 1]) if part else 0)


# ------------------------------------------------------------------------------------------ ArrayRecord


def resolve_files(files: str) -> list[tuple[str, int]]:
  """(path, record count) of every ArrayRecord file the globs name; InputError for none / unreadable."""
  from array_record.python.array_record_module import ArrayRecordReader

  out = []
  for path in storage.expand_globs(files, _WHAT):
    try:
      reader = ArrayRecordReader(path)
      out.append((path, reader.num_records()))
      reader.close()
    except Exception as e:  # the C++ reader raises plain RuntimeError
      raise InputError(f"data files: not a readable ArrayRecord file: {path} ({first_line(e)})") from None
  return out


class ArrayRecordSource:
  """grain's ArrayRecordDataSource, but a read failure becomes an InputError naming the file."""

  def __init__(self, files: list[tuple[str, int]]):
    import grain

    self._files = files
    self._ends = np.cumsum([n for _, n in files], dtype=np.int64)
    # "path[start:stop]" tells grain the record count, so it does not open every file again.
    self._source = grain.sources.ArrayRecordDataSource([f"{p}[0:{n}]" for p, n in files])

  def __len__(self) -> int:
    return int(self._ends[-1]) if len(self._ends) else 0

  def __getitem__(self, index: int) -> bytes:
    try:
      return self._source[index]
    except Exception as e:
      path = self._files[_locate(self._ends, index)[0]][0]
      raise InputError(f"data files: cannot read record from {path} ({first_line(e)})") from None


# ------------------------------------------------------------------------------------------ Parquet


@contextlib.contextmanager
def _parquet_file(path: str, metadata: Any = None) -> Iterator[Any]:
  """A pyarrow ParquetFile: local paths through pyarrow's own reader, URLs through a storage.open_file object."""
  import pyarrow.parquet as pq

  with contextlib.ExitStack() as stack:
    source = stack.enter_context(storage.open_file(path, "rb")) if storage.is_url(path) else path
    yield stack.enter_context(pq.ParquetFile(source, metadata=metadata))


def _parquet_metadata(path: str, columns: Sequence[str], text: bool) -> Any:
  """The footer of a Parquet file that has `columns` (strings when `text`); InputError naming the file otherwise."""
  import pyarrow as pa

  try:
    with _parquet_file(path) as f:
      metadata, schema = f.metadata, f.schema_arrow
  except InputError:
    raise
  except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
    raise InputError(f"data files: not a readable Parquet file: {path} ({first_line(e)})") from None
  names = ", ".join(schema.names[:20]) + (", ..." if len(schema.names) > 20 else "")
  key = "grain_text_column" if text else "train_data_columns"
  for column in columns:
    if column not in schema.names:
      raise InputError(f"{key}={column!r}: {path} has no such column; its columns: {names}")
  kind = schema.field(columns[0]).type
  if text and not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
    raise InputError(f"{key}={columns[0]!r} in {path} has type {kind}, not string; its columns: {names}")
  return metadata


class ParquetSource:
  """Rows of Parquet files (see module docstring): the string of column `columns[0]` when `text`, else a dict of
  the `columns`."""

  def __init__(self, files: list[str], columns: list[str], text: bool = True):
    self._columns, self._text = columns, text
    self._files = [(path, _parquet_metadata(path, columns, text)) for path in files]
    # Row groups with rows, in file order: (file number, row group in it); _ends counts rows up to each.
    self._groups, sizes = [], []
    for number, (_, metadata) in enumerate(self._files):
      for group in range(metadata.num_row_groups):
        if rows := metadata.row_group(group).num_rows:
          self._groups.append((number, group))
          sizes.append(rows)
    self._ends = np.cumsum(sizes, dtype=np.int64)
    self._start_cache()

  def _start_cache(self) -> None:
    self._cache: OrderedDict[int, Any] = OrderedDict()  # group number -> decoded arrow array, oldest first
    self._lock = threading.Lock()  # slots are filled by threads (grain_worker_count) that share this source

  def __getstate__(self) -> dict[str, Any]:
    return {k: v for k, v in self.__dict__.items() if k not in ("_cache", "_lock")}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._start_cache()

  def __len__(self) -> int:
    return int(self._ends[-1]) if len(self._ends) else 0

  def _group(self, number: int) -> Any:
    with self._lock:
      if number in self._cache:
        self._cache.move_to_end(number)
        return self._cache[number]
    file, group = self._groups[number]
    path, metadata = self._files[file]
    try:  # outside the lock: pyarrow decodes without the GIL, so threads decode different groups at once
      with _parquet_file(path, metadata) as f:
        column = f.read_row_group(group, columns=self._columns).combine_chunks()
    except InputError:
      raise
    except Exception as e:
      raise InputError(f"data files: cannot read row group {group} of {path} ({first_line(e)})") from None
    with self._lock:
      self._cache[number] = column
      while len(self._cache) > 1 and sum(c.nbytes for c in self._cache.values()) > _CACHE_BYTES:
        self._cache.popitem(last=False)
    return column

  def __getitem__(self, index: int) -> str | dict[str, Any]:
    number, row = _locate(self._ends, index)
    table = self._group(number)
    if not self._text:
      return {c: table.column(c)[row].as_py() for c in self._columns}
    text = table.column(0)[row].as_py()
    if text is None:
      file, group = self._groups[number]
      path, metadata = self._files[file]
      row += sum(metadata.row_group(g).num_rows for g in range(group))
      raise InputError(f"data files: {path} row {row}: {self._columns[0]!r} (grain_text_column) is null, not a string")
    return text


# ------------------------------------------------------------------------------------------ JSONL


def _line_spans(path: str) -> tuple[np.ndarray, np.ndarray]:
  """[start, stop) byte offsets of every non-blank line of a file (stop at its newline), in one streamed pass."""
  starts, stops = [], []
  base = 0  # file offset of the current piece
  line_start, line_has_text = 0, False  # the line still open at the end of the previous piece
  with storage.open_file(path, "rb") as f:
    while piece := f.read(_SCAN_BYTES):
      data = np.frombuffer(piece, np.uint8)
      text = np.concatenate([[0], np.cumsum(~_BLANK[data], dtype=np.int32)])  # non-blank bytes before i
      newlines = np.flatnonzero(data == ord("\n"))
      if len(newlines):
        begins = np.concatenate([[0], newlines[:-1] + 1])  # the piece's part of each line ending in it
        has_text = text[newlines] > text[begins]
        has_text[0] |= line_has_text
        line_starts = base + begins
        line_starts[0] = line_start
        starts.append(line_starts[has_text])
        stops.append(base + newlines[has_text])
        line_start, line_has_text = base + int(newlines[-1]) + 1, bool(text[-1] > text[newlines[-1] + 1])
      else:
        line_has_text |= bool(text[-1])
      base += len(piece)
  if line_has_text:  # a last line without a newline
    starts.append(np.array([line_start]))
    stops.append(np.array([base]))
  if not starts:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  return np.concatenate(starts).astype(np.int64), np.concatenate(stops).astype(np.int64)


def _line_number(path: str, offset: int) -> int:
  """1-based number of the line starting at byte `offset` (only for error messages: it reads the file up to it)."""
  count = 1
  with storage.open_file(path, "rb") as f:
    while offset > 0 and (piece := f.read(min(_SCAN_BYTES, offset))):
      count += piece.count(b"\n")
      offset -= len(piece)
  return count


class JsonlSource:
  """The string field `field` of the JSON object on each non-blank line of JSONL files (see module docstring), or
  the whole object when `field` is None."""

  def __init__(self, files: list[str], field: str | None):
    self._files, self._field = files, field
    self._spans = []
    for path in files:
      if path.endswith((".gz", ".zst", ".bz2", ".xz")):
        raise InputError(
          f"data files: {path} is compressed, which cannot be read at random; decompress it, or convert it with "
          "prepare.py --format jsonl"
        )
      try:
        self._spans.append(_line_spans(path))
      except InputError:
        raise
      except Exception as e:
        raise InputError(f"data files: cannot read {path} ({first_line(e)})") from None
    self._ends = np.cumsum([len(starts) for starts, _ in self._spans], dtype=np.int64)

  def __len__(self) -> int:
    return int(self._ends[-1]) if len(self._ends) else 0

  def __getitem__(self, index: int) -> str | dict[str, Any]:
    file, line = _locate(self._ends, index)
    path = self._files[file]
    start, stop = (int(s[line]) for s in self._spans[file])
    try:
      raw = storage.read_range(path, start, stop)
    except InputError:
      raise
    except Exception as e:
      raise InputError(f"data files: cannot read {path} ({first_line(e)})") from None
    try:
      obj = json.loads(raw.decode("utf-8", errors="replace"))
    except ValueError:
      obj = None
    if not isinstance(obj, dict):
      raise InputError(f"data files: {path}:{_line_number(path, start)}: not a JSON object")
    if self._field is None:
      return obj
    text = obj.get(self._field)
    if not isinstance(text, str):
      keys = ", ".join(list(obj)[:20])
      raise InputError(
        f"data files: {path}:{_line_number(path, start)}: no string field {self._field!r} (grain_text_column); "
        f"its fields: {keys}"
      )
    return text

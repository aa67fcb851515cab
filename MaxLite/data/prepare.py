"""Text / JSONL files -> ArrayRecord shards of documents (one UTF-8 text document per record): prepare_data.py's work.

Streams: files are read in bounded pieces and each document goes straight to a shard writer, so memory stays
constant however large the input. Documents go round-robin to the train shards (deterministic); a document is held
out for eval when a hash of its text falls below the eval fraction, so the split does not depend on file order or
sharding. Writes train-SSSSS-of-NNNNN.array_record and, with an eval fraction, eval-00000-of-00001.array_record.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import IO

from array_record.python.array_record_module import ArrayRecordWriter

from MaxLite.cli.errors import InputError
from MaxLite.storage import expand_globs

# group_size:1 lets grain read any record without decoding its neighbours (random access shuffle).
WRITER_OPTIONS = "group_size:1"
_READ_CHUNK = 1 << 20  # longest piece of a line held at once


def _open_text(path: str) -> IO[str]:
  if path.endswith(".gz"):
    return gzip.open(path, "rt", encoding="utf-8", errors="replace")
  return open(path, encoding="utf-8", errors="replace")


def _pieces(f: IO[str], limit: int = _READ_CHUNK) -> Iterator[str]:
  """Lines of f, a line longer than `limit` arriving as several pieces (bounded memory)."""
  while piece := f.readline(max(1, min(limit, _READ_CHUNK))):
    yield piece


def text_documents(
  path: str, split_by: str = "paragraph", min_doc_chars: int = 0, max_doc_chars: int = 1_000_000
) -> Iterator[str]:
  """Documents of a text file: each non-blank line, blank-line separated paragraphs (adjacent ones
  merged until at least min_doc_chars), or the whole file; any of them cut at max_doc_chars."""
  buf: list[str] = []
  size = 0

  def flush() -> Iterator[str]:
    nonlocal buf, size
    doc = "".join(buf).strip("\n")
    buf, size = [], 0
    if doc.strip():
      yield doc

  with _open_text(path) as f:
    for piece in _pieces(f, max_doc_chars):
      if split_by == "line":
        buf.append(piece)
        size += len(piece)
        if piece.endswith("\n") or size >= max_doc_chars:
          yield from flush()
        continue
      blank = not piece.strip()
      if split_by == "paragraph" and blank and size >= min_doc_chars:
        yield from flush()
        continue
      if blank and not buf:
        continue
      buf.append(piece)
      size += len(piece)
      if size >= max_doc_chars:
        yield from flush()
  yield from flush()


def jsonl_documents(path: str, text_field: str, on_missing_field: str, skipped: dict[str, int]) -> Iterator[str]:
  """The `text_field` string of each JSON line. A line without it (or not a JSON object) is
  counted in skipped['missing_field'] or, with on_missing_field='fail', raises naming file:line."""
  with _open_text(path) as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        obj, problem = None, f"invalid JSON ({e.msg})"
      else:
        problem = f"missing string field {text_field!r}"
      text = obj.get(text_field) if isinstance(obj, dict) else None
      if not isinstance(text, str):
        if on_missing_field == "fail":
          raise InputError(f"{path}:{line_no}: {problem}")
        skipped["missing_field"] += 1
        continue
      if not text.strip():
        skipped["empty"] += 1
        continue
      yield text


class ShardWriters:
  """N ArrayRecord writers named prefix-SSSSS-of-NNNNN.array_record, filled round-robin."""

  def __init__(self, output_dir: str, prefix: str, num_shards: int):
    self.paths = [
      os.path.join(output_dir, f"{prefix}-{i:05d}-of-{num_shards:05d}.array_record") for i in range(num_shards)
    ]
    self._writers = [ArrayRecordWriter(p, WRITER_OPTIONS) for p in self.paths]
    self.documents = 0
    self.bytes = 0

  def write(self, record: bytes) -> None:
    self._writers[self.documents % len(self._writers)].write(record)
    self.documents += 1
    self.bytes += len(record)

  def close(self) -> None:
    for w in self._writers:
      w.close()


def _is_eval(record: bytes, eval_fraction: float) -> bool:
  h = int.from_bytes(hashlib.blake2b(record, digest_size=8).digest(), "little")
  return h < eval_fraction * 2.0**64


def _existing_shards(output_dir: str) -> list[str]:
  return sorted(
    glob.glob(os.path.join(output_dir, "train-*-of-*.array_record"))
    + glob.glob(os.path.join(output_dir, "eval-*-of-*.array_record"))
  )


def prepare(
  input_glob: str,
  output_dir: str,
  num_shards: int,
  *,
  fmt: str = "text",
  text_field: str = "text",
  on_missing_field: str = "skip",
  eval_fraction: float = 0.02,
  split_by: str = "paragraph",
  min_doc_chars: int = 0,
  max_doc_chars: int = 1_000_000,
  overwrite: bool = False,
  progress: IO[str] | None = None,
) -> dict:
  """Converts the files matching `input_glob` into shards in `output_dir`; returns the summary."""
  if num_shards < 1:
    raise InputError(f"--num_shards must be >= 1, got {num_shards}")
  if not 0.0 <= eval_fraction < 1.0:
    raise InputError(f"--eval_fraction must be in [0, 1), got {eval_fraction}")
  files = expand_globs(input_glob, "--input")
  os.makedirs(output_dir, exist_ok=True)
  stale = _existing_shards(output_dir)
  if stale and not overwrite:
    raise InputError(
      f"--output_dir {output_dir} already holds shards ({os.path.basename(stale[0])}, ...);"
      " pass --overwrite to replace them"
    )
  for path in stale:
    os.remove(path)
  skipped = {"missing_field": 0, "empty": 0}
  train = ShardWriters(output_dir, "train", num_shards)
  evals = ShardWriters(output_dir, "eval", 1) if eval_fraction > 0 else None
  start = last_report = time.time()
  try:
    for file_no, path in enumerate(files, 1):
      docs = (
        jsonl_documents(path, text_field, on_missing_field, skipped)
        if fmt == "jsonl"
        else text_documents(path, split_by, min_doc_chars, max_doc_chars)
      )
      for doc in docs:
        record = doc.encode("utf-8")
        (evals if evals is not None and _is_eval(record, eval_fraction) else train).write(record)
        if progress is not None and time.time() - last_report > 2.0:
          last_report = time.time()
          done = train.documents + (evals.documents if evals else 0)
          print(
            f"prepare: file {file_no}/{len(files)}, {done:,} documents, "
            f"{(train.bytes + (evals.bytes if evals else 0)) / 1e6:.1f} MB",
            file=progress,
            flush=True,
          )
  finally:
    train.close()
    if evals is not None:
      evals.close()
  return {
    "files": len(files),
    "train_documents": train.documents,
    "train_bytes": train.bytes,
    "train_shards": train.paths,
    "eval_documents": evals.documents if evals else 0,
    "eval_bytes": evals.bytes if evals else 0,
    "eval_shards": evals.paths if evals else [],
    "skipped": skipped,
    "seconds": round(time.time() - start, 2),
  }


def describe(s: dict, output_dir: str) -> str:
  """prepare()'s summary as the one line the command prints."""
  return (
    f"prepare: {s['files']} files -> {s['train_documents']:,} train documents ({s['train_bytes']:,} bytes) "
    f"in {len(s['train_shards'])} shards, {s['eval_documents']:,} eval documents ({s['eval_bytes']:,} bytes) "
    f"in {len(s['eval_shards'])} shard; skipped {s['skipped']['missing_field']} missing-field, "
    f"{s['skipped']['empty']} empty; {s['seconds']} s -> {output_dir}"
  )

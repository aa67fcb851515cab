"""Document sources: the shipped corpus as Parquet and JSONL gives the ArrayRecord stream batch for batch."""

import glob
import json
import os
import pickle
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.config import REPO, make_config, read_records, run_train_cli

from MaxLite.cli.errors import ConfigError, InputError
from MaxLite.data import BATCH_KEYS, sources
from MaxLite.data import tokenizer_training as tt
from MaxLite.data.grain_pipeline import make_grain_iterator
from MaxLite.data.sources import open_source

TOKENIZER = os.path.join(REPO, "assets", "tokenizer", "maxlite_sp8k.model")
ARRAYRECORD = os.path.join(REPO, "assets", "corpus", "train-*.array_record")
CUTS = (0, 500, 1300, None)  # the Parquet / JSONL files split the documents elsewhere than the 4 ArrayRecord shards


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """(documents, {file_type: (glob, text column)}): the shipped train documents in all three types. Parquet: 3
  files of row groups of 96 rows, the text in column 'content' beside an int column; JSONL: 3 files with blank
  lines, a CRLF file and one file of raw UTF-8."""
  docs = read_records(glob.glob(ARRAYRECORD))
  d = tmp_path_factory.mktemp("sources")
  (d / "parquet").mkdir()
  (d / "jsonl").mkdir()
  bounds = [(CUTS[k], CUTS[k + 1] or len(docs)) for k in range(len(CUTS) - 1)]
  for k, (start, stop) in enumerate(bounds):
    table = pa.table({"id": pa.array(range(start, stop), pa.int64()), "content": docs[start:stop]})
    pq.write_table(table, d / "parquet" / f"part-{k}.parquet", row_group_size=96)
    newline = "\r\n" if k == 1 else "\n"
    with open(d / "jsonl" / f"part-{k}.jsonl", "w", encoding="utf-8", newline="") as f:
      for i, doc in enumerate(docs[start:stop]):
        f.write(json.dumps({"id": start + i, "text": doc}, ensure_ascii=k != 2) + newline)
        if i % 97 == 0:
          f.write(newline + "   " + newline)  # blank lines are not documents
  types = {
    "arrayrecord": (ARRAYRECORD, "text"),
    "parquet": (str(d / "parquet" / "*.parquet"), "content"),
    "jsonl": (str(d / "jsonl" / "*.jsonl"), "text"),
  }
  return docs, types


def _iter(corpus, kind, **kw):
  files, column = corpus[1][kind]
  args = dict(tokenizer_path=TOKENIZER, seq_len=128, num_slots=4, slots=(0, 1, 2, 3), seed=3, add_bos=True)
  args.update(add_eos=True, file_type=kind, text_column=column)
  args.update(kw)
  return make_grain_iterator(files, **args)


def _global_batches(corpus, file_type, num_slots, readers, steps, **kw):
  """The first `steps` global batches, each process of `readers` building its own rows."""
  its = [_iter(corpus, file_type, num_slots=num_slots, slots=rows, **kw) for rows in readers]
  out = []
  for _ in range(steps):
    full = {k: np.zeros((num_slots, 128), np.int32) for k in BATCH_KEYS}
    for rows, it in zip(readers, its):
      part = next(it)
      for k in BATCH_KEYS:
        full[k][list(rows)] = part[k]
    out.append(full)
  return out


def _assert_same(expect, got, what):
  for step, (a, b) in enumerate(zip(expect, got)):
    for k in BATCH_KEYS:
      np.testing.assert_array_equal(a[k], b[k], err_msg=f"{what}: step {step + 1} {k}")


@pytest.mark.parametrize("file_type", ["parquet", "jsonl"])
def test_every_document_reads_as_in_arrayrecord(corpus, file_type, monkeypatch):
  docs, types = corpus
  source = open_source(types[file_type][0], file_type, types[file_type][1])
  assert len(source) == len(docs) == 2095
  assert [source[i] for i in range(len(docs))] == docs  # in order: each Parquet row group decoded once
  shuffled = np.random.default_rng(0).permutation(len(docs))[:300]
  fresh = pickle.loads(pickle.dumps(source))  # as grain ships a source to a worker process: no cache, same reads
  assert [fresh[int(i)] for i in shuffled] == [docs[i] for i in shuffled]
  monkeypatch.setattr(sources, "_CACHE_BYTES", 0)  # data much larger than the cache: every miss evicts
  evicting = pickle.loads(pickle.dumps(source))
  assert [evicting[int(i)] for i in shuffled[:100]] == [docs[i] for i in shuffled[:100]]
  with pytest.raises(IndexError):
    source[len(docs)]


# (num_slots, the rows each process reads): one process, [0,1] + [2,3], and an interleaved split of 3 rows.
SPLITS = [(4, [(0, 1, 2, 3)]), (4, [(0, 1), (2, 3)]), (3, [(2, 0), (1,)])]


@pytest.mark.parametrize("file_type", ["parquet", "jsonl"])
@pytest.mark.parametrize("shuffle", [True, False], ids=["train", "eval"])
def test_same_documents_give_the_arrayrecord_batches(corpus, file_type, shuffle):
  for num_slots, readers in SPLITS:
    expect = _global_batches(corpus, "arrayrecord", num_slots, [tuple(range(num_slots))], 8, shuffle=shuffle)
    assert not np.array_equal(expect[0]["inputs"][0], expect[0]["inputs"][1])  # rows hold different documents
    got = _global_batches(corpus, file_type, num_slots, readers, 8, shuffle=shuffle, worker_count=2)
    _assert_same(expect, got, f"{file_type} {num_slots} rows read as {readers}")


def test_parquet_resume_continues_with_the_uninterrupted_batches(corpus):
  expect = _global_batches(corpus, "arrayrecord", 4, [(0, 1, 2, 3)], 36)
  first = _iter(corpus, "parquet")
  for _ in range(30):
    next(first)
  state = json.loads(json.dumps(first.get_state()))
  halves = [_iter(corpus, "parquet", slots=rows) for rows in ((0, 1), (2, 3))]  # resumed on another topology
  for half in halves:
    half.set_state(state)
  got = []
  for _ in range(6):
    parts = [next(half) for half in halves]
    got.append({k: np.concatenate([p[k] for p in parts]) for k in BATCH_KEYS})
  _assert_same(expect[30:], got, "parquet resumed at step 30")


@pytest.mark.parametrize("piece", [1, 2, 5, 64, 1 << 20])
def test_jsonl_line_index_is_the_same_for_any_scan_piece_size(tmp_path, monkeypatch, piece):
  """Lines that straddle the pieces the scan reads (blank, whitespace-only, CRLF, a last line without newline)."""
  rng = np.random.default_rng(piece)
  lines = [rng.choice(["", "  ", "\t\r", '{"text": "%s"}' % ("x" * int(rng.integers(0, 9)))]) for _ in range(1000)]
  data = ("\n".join(lines) + '\r\n{"text": "end"}').encode()
  (tmp_path / "a.jsonl").write_bytes(data)
  monkeypatch.setattr(sources, "_SCAN_BYTES", piece)
  source = open_source(str(tmp_path / "a.jsonl"), "jsonl")
  expect = [json.loads(line)["text"] for line in data.decode().split("\n") if line.strip()]
  assert len(source) == len(expect) > 150 and [source[i] for i in range(len(source))] == expect


# ------------------------------------------------------------------------------------------ errors


def test_a_bad_file_type_is_one_line_at_config_time(corpus):
  with pytest.raises(ConfigError, match=r"^grain_file_type='csv' is not one of: 'arrayrecord', 'parquet', 'jsonl'$"):
    make_config("grain_file_type=csv")
  # File names that say another type: one line naming the key, before any file is opened.
  expect = "grain_train_files='/data/*.parquet' names parquet files but grain_file_type='arrayrecord'; set "
  with pytest.raises(ConfigError) as e:
    make_config("grain_train_files=/data/*.parquet")
  assert str(e.value) == expect + "grain_file_type=parquet"
  # The shipped corpus's eval files are the default only for its own train files: the user's data has no eval until
  # grain_eval_files names some (README's LoRA command failed on the default, in another file type).
  for file_type, files in (("parquet", "/data/*.parquet"), ("jsonl", "chats.jsonl"), ("arrayrecord", "x.array_record")):
    config = make_config(f"grain_train_files={files}", f"grain_file_type={file_type}")
    assert config.grain_eval_files == ""
  assert make_config().grain_eval_files == "assets/corpus/eval-*.array_record"
  with pytest.raises(ConfigError, match=r"^grain_eval_files='assets/corpus/eval-\*\.array_record' names arrayrecord "):
    make_config(
      "grain_train_files=/data/*.parquet",
      "grain_file_type=parquet",
      "grain_eval_files=assets/corpus/eval-*.array_record",
    )
  config = make_config("grain_train_files=/data/*.parquet", "grain_eval_files=", "grain_file_type=parquet")
  assert config.grain_file_type == "parquet"
  with pytest.raises(ConfigError, match=r"^grain_file_type='csv' is not one of"):
    _iter(corpus, "arrayrecord", file_type="csv")


def test_parquet_column_errors_name_the_column_file_and_its_columns(corpus, tmp_path):
  files = corpus[1]["parquet"][0]
  first = sorted(glob.glob(files))[0]
  with pytest.raises(InputError) as e:
    open_source(files, "parquet", "text")
  assert str(e.value) == f"grain_text_column='text': {first} has no such column; its columns: id, content"
  with pytest.raises(InputError, match=r"^grain_text_column='id' in .*part-0\.parquet has type int64, not string"):
    open_source(files, "parquet", "id")
  with_null = tmp_path / "null.parquet"
  pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), with_null, row_group_size=2)
  source = open_source(str(with_null), "parquet")
  assert [source[i] for i in (0, 1, 3)] == ["a", "b", "d"]
  with pytest.raises(InputError, match=rf"^data files: {with_null} row 2: 'text' \(grain_text_column\) is null"):
    source[2]


def test_unreadable_parquet_names_the_file(corpus, tmp_path):
  bad = tmp_path / "bad.parquet"
  bad.write_bytes(b"this is not a parquet file" * 100)
  good = sorted(glob.glob(corpus[1]["parquet"][0]))[0]
  truncated = tmp_path / "truncated.parquet"
  truncated.write_bytes(open(good, "rb").read()[:3000])
  for path in (bad, truncated):
    with pytest.raises(InputError, match=f"^data files: not a readable Parquet file: {path} ") as e:
      open_source(f"{good},{path}", "parquet", "content")
    assert "\n" not in str(e.value)


def test_bad_jsonl_lines_name_file_and_line(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "fine"}\n\n[1, 2]\n{"title": "x", "text": 3}\n{not json\n{"text": "last, no newline"}')
  source = open_source(str(bad), "jsonl")
  assert len(source) == 5 and source[0] == "fine" and source[4] == "last, no newline"
  with pytest.raises(InputError, match=rf"^data files: {bad}:3: not a JSON object$"):
    source[1]
  with pytest.raises(InputError) as e:
    source[2]
  assert str(e.value) == f"data files: {bad}:4: no string field 'text' (grain_text_column); its fields: title, text"
  with pytest.raises(InputError, match=rf"^data files: {bad}:5: not a JSON object$"):
    source[3]
  # Through the pipeline too: the error reaches the training loop as the same line.
  args = dict(tokenizer_path=TOKENIZER, seq_len=8, num_slots=1, slots=(0,), seed=0, add_bos=True, add_eos=True)
  it = make_grain_iterator(str(bad), file_type="jsonl", **args)
  with pytest.raises(InputError, match=r"bad\.jsonl:\d: "):
    for _ in range(10):
      next(it)
  gz = tmp_path / "docs.jsonl.gz"
  gz.write_bytes(b"\x1f\x8b")
  with pytest.raises(InputError, match=r"docs\.jsonl\.gz is compressed, which cannot be read at random"):
    open_source(str(gz), "jsonl")


def test_tokenizer_tool_reads_parquet_and_jsonl_documents(corpus):
  expect = list(tt.sentences(sorted(glob.glob(ARRAYRECORD))))
  for kind in ("parquet", "jsonl"):
    files, column = corpus[1][kind]
    assert list(tt.sentences(sorted(glob.glob(files)), column)) == expect, kind


# ------------------------------------------------------------------------------------------ end to end


def _cli_metrics(tmp_path, run_name, *overrides):
  proc = run_train_cli(
    "model_name=tiny",
    "max_target_length=64",
    "steps=4",
    "log_period=1",
    "eval_interval=2",
    "eval_steps=2",
    "enable_tensorboard=false",
    f"base_output_directory={tmp_path}",
    f"run_name={run_name}",
    *overrides,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in (tmp_path / run_name / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in r.items() if "loss" in k or k == "grad_norm"} for r in rows]


@pytest.mark.slow
def test_training_on_parquet_shards_equals_training_on_arrayrecord(corpus, tmp_path):
  """The shipped default run (train and eval files) against the same documents as Parquet shards."""
  files, column = corpus[1]["parquet"]
  evals = tmp_path / "eval.parquet"
  eval_documents = read_records(glob.glob(os.path.join(REPO, "assets", "corpus", "eval-*.array_record")))
  pq.write_table(pa.table({"content": eval_documents}), evals, row_group_size=16)
  parquet = _cli_metrics(
    tmp_path,
    "parquet",
    f"grain_train_files={files}",
    f"grain_eval_files={evals}",
    "grain_file_type=parquet",
    f"grain_text_column={column}",
  )
  arrayrecord = _cli_metrics(tmp_path, "arrayrecord")
  assert [r["loss"] for r in parquet if "loss" in r] and sum("eval_loss" in r for r in parquet) == 2
  assert parquet == arrayrecord  # bit for bit: the same data stream


@pytest.mark.parametrize(
  "url, fragment",
  [("gs://", "names no bucket"), ("gs:///runs", "names no bucket"), ("gs://AB/runs", "not a valid bucket name")],
)
def test_a_url_without_a_valid_bucket_is_named_before_any_network_request(monkeypatch, url, fragment):
  from MaxLite import storage
  from MaxLite.cli.errors import InputError

  monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # offline: nothing answers there
  with pytest.raises(InputError, match=rf"^base_output_directory={re.escape(url)}: .*{fragment}"):
    storage.check_bucket(url, "base_output_directory")

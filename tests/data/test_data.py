"""Real-data input layer: packing, the prep and tokenizer tools, the grain pipeline, shipped assets."""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from support.config import REPO, read_records

from MaxLite import prepare_data, train_tokenizer
from MaxLite.cli.errors import InputError
from MaxLite.data import BATCH_KEYS
from MaxLite.data import prepare as prep
from MaxLite.data.grain_pipeline import make_grain_iterator
from MaxLite.data.packing import StreamingPacker, pack_documents
from MaxLite.data.sources import resolve_files
from MaxLite.data.tokenizer import load_tokenizer

TOKENIZER = os.path.join(REPO, "assets", "tokenizer", "maxlite_sp8k.model")
CORPUS = os.path.join(REPO, "assets", "corpus")
WORDS = (
  "the quick brown fox jumps over a lazy dog while seven wizards quietly pack boxes of liquor "
  "and jugs near the river bank every morning before noon"
).split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """150 distinctive one-line documents (some longer than a row) in 3 train shards via prepare()."""
  d = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(0)
  lines = [
    f"record {i:04d} " + " ".join(rng.choice(WORDS, size=int(rng.integers(2, 25 if i % 10 else 120))))
    for i in range(150)
  ]
  (d / "docs.txt").write_text("\n".join(lines) + "\n")
  summary = prep.prepare(str(d / "*.txt"), str(d / "out"), 3, split_by="line", eval_fraction=0.0)
  assert summary["train_documents"] == 150 and summary["eval_documents"] == 0
  return str(d / "out" / "train-*.array_record"), lines


def _iter(files, **kw):
  args = dict(tokenizer_path=TOKENIZER, seq_len=64, num_slots=1, slots=(0,), seed=7, add_bos=True, add_eos=True)
  args.update(kw)
  return make_grain_iterator(files, **args)


def _documents_in_stream(it, tok):
  """Decoded documents in stream order: non-padding inputs, cut at BOS (add_bos=True, add_eos=True)."""
  inputs, targets = [], []
  for batch in it:
    mask = batch["inputs_segmentation"] > 0
    assert np.array_equal(mask, batch["targets_segmentation"] > 0)
    inputs += list(batch["inputs"][mask])  # row-major = stream order
    targets += list(batch["targets"][mask])
  # Each document contributes [BOS, text...] to inputs and [text..., EOS] to targets.
  assert inputs[0] == tok.bos_id and targets[-1] == tok.eos_id
  assert np.array_equal(
    np.array(inputs[1:]), np.where(np.array(targets[:-1]) == tok.eos_id, tok.bos_id, np.array(targets[:-1]))
  )
  docs, cur = [], None
  for t in inputs:
    if t == tok.bos_id:
      if cur is not None:
        docs.append(tok.decode(cur))
      cur = []
    else:
      cur.append(t)
  docs.append(tok.decode(cur))
  return docs


# ------------------------------------------------------------------------------------------ packing


def test_pack_known_documents_every_field():
  # pairs: [1,2,3] -> 2, [4..8] -> 4 (split across rows), [9] -> none (dropped), [10,11] -> 1.
  out = pack_documents([[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]], seq_len=4)
  expect = {
    "inputs": [[1, 2, 4, 5], [6, 7, 10, 0]],
    "targets": [[2, 3, 5, 6], [7, 8, 11, 0]],
    "inputs_position": [[0, 1, 0, 1], [0, 1, 0, 0]],
    "inputs_segmentation": [[1, 1, 2, 2], [1, 1, 2, 0]],
    "targets_segmentation": [[1, 1, 2, 2], [1, 1, 2, 0]],
  }
  assert set(out) == set(BATCH_KEYS)
  for k, v in expect.items():
    assert out[k].dtype == np.int32
    np.testing.assert_array_equal(out[k], np.array(v, np.int32), err_msg=k)


def test_pack_long_document_split_into_chunks_no_token_dropped():
  doc = list(range(100, 123))  # 22 pairs into rows of 5: 4 full rows + 2 pairs
  out = pack_documents([doc], seq_len=5)
  assert out["inputs"].shape == (5, 5)
  real = out["inputs_segmentation"] > 0
  np.testing.assert_array_equal(out["inputs"][real], doc[:-1])
  np.testing.assert_array_equal(out["targets"][real], doc[1:])
  np.testing.assert_array_equal(out["inputs_position"][:4], np.tile(np.arange(5), (4, 1)))
  np.testing.assert_array_equal(out["inputs_segmentation"][4], [1, 1, 0, 0, 0])


def test_pack_random_documents_invariants():
  rng = np.random.default_rng(1)
  docs = [rng.integers(3, 1000, size=int(rng.integers(0, 40))).tolist() for _ in range(200)]
  out = pack_documents(docs, seq_len=16)
  pairs_in = [t for d in docs for t in d[:-1]]
  pairs_tg = [t for d in docs for t in d[1:]]
  real = out["inputs_segmentation"] > 0
  np.testing.assert_array_equal(out["inputs"][real], pairs_in)
  np.testing.assert_array_equal(out["targets"][real], pairs_tg)
  assert real[:-1].all()  # only the last row may hold padding
  for seg, pos in zip(out["inputs_segmentation"], out["inputs_position"]):
    starts = np.flatnonzero(np.diff(np.concatenate([[0], seg])) != 0)
    for s in starts:  # each segment: ids 1, 2, ... and positions 0, 1, ...
      if seg[s]:
        n = int((seg == seg[s]).sum())
        np.testing.assert_array_equal(pos[s : s + n], np.arange(n))
    assert list(np.unique(seg[seg > 0])) == list(range(1, seg.max() + 1))


def test_streaming_packer_restore_continues_identically():
  docs = [list(range(i, i + 30)) for i in range(0, 300, 30)]
  full = pack_documents(docs, seq_len=8)
  it = iter(docs)
  p = StreamingPacker(8)
  pulled = []
  pull = lambda: pulled.append(d := next(it, None)) or d  # noqa: E731
  for _ in range(5):
    p.next_row(pull)
  assert p.has_pending and p.offset > 0
  q = StreamingPacker(8)
  q.restore(pulled[-1], p.offset)  # the checkpoint: which document + offset
  rest = iter(docs[len(pulled) :])
  rows = []
  while (row := q.next_row(lambda: next(rest, None))) is not None:
    rows.append(row)
  for k in BATCH_KEYS:
    np.testing.assert_array_equal(np.stack([r[k] for r in rows]), full[k][5:], err_msg=k)


@pytest.mark.parametrize("cap", [1, 2, 3])
def test_a_segment_cap_closes_rows_early_and_keeps_every_pair_in_order(cap):
  """max_segments_per_seq (cuDNN's packed attention is built for a fixed count): short documents, many to a row,
  and long ones split across rows; the cap holds in every row, no pair is lost or reordered, and a restore between
  rows (including a row the cap closed with a document not yet started) continues identically."""
  rng = np.random.default_rng(3)
  docs = [rng.integers(3, 1000, size=int(rng.integers(2, 12))).tolist() for _ in range(60)] + [list(range(40))]
  out = pack_documents(docs, seq_len=16, max_segments=cap)
  real = out["inputs_segmentation"] > 0
  np.testing.assert_array_equal(out["inputs"][real], [t for d in docs for t in d[:-1]])
  assert out["inputs_segmentation"].max(axis=1).max() == cap  # the cap is reached, never passed
  assert (~real[:-1]).any()  # some rows were closed by the cap, not by their length
  uncapped = pack_documents(docs, seq_len=16)
  assert len(out["inputs"]) > len(uncapped["inputs"])
  for rows_done in (3, 7):
    np.testing.assert_array_equal(_rows_after_restore(docs, cap, rows_done), out["inputs"][rows_done:])


def _rows_after_restore(docs: list, cap: int, rows_done: int) -> np.ndarray:
  """The inputs of the rows a fresh packer makes from the state another one had after `rows_done` rows."""
  it = iter(docs)
  p, pulled = StreamingPacker(16, cap), []
  pull = lambda: pulled.append(d := next(it, None)) or d  # noqa: E731
  for _ in range(rows_done):
    p.next_row(pull)
  q = StreamingPacker(16, cap)
  if p.has_pending:
    q.restore(pulled[-1], p.offset)
  rest = iter(docs[len(pulled) :])
  rows = []
  while (row := q.next_row(lambda: next(rest, None))) is not None:
    rows.append(row["inputs"])
  return np.stack(rows)


def test_a_group_longer_than_the_segment_cap_is_refused():
  from MaxLite.data.packing import Group

  with pytest.raises(ValueError, match="a group of 2 documents cannot fit a row of 1 segments"):
    pack_documents([Group(([1, 2, 3], [4, 5, 6]))], seq_len=16, max_segments=1)


# ------------------------------------------------------------------------------------------ prepare


def test_prepare_text_split_modes(tmp_path):
  f = tmp_path / "a.txt"
  f.write_text("para one line 1\nline 2\n\n\npara two\n\nthree\n")
  docs = lambda mode, **kw: list(prep.text_documents(str(f), mode, **kw))  # noqa: E731
  assert docs("paragraph") == ["para one line 1\nline 2", "para two", "three"]
  assert docs("paragraph", min_doc_chars=20) == ["para one line 1\nline 2", "para two\n\nthree"]
  assert docs("line") == ["para one line 1", "line 2", "para two", "three"]
  assert docs("file") == ["para one line 1\nline 2\n\n\npara two\n\nthree"]
  assert docs("file", max_doc_chars=10) == ["para one l", "ine 1\nline 2", "para two", "three"]  # cut, then trimmed


def test_prepare_jsonl_skip_counts_and_eval_split(tmp_path):
  lines = [json.dumps({"text": f"document number {i}"}) for i in range(200)]
  lines[3] = json.dumps({"body": "no text field"})
  lines[50] = "{not json"
  lines[77] = json.dumps({"text": "   "})
  (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
  s = prep.prepare(str(tmp_path / "*.jsonl"), str(tmp_path / "out"), 2, fmt="jsonl", eval_fraction=0.1)
  assert s["skipped"] == {"missing_field": 2, "empty": 1}
  assert s["train_documents"] + s["eval_documents"] == 197 and 5 <= s["eval_documents"] <= 40
  train = read_records(s["train_shards"])
  evals = read_records(s["eval_shards"])
  assert len(s["train_shards"]) == 2 and sorted(train + evals) == sorted(
    f"document number {i}" for i in range(200) if i not in (3, 50, 77)
  )
  with pytest.raises(InputError, match="already holds shards"):
    prep.prepare(str(tmp_path / "*.jsonl"), str(tmp_path / "out"), 2, fmt="jsonl")


def test_prepare_jsonl_missing_field_fails_naming_file_and_line(tmp_path):
  (tmp_path / "in.jsonl").write_text('{"text": "ok"}\n{"title": "x"}\n')
  with pytest.raises(InputError, match=r"in\.jsonl:2: missing string field 'text'"):
    prep.prepare(str(tmp_path / "in.jsonl"), str(tmp_path / "out"), 1, fmt="jsonl", on_missing_field="fail")


def test_prepare_cli_errors_are_one_line_exit_2(tmp_path, capsys):
  assert prepare_data.main(["--input", str(tmp_path / "nothing-*.txt"), "--output_dir", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --input: no files match") and err.count("\n") == 1
  (tmp_path / "in.jsonl").write_text('{"a": 1}\n')
  rc = prepare_data.main(
    [
      "--input",
      str(tmp_path / "in.jsonl"),
      "--output_dir",
      str(tmp_path / "o"),
      "--format",
      "jsonl",
      "--on_missing_field",
      "fail",
    ]
  )
  err = capsys.readouterr().err
  assert rc == 2 and err.strip().endswith("in.jsonl:1: missing string field 'text'") and err.count("\n") == 1


def test_prepare_script_runs_standalone(tmp_path):
  (tmp_path / "a.txt").write_text("hello world\n\nsecond paragraph\n")
  script = os.path.join(REPO, "MaxLite", "prepare_data.py")
  ok = subprocess.run(
    [
      sys.executable,
      script,
      "--input",
      str(tmp_path / "a.txt"),
      "--output_dir",
      str(tmp_path / "o"),
      "--num_shards",
      "2",
      "--eval_fraction",
      "0",
    ],
    capture_output=True,
    text=True,
  )
  assert ok.returncode == 0, ok.stderr
  assert "2 train documents" in ok.stdout and len(glob.glob(str(tmp_path / "o" / "train-*-of-00002.array_record"))) == 2
  bad = subprocess.run(
    [sys.executable, script, "--input", str(tmp_path / "none*"), "--output_dir", str(tmp_path)],
    capture_output=True,
    text=True,
  )
  assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr


# ------------------------------------------------------------------------------------------ tokenizer


def test_train_tokenizer_tool(tmp_path, capsys):
  prefix = str(tmp_path / "tok" / "sp")
  rc = train_tokenizer.main(
    ["--input", os.path.join(CORPUS, "eval-*.array_record"), "--model_prefix", prefix, "--vocab_size", "600"]
  )
  assert rc == 0, capsys.readouterr().err
  tok = load_tokenizer(prefix + ".model")
  assert (tok.vocab_size, tok._sp.unk_id(), tok.bos_id, tok.eos_id) == (600, 0, 1, 2)
  text = "Any text\tencodes:  ünïcødé ✓ 😀\n  indented"
  assert tok.decode(tok.encode(text)) == text
  assert train_tokenizer.main(["--input", str(tmp_path / "none*"), "--model_prefix", prefix + "2"]) == 2
  assert "error: --input: no files match" in capsys.readouterr().err
  # An existing model is never replaced silently (a run trained with it would decode to other text).
  trained = open(prefix + ".model", "rb").read()
  again = ["--input", os.path.join(CORPUS, "eval-*.array_record"), "--model_prefix", prefix, "--vocab_size", "500"]
  assert train_tokenizer.main(again) == 2
  assert f"error: {prefix}.model, {prefix}.vocab already exist(s); pass --overwrite" in capsys.readouterr().err
  assert open(prefix + ".model", "rb").read() == trained
  assert train_tokenizer.main([*again, "--overwrite"]) == 0
  assert load_tokenizer(prefix + ".model").vocab_size == 500


def test_missing_tokenizer_file_is_clear():
  with pytest.raises(InputError, match=r"^tokenizer_path: file not found: '/nonexistent/sp.model'$"):
    load_tokenizer("/nonexistent/sp.model")


# ------------------------------------------------------------------------------------------ pipeline


def test_batches_follow_contract(corpus):
  files, _ = corpus
  b = next(_iter(files, num_slots=3, slots=(0, 1, 2), seq_len=32))
  assert set(b) == set(BATCH_KEYS)
  for k in BATCH_KEYS:
    assert b[k].shape == (3, 32) and b[k].dtype == np.int32, k
  np.testing.assert_array_equal(b["targets_segmentation"], b["inputs_segmentation"])
  np.testing.assert_array_equal(
    b["inputs"][:, 1:][b["inputs_segmentation"][:, 1:] == b["inputs_segmentation"][:, :-1]],
    b["targets"][:, :-1][b["inputs_segmentation"][:, 1:] == b["inputs_segmentation"][:, :-1]],
  )


def test_row_slots_partition_records_once_per_epoch(corpus):
  files, lines = corpus
  tok = load_tokenizer(TOKENIZER)
  records = read_records(glob.glob(files))
  assert sorted(records) == sorted(lines)
  seen = []
  for slot in range(2):
    docs = _documents_in_stream(_iter(files, num_slots=2, slots=(slot,), num_epochs=1), tok)
    assert sorted(docs) == sorted(records[slot::2])  # exactly this row's records, each once
    assert docs != records[slot::2]  # shuffled
    seen += docs
  assert sorted(seen) == sorted(lines)
  one = _documents_in_stream(_iter(files, num_epochs=1), tok)
  assert sorted(one) == sorted(lines) and one == _documents_in_stream(_iter(files, num_epochs=1), tok)
  two = _documents_in_stream(_iter(files, num_epochs=2, seed=3), tok)
  assert sorted(two) == sorted(lines * 2) and two[:150] != two[150:]  # new order each epoch
  plain = _documents_in_stream(_iter(files, num_epochs=1, shuffle=False), tok)
  assert plain == records


# How 8 global rows can be spread over processes: one reader, 2 or 4 readers with contiguous rows, and an
# interleaved device order (process 0 holds rows 0-1 and 4-5, as on large TPU slices).
LAYOUTS = {
  "1x8": [(0, 1, 2, 3, 4, 5, 6, 7)],
  "2x4": [(0, 1, 2, 3), (4, 5, 6, 7)],
  "4x2": [(0, 1), (2, 3), (4, 5), (6, 7)],
  "interleaved": [(0, 1, 4, 5), (2, 3, 6, 7)],
}


def _global_batches(files, layout, steps, workers=0):
  readers = [_iter(files, num_slots=8, slots=rows, worker_count=workers) for rows in LAYOUTS[layout]]
  batches = []
  for _ in range(steps):
    full = {k: np.zeros((8, 64), np.int32) for k in BATCH_KEYS}
    for rows, reader in zip(LAYOUTS[layout], readers):
      part = next(reader)
      for k in BATCH_KEYS:
        full[k][list(rows)] = part[k]
    batches.append(full)
  return batches, readers


@pytest.mark.parametrize("layout", ["2x4", "4x2", "interleaved"])
def test_global_batches_do_not_depend_on_how_rows_are_spread(corpus, layout):
  files, _ = corpus
  expect, _ = _global_batches(files, "1x8", 12)
  got, _ = _global_batches(files, layout, 12, workers=2 if layout == "2x4" else 0)
  for step, (a, b) in enumerate(zip(expect, got)):
    for k in BATCH_KEYS:
      np.testing.assert_array_equal(a[k], b[k], err_msg=f"step {step + 1} {k}")


def test_state_saved_by_one_layout_resumes_in_another(corpus):
  """The merged per-row states of 4 readers continue the stream in 1 reader, and vice versa (elastic resume)."""
  files, _ = corpus
  expect, _ = _global_batches(files, "1x8", 40)
  _, readers = _global_batches(files, "4x2", 30)
  merged = {"num_slots": 8, "slots": {}}
  for reader in readers:
    state = json.loads(json.dumps(reader.get_state()))  # small, JSON-able: indices only
    assert len(json.dumps(state)) < 200
    merged["slots"].update(state["slots"])
  single = _iter(files, num_slots=8, slots=tuple(range(8)))
  single.set_state(merged)
  for step in range(30, 35):
    batch = next(single)
    for k in BATCH_KEYS:
      np.testing.assert_array_equal(batch[k], expect[step][k], err_msg=f"step {step + 1} {k}")
  interleaved = [_iter(files, num_slots=8, slots=rows) for rows in LAYOUTS["interleaved"]]
  for reader in interleaved:
    reader.set_state(single.get_state())
  for step in range(35, 40):
    for rows, reader in zip(LAYOUTS["interleaved"], interleaved):
      part = next(reader)
      np.testing.assert_array_equal(part["inputs"], expect[step]["inputs"][list(rows)], err_msg=f"step {step + 1}")


def test_state_of_another_global_batch_size_is_refused(corpus):
  files, _ = corpus
  four = _iter(files, num_slots=4, slots=(0, 1, 2, 3))
  next(four)
  with pytest.raises(InputError, match="global batch of 4 rows, this run has 8"):
    _iter(files, num_slots=8, slots=tuple(range(8))).set_state(four.get_state())
  with pytest.raises(InputError, match=r"no state for batch rows \[2, 3\]"):
    _iter(files, num_slots=4, slots=(0, 1, 2, 3)).set_state({"num_slots": 4, "slots": {"0": [1, 0], "1": [1, 0]}})


@pytest.mark.parametrize("num_slots,slots", [(1, (0,)), (4, (3, 1))])
def test_resume_continues_with_exactly_the_next_batch(corpus, num_slots, slots):
  files, _ = corpus
  it = _iter(files, num_slots=num_slots, slots=slots)  # forever: crosses epochs
  for _ in range(60):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  expect = [next(it) for _ in range(8)]
  fresh = _iter(files, num_slots=num_slots, slots=slots)
  fresh.set_state(state)
  for a, b in zip(expect, [next(fresh) for _ in range(8)]):
    for k in BATCH_KEYS:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_finite_epoch_pads_exhausted_rows_then_stops(corpus):
  files, _ = corpus
  rows = list(_iter(files, num_epochs=1, seq_len=128))
  n = len(rows)
  flat = np.concatenate([r["inputs_segmentation"][0] for r in rows]) > 0
  k = int(flat.sum())  # real tokens form a prefix: padding only at the very end
  assert n > 3 and 0 < k < flat.size and flat[:k].all()
  two = list(_iter(files, num_epochs=1, num_slots=2, slots=(0, 1), seq_len=128))
  lengths = [sum(1 for b in two if b["inputs_segmentation"][row].any()) for row in (0, 1)]
  assert len(two) == max(lengths) and min(lengths) < len(two)  # the shorter row pads until the longer ends
  assert not two[-1]["inputs_segmentation"][lengths.index(min(lengths))].any()


def test_fewer_records_than_global_batch_rows_is_clear(corpus):
  files, _ = corpus
  with pytest.raises(InputError, match="hold 150 records, fewer than the 151 rows of a global batch"):
    _iter(files, num_slots=151, slots=(0,))


def test_empty_glob_is_clear(corpus):
  with pytest.raises(InputError, match=r"data files .*no files match '/nope/\*\.array_record'"):
    _iter("/nope/*.array_record")


def test_corrupt_file_names_the_file(corpus, tmp_path):
  files, _ = corpus
  bad = tmp_path / "bad-00000.array_record"
  bad.write_bytes(b"this is not an array record file" * 100)
  with pytest.raises(InputError, match=f"not a readable ArrayRecord file: {bad}") as e:
    _iter(f"{files},{bad}")
  assert "\n" not in str(e.value)
  good = sorted(glob.glob(files))[0]
  truncated = tmp_path / "trunc.array_record"
  truncated.write_bytes(open(good, "rb").read()[:3000])
  with pytest.raises(InputError, match=f"not a readable ArrayRecord file: {truncated}"):
    _iter(str(truncated))


def test_missing_tokenizer_in_pipeline(corpus):
  with pytest.raises(InputError, match="tokenizer_path: file not found"):
    _iter(corpus[0], tokenizer_path="missing.model")


# ------------------------------------------------------------------------------------------ shipped assets


def test_shipped_assets_exist_and_load():
  tok = load_tokenizer(TOKENIZER)
  assert tok.vocab_size == 8192 and (tok._sp.unk_id(), tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2, -1)
  assert os.path.isfile(os.path.join(CORPUS, "SOURCE.md"))
  train = resolve_files(os.path.join(CORPUS, "train-*.array_record"))
  evals = resolve_files(os.path.join(CORPUS, "eval-*.array_record"))
  assert len(train) >= 2 and all(n > 100 for _, n in train) and len(evals) == 1 and evals[0][1] > 20
  text = read_records([evals[0][0]])[0]
  assert tok.decode(tok.encode(text)) == text
  b = next(
    make_grain_iterator(
      os.path.join(CORPUS, "train-*.array_record"),
      tokenizer_path=TOKENIZER,
      seq_len=256,
      num_slots=2,
      slots=(0, 1),
      seed=0,
      add_bos=True,
      add_eos=True,
    )
  )
  assert b["inputs"].shape == (2, 256) and (b["inputs_segmentation"] > 0).all() and b["inputs"].max() < 8192


def test_synthetic_tokens_uniform_spread_over_the_vocabulary_patterns_pile_onto_few_ids():
  """synthetic_tokens=uniform is MaxText's synthetic data (every id equally likely); the default patterns put about a
  quarter of their ids on id 0. Either way a process's rows are the global batch's rows, whatever it is given."""
  from MaxLite.data.synthetic import SyntheticIterator

  def tokens(kind, rows=range(8)):
    it = SyntheticIterator(global_batch=8, rows=rows, seq_len=2048, vocab_size=1000, seed=3, tokens=kind)
    return next(it)["inputs"]

  uniform, patterns = tokens("uniform"), tokens("patterns")
  assert uniform.min() >= 0 and uniform.max() < 1000
  uniform_share = np.bincount(uniform.ravel(), minlength=1000).max() / uniform.size
  patterns_share = np.bincount(patterns.ravel(), minlength=1000).max() / patterns.size
  assert uniform_share < 0.005 and patterns_share > 0.1, (uniform_share, patterns_share)
  assert len(np.unique(uniform)) > 990
  np.testing.assert_array_equal(tokens("uniform", rows=[5, 2]), uniform[[5, 2]])

"""tokenizer_type: Hugging Face tokenizer.json and Llama 3 tiktoken files beside sentencepiece, in the pipeline,
train.py and decode.py; transformers gives the same ids; bad input is one line."""

import base64
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
from support.config import FAST_COMPILE, REPO, make_config, run_train_cli
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from MaxLite.cli.errors import ConfigError, InputError
from MaxLite.data.grain_pipeline import make_grain_iterator
from MaxLite.data.input_pipeline import check_tokenizer
from MaxLite.data.tiktoken_tokenizer import read_ranks
from MaxLite.data.tokenizer import load_tokenizer

SENTENCEPIECE = os.path.join(REPO, "assets", "tokenizer", "maxlite_sp8k.model")
CORPUS = os.path.join(REPO, "assets", "corpus", "train-00000-of-00004.array_record")
HF_VOCAB = 600
# Not among the well-known spellings, so only tokenizer_config.json can make them BOS/EOS.
HF_SPECIALS = ["<|doc|>", "<|enddoc|>", "<|endoftext|>", "<s>"]
MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"er"]  # ranks 256.. in this order
TEXTS = [
  "The Python tutorial: def f(x):\n    return x ** 2  # squares\n\n",
  "naïve café, 東京, emoji 🙂 and tabs\tand  double  spaces",
  "text that spells <|doc|> or <|eot_id|> or </s> out",
  "",
]


def _documents(n: int) -> list[str]:
  reader = ArrayRecordReader(CORPUS)
  try:
    return [r.decode("utf-8") for r in reader.read(list(range(n)))]
  finally:
    reader.close()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  """A byte-level BPE trained on shipped documents, saved in three directories: with a tokenizer_config.json
  naming BOS/EOS, with none (well-known tokens), and with an explicit null BOS (Qwen's way)."""
  root = tmp_path_factory.mktemp("hf")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=HF_VOCAB,
    special_tokens=HF_SPECIALS,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(_documents(200), trainer)
  # Like Llama 3's tokenizer.json: a template that prepends BOS, and (some hub files) truncation switched on.
  # MaxLite must use neither: add_bos decides BOS and documents stay whole.
  tok.post_processor = processors.TemplateProcessing(single="<|doc|> $A", special_tokens=[("<|doc|>", 0)])
  tok.enable_truncation(max_length=32)
  configs = {
    "configured": {"bos_token": "<|doc|>", "eos_token": {"__type": "AddedToken", "content": "<|enddoc|>"}},
    "bare": None,
    "no_bos": {"bos_token": None, "pad_token": "<|endoftext|>"},
  }
  for name, config in configs.items():
    (root / name).mkdir()
    tok.save(str(root / name / "tokenizer.json"))
    if config is not None:
      config["tokenizer_class"] = "PreTrainedTokenizerFast"
      (root / name / "tokenizer_config.json").write_text(json.dumps(config))
  return {name: str(root / name) for name in configs}


def _write_tiktoken(path, tokens) -> str:
  path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % rank for rank, t in enumerate(tokens)))
  return str(path)


@pytest.fixture(scope="module")
def tiktoken_file(tmp_path_factory):
  """All 256 single bytes plus a few merges: 264 ranks."""
  return _write_tiktoken(tmp_path_factory.mktemp("tt") / "tokenizer.model", [bytes([b]) for b in range(256)] + MERGES)


# ------------------------------------------------------------------------------------------ huggingface


def test_hf_special_ids_from_config_else_well_known_else_none(hf_dirs):
  tok = load_tokenizer(hf_dirs["configured"], "huggingface")
  ids = {t: HF_SPECIALS.index(t) for t in HF_SPECIALS}  # the trainer numbers special tokens first
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (ids["<|doc|>"], ids["<|enddoc|>"], -1, HF_VOCAB)
  bare = load_tokenizer(hf_dirs["bare"], "huggingface")
  assert (bare.bos_id, bare.eos_id, bare.pad_id) == (ids["<s>"], ids["<|endoftext|>"], -1)
  # The tokenizer.json file itself reads the tokenizer_config.json beside it.
  assert load_tokenizer(os.path.join(hf_dirs["configured"], "tokenizer.json"), "huggingface").bos_id == tok.bos_id
  no_bos = load_tokenizer(hf_dirs["no_bos"], "huggingface")  # null beats the well-known <s>
  assert (no_bos.bos_id, no_bos.eos_id, no_bos.pad_id) == (-1, ids["<|endoftext|>"], ids["<|endoftext|>"])


def test_hf_ids_equal_transformers_and_round_trip(hf_dirs):
  transformers = pytest.importorskip("transformers")
  reference = transformers.PreTrainedTokenizerFast.from_pretrained(hf_dirs["configured"])
  tok = load_tokenizer(hf_dirs["configured"], "huggingface")
  assert (reference.bos_token_id, reference.eos_token_id) == (tok.bos_id, tok.eos_id)
  for text in TEXTS + _documents(3):
    ids = tok.encode(text)
    assert ids == reference(text, add_special_tokens=False)["input_ids"], text
    assert tok.decode(ids) == text
  assert len(tok.encode(_documents(1)[0])) < len(_documents(1)[0].encode()) / 2  # merges were learned and used


# ------------------------------------------------------------------------------------------ tiktoken


def test_tiktoken_ids_specials_and_round_trip(tiktoken_file):
  tok = load_tokenizer(tiktoken_file, "tiktoken")
  n = 256 + len(MERGES)
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (n, n + 1, n + 4, n + 256)
  assert tok.encode("the the") == [258, 260]  # "the" and " the" are merges
  for text in TEXTS:
    ids = tok.encode(text)
    assert tok.decode(ids) == text and all(0 <= i < n for i in ids)  # special-token text is plain text
  # Runs far past the 25,000-character cut still round trip.
  long = "x" + "a" * 60_000 + " " * 60_001 + "end"
  assert tok.decode(tok.encode(long)) == long
  assert tok.decode([n + 9, n + 10, n + 255]) == "<|eot_id|><|python_tag|><|reserved_special_token_246|>"


def test_tiktoken_file_reads_like_tiktokens_own_loader(tiktoken_file, monkeypatch):
  from tiktoken.load import load_tiktoken_bpe

  monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no copy under /tmp
  assert read_ranks(tiktoken_file) == load_tiktoken_bpe(tiktoken_file)


def test_tiktoken_numbering_equals_llama3_with_128000_ranks(tmp_path):
  singles = [bytes([b]) for b in range(256)]
  pairs = [bytes([a, b]) for a in range(256) for b in range(256)]
  triples = (bytes([a, b, c]) for a in range(256) for b in range(256) for c in range(256))
  tokens = singles + pairs + [next(triples) for _ in range(128_000 - len(singles) - len(pairs))]
  tok = load_tokenizer(_write_tiktoken(tmp_path / "tokenizer.model", tokens), "tiktoken")
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (128000, 128001, 128004, 128256)
  # Llama 3.1's numbering (Meta's llama-models tokenizer): named tokens first, reserved ones fill up to 128255.
  named = ["begin_of_text", "end_of_text", "reserved_special_token_0", "reserved_special_token_1"]
  named += ["finetune_right_pad_id", "step_id", "start_header_id", "end_header_id", "eom_id", "eot_id", "python_tag"]
  named += ["reserved_special_token_2"]
  assert [tok.decode([128000 + i]) for i in range(len(named))] == [f"<|{name}|>" for name in named]
  assert tok.decode([128255]) == "<|reserved_special_token_246|>"


# ------------------------------------------------------------------------------------------ every type


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface", "tiktoken"])
def test_every_tokenizer_pickles(kind, hf_dirs, tiktoken_file):
  path = {"sentencepiece": SENTENCEPIECE, "huggingface": hf_dirs["configured"], "tiktoken": tiktoken_file}[kind]
  tok = load_tokenizer(path, kind)
  copy = pickle.loads(pickle.dumps(tok))
  assert type(copy) is type(tok) and copy.path == path
  assert (copy.vocab_size, copy.bos_id, copy.eos_id, copy.pad_id) == (
    tok.vocab_size,
    tok.bos_id,
    tok.eos_id,
    tok.pad_id,
  )
  assert [copy.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
  assert copy.decode(tok.encode(TEXTS[0])) == tok.decode(tok.encode(TEXTS[0]))


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface", "tiktoken"])
def test_vocab_size_below_the_tokenizers_stops_at_start(kind, hf_dirs, tiktoken_file):
  path = {"sentencepiece": SENTENCEPIECE, "huggingface": hf_dirs["configured"], "tiktoken": tiktoken_file}[kind]
  vocab = load_tokenizer(path, kind).vocab_size
  check_tokenizer(make_config(f"tokenizer_type={kind}", f"tokenizer_path={path}", f"vocab_size={vocab}"))
  with pytest.raises(
    ConfigError, match=rf"^vocab_size={vocab - 1} is smaller than the tokenizer's vocabulary {vocab} "
  ):
    check_tokenizer(make_config(f"tokenizer_type={kind}", f"tokenizer_path={path}", f"vocab_size={vocab - 1}"))


def test_pipeline_skips_bos_for_a_tokenizer_without_one(hf_dirs, tmp_path, caplog):
  docs = ["first document, short", "second document"]
  writer = ArrayRecordWriter(str(tmp_path / "d.array_record"), "group_size:1")
  for doc in docs:
    writer.write(doc.encode())
  writer.close()
  tok = load_tokenizer(hf_dirs["no_bos"], "huggingface")
  args = dict(
    tokenizer_path=hf_dirs["no_bos"], seq_len=64, num_slots=1, slots=(0,), seed=0, add_eos=True, shuffle=False
  )
  batch = next(
    make_grain_iterator(str(tmp_path / "*.array_record"), tokenizer_type="huggingface", add_bos=True, **args)
  )
  stream = [i for doc in docs for i in tok.encode(doc) + [tok.eos_id]]  # no BOS, one EOS per document
  first = len(tok.encode(docs[0]))
  assert batch["inputs"][0, :first].tolist() == stream[:first] and batch["targets"][0, first - 1] == tok.eos_id
  assert (batch["inputs"] >= 0).all()
  with caplog.at_level(logging.WARNING):
    check_tokenizer(
      make_config("tokenizer_type=huggingface", f"tokenizer_path={hf_dirs['no_bos']}", "add_bos=true", "add_eos=true")
    )
  assert [r.getMessage().split(" but ")[0] for r in caplog.records if r.levelno == logging.WARNING] == ["add_bos=true"]


def _one_line_error(path, kind):
  with pytest.raises(InputError) as caught:
    load_tokenizer(path, kind)
  assert "\n" not in str(caught.value)
  return str(caught.value)


def test_bad_tokenizer_input_is_one_line(hf_dirs, tiktoken_file, tmp_path):
  assert _one_line_error(SENTENCEPIECE, "bpe") == (
    "tokenizer_type='bpe' is not one of: 'sentencepiece', 'huggingface', 'tiktoken'"
  )
  empty = tmp_path / "empty"
  empty.mkdir()
  assert _one_line_error(str(empty), "huggingface").startswith(f"tokenizer_path: no tokenizer.json in '{empty}'")
  assert _one_line_error(str(tmp_path / "nope"), "huggingface") == f"tokenizer_path: file not found: '{tmp_path}/nope'"
  assert _one_line_error(SENTENCEPIECE, "huggingface").startswith("tokenizer_path: not a Hugging Face tokenizer.json")
  hf_json = os.path.join(hf_dirs["configured"], "tokenizer.json")
  for not_tiktoken in (SENTENCEPIECE, hf_json):
    assert _one_line_error(not_tiktoken, "tiktoken").startswith("tokenizer_path: not a tiktoken BPE file")
  assert "is a directory" in _one_line_error(hf_dirs["configured"], "tiktoken")
  assert "tokenizer_type=tiktoken" in _one_line_error(tiktoken_file, "sentencepiece")
  gap = _write_tiktoken(tmp_path / "gap.model", [bytes([b]) for b in range(200)])
  assert _one_line_error(gap, "tiktoken").endswith("56 single bytes have no rank (the first is 200)")
  broken = tmp_path / "broken"
  shutil.copytree(hf_dirs["configured"], broken)
  (broken / "tokenizer_config.json").write_text('{"bos_token": "<|missing|>"}')
  assert "bos_token '<|missing|>' of tokenizer_config.json is not in the vocabulary" in _one_line_error(
    str(broken), "huggingface"
  )


# ------------------------------------------------------------------------------------------ commands


@pytest.mark.slow
def test_train_and_decode_commands_with_a_huggingface_tokenizer(hf_dirs, tmp_path):
  """train.py on the shipped ArrayRecord corpus, then decode.py from its checkpoint, with tokenizer_type=huggingface."""
  tokenizer = ("tokenizer_type=huggingface", f"tokenizer_path={hf_dirs['configured']}")
  run = ("model_name=tiny", "max_target_length=64", "eval_interval=-1", "enable_tensorboard=false")
  out = f"base_output_directory={tmp_path}"
  small = run_train_cli(*tokenizer, *run, out, "run_name=small", f"vocab_size={HF_VOCAB - 1}", timeout=120)
  errors = [line for line in small.stderr.splitlines() if line.startswith("error:")]
  assert small.returncode == 2 and errors == [
    f"error: vocab_size={HF_VOCAB - 1} is smaller than the tokenizer's vocabulary {HF_VOCAB} "
    f"({hf_dirs['configured']}); set vocab_size >= {HF_VOCAB}"
  ], small.stderr[-3000:]

  trained = run_train_cli(
    *tokenizer, *run, out, "run_name=hf", f"vocab_size={HF_VOCAB}", "steps=4", "enable_checkpointing=true"
  )
  assert trained.returncode == 0, trained.stderr[-3000:]
  rows = [json.loads(line) for line in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in rows)

  decode = [sys.executable, "MaxLite/decode.py", "configs/base.yml", *tokenizer, "prompt=The Python"]
  decode += [f"load_parameters_path={tmp_path / 'hf' / 'checkpoints' / '4'}", "max_target_length=64"]
  decode += ["max_prefill_predict_length=16", "max_decode_steps=6", "jax_cache_dir="]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
  decoded = subprocess.run(decode, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert decoded.returncode == 0, decoded.stderr[-3000:]
  prompt, continuation = decoded.stdout.splitlines()
  assert prompt == '[0] prompt: "The Python"' and continuation.startswith('[0] completion: "'), decoded.stdout
  assert json.loads(continuation.split(": ", 1)[1]), decoded.stdout

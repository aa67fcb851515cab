"""Hugging Face Llama <-> MaxLite: logit parity with transformers, exact round trips, clear bad-input errors."""

import json
import os
import shutil
import struct
import subprocess
import sys
import types

import numpy as np
import pytest
from support.config import BASE_YML, first_devices, make_config
from support.hf import (
  SEQ,
  check_both_rope_forms,
  export_gives_maxlite_logits,
  hf_model,
  maxlite_config,
  maxlite_logits,
  maxlite_params,
  token_ids,
)

from MaxLite.checkpoint import hf as convert_hf
from MaxLite.checkpoint.safetensors_io import SafetensorsReader
from MaxLite.cli.errors import CheckpointError, InputError
from MaxLite.decode import generate

torch = pytest.importorskip("torch")
sentencepiece_model_pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
  "overrides",
  [
    ("model_name=tiny",),
    ("model_name=llama3.1-8b",),
    ("model_name=qwen3-8b", "rope_type=yarn", "rope_factor=4", "original_max_position_embeddings=32768"),
    ("model_name=tiny", "rope_type=yarn", "rope_factor=40", "original_max_position_embeddings=64"),
  ],
  ids=["default", "llama3.1", "qwen3_yarn", "yarn40"],
)
def test_exported_rope_reads_the_same_in_transformers_4_and_5(overrides):
  from MaxLite import models

  config = make_config(*overrides)
  check_both_rope_forms(models.family(config.decoder_block).hf.config(config), config)


@pytest.mark.parametrize("scan_layers", ["true", "false"])
@pytest.mark.parametrize(
  "variant",
  [
    dict(),  # GQA: 2 kv heads for 4 query heads
    dict(tie_word_embeddings=True, num_key_value_heads=4, rope_theta=500000.0),
    dict(num_key_value_heads=1, rope_theta=1234.5, shard=True),  # MQA, sharded safetensors + index
  ],
  ids=["gqa", "tied_mha_theta5e5", "mqa_sharded"],
)
def test_converted_model_gives_the_transformers_logits(tmp_path, scan_layers, variant):
  model, path = hf_model(tmp_path, **variant)
  if variant.get("shard"):
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
  step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [f"scan_layers={scan_layers}"])
  config = maxlite_config(step_dir)  # no model arguments: they come from the converted checkpoint
  assert config.scan_layers == (scan_layers == "true") and config.base_num_kv_heads == model.config.num_key_value_heads
  ids = token_ids(model.config.vocab_size)
  with torch.no_grad():
    expected = model(torch.tensor(ids)).logits.numpy()
  got = maxlite_logits(config, maxlite_params(config, step_dir), ids)
  print(f"max abs logit difference: {np.abs(got - expected).max():.2e}")
  assert np.abs(got - expected).max() <= 1e-4


def test_hf_to_maxlite_to_hf_gives_the_original_tensors(tmp_path):
  model, path = hf_model(tmp_path)
  step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])
  files = convert_hf.to_hf(step_dir, str(tmp_path / "back"), [])
  assert "config.json" in files
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"))
  original = model.state_dict()
  assert set(reloaded.state_dict()) == set(original)
  for name, tensor in reloaded.state_dict().items():
    assert torch.equal(tensor, original[name]), name


def _expect_error(fragment, *args):
  with pytest.raises(InputError, match=fragment) as error:
    convert_hf.to_maxlite(*args)
  assert "\n" not in str(error.value)


def test_bad_inputs_are_one_clear_line(tmp_path):
  _, path = hf_model(tmp_path)
  _expect_error("no config.json there", str(tmp_path / "nowhere"), str(tmp_path / "o1"), [])
  no_weights = str(tmp_path / "no_weights")
  os.makedirs(no_weights)
  shutil.copy(os.path.join(path, "config.json"), no_weights)
  _expect_error("no model.safetensors or model.safetensors.index.json", no_weights, str(tmp_path / "o2"), [])
  with open(os.path.join(path, "config.json")) as f:
    hf = json.load(f)
  for change, fragment in (
    ({"architectures": ["PhiForCausalLM"]}, "architecture 'PhiForCausalLM' is not supported"),
    (
      {"intermediate_size": 128},
      r"'decoder.layers.mlp.wi_0.kernel' has shape \(3, 64, 160\) "
      r"but the model from config.json expects \(3, 64, 128\)",
    ),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
  ):
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump({**hf, **change}, f)
    _expect_error(fragment, path, str(tmp_path / "o3"), [])
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f)
  _expect_error("base_emb_dim=32 was given but .* has 64", path, str(tmp_path / "o4"), ["base_emb_dim=32"])
  assert not os.path.exists(tmp_path / "o3") and not os.path.exists(tmp_path / "o4")
  convert_hf.to_maxlite(path, str(tmp_path / "o5"), [])
  _expect_error("already exists", path, str(tmp_path / "o5"), [])


def test_to_hf_of_a_missing_step_names_the_flag_given_and_the_steps_there(tmp_path):
  _, path = hf_model(tmp_path)
  step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])
  missing = tmp_path / "ml" / "77"
  with pytest.raises(CheckpointError) as error:
    convert_hf.to_hf(str(missing), str(tmp_path / "export"), [])
  assert str(error.value) == (
    f"--checkpoint_path={missing}: no such directory; {tmp_path / 'ml'} holds steps 0 (the newest: {step_dir})"
  )
  assert not os.path.exists(tmp_path / "export")


TOKENIZERS = {
  "sentencepiece": os.path.join(os.path.dirname(BASE_YML), "..", "assets", "tokenizer", "maxlite_sp8k.model"),
  "huggingface": os.path.join(os.path.dirname(BASE_YML), "..", "assets", "tokenizer", "chat"),
}
# Where a Llama sentencepiece tokenizer converted by transformers parts from sentencepiece: leading and repeated
# spaces (the dummy prefix), tabs and newlines, digits, bytes outside the vocabulary, the literal "▁".
AWKWARD_TEXTS = [
  "Hello world",
  " leading space",
  "  two  spaces, trailing ",
  "tabs\tand\nnew lines\n\n  indented(x) ** 2",
  "digits 1234567 and 3.14159",
  "naïve café, 東京, emoji 🙂 \u200b",
  "a literal ▁ and ▁▁two",
  "",
]


@pytest.mark.parametrize("kind", list(TOKENIZERS))
def test_export_carries_a_tokenizer_autotokenizer_reads_as_maxlite_encodes(tmp_path, monkeypatch, kind):
  """AutoTokenizer.from_pretrained(the export), offline: MaxLite's ids for every text, BOS as add_bos adds it, and
  decode gives the text back as MaxLite's does."""
  from MaxLite.data.tokenizer import load_tokenizer

  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  ours = load_tokenizer(TOKENIZERS[kind], kind)
  _, path = hf_model(tmp_path, vocab_size=ours.vocab_size, num_hidden_layers=1)
  step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])
  export = str(tmp_path / "export")
  files = convert_hf.to_hf(step_dir, export, [f"tokenizer_type={kind}", f"tokenizer_path={TOKENIZERS[kind]}"])
  assert "tokenizer.json" in files and "tokenizer_config.json" in files
  theirs = transformers.AutoTokenizer.from_pretrained(export, local_files_only=True)
  assert (theirs.bos_token_id, theirs.eos_token_id) == tuple(i if i >= 0 else None for i in (ours.bos_id, ours.eos_id))
  for text in AWKWARD_TEXTS:
    ids = ours.encode(text)
    assert theirs.encode(text, add_special_tokens=False) == ids, text
    assert theirs.decode(ids) == ours.decode(ids), text
  if kind == "sentencepiece":  # add_bos (true): MaxLite's training documents begin with BOS, so do its prompts
    assert theirs("two  words").input_ids == [ours.bos_id, *ours.encode("two  words")]
    assert "tokenizer.model" in files  # for sentencepiece readers (llama.cpp, vLLM's slow path)


@pytest.mark.parametrize("kind", ["maxlite_unigram", "bpe", "unigram"])
def test_other_sentencepiece_models_export_as_they_encode(tmp_path, monkeypatch, kind):
  """A Unigram model from MaxLite's train_tokenizer, and a BPE and a Unigram with sentencepiece's own defaults (NFKC
  rules, extra whitespace removed, no byte fallback; the Unigram's scores put on the grid train_tokenizer uses):
  AutoTokenizer on the written files gives sentencepiece's ids."""
  import sentencepiece as spm

  from MaxLite.checkpoint.tokenizer_export import write_tokenizer
  from MaxLite.data.tokenizer_training import on_exact_grid, sentences, train_tokenizer

  corpus = os.path.join(os.path.dirname(BASE_YML), "..", "assets", "corpus", "train-00000-of-00004.array_record")
  prefix = str(tmp_path / "sp")
  model = prefix + ".model"
  if kind == "maxlite_unigram":
    train_tokenizer(corpus, prefix, 600, model_type="unigram", input_sentence_size=3000, num_threads=1)
  else:
    lines = sentences([corpus], "text")
    spm.SentencePieceTrainer.train(
      sentence_iterator=lines,
      model_prefix=prefix,
      model_type=kind,
      vocab_size=600,
      input_sentence_size=3000,
      minloglevel=2,
    )
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(open(model, "rb").read())
    open(model, "wb").write(on_exact_grid(proto).SerializeToString())
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  config = types.SimpleNamespace(tokenizer_type="sentencepiece", tokenizer_path=model, add_bos=True)
  os.makedirs(tmp_path / "export")
  assert "tokenizer.json" in write_tokenizer(config, str(tmp_path / "export"))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "export"), local_files_only=True)
  ours = spm.SentencePieceProcessor(model_file=model)
  for text in AWKWARD_TEXTS + ["Ｆｕｌｌ width ½ ﬁ e\u0301 <0x41>", RUNS]:
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text), text


# Runs of one character, between other characters: where segmentations tie ("▁▁▁" + "▁▁▁▁▁" or "▁▁▁▁▁" + "▁▁▁").
RUNS = "".join("x" * (n % 5 + 1) + c * n for c in " -" for n in range(1, 33))


def _unigram_with_a_float32_tie():
  """A Unigram model on which sentencepiece (float32 sums) and tokenizers (float64) split "xxxx" + 11 spaces + "x"
  differently: [▁▁▁, ▁▁▁▁▁, ▁▁▁] and [▁▁▁, ▁▁▁, ▁▁▁▁▁]."""
  proto = sentencepiece_model_pb2.ModelProto()
  proto.trainer_spec.model_type, proto.trainer_spec.unk_id, proto.trainer_spec.bos_id = 1, 0, -1
  proto.trainer_spec.eos_id = proto.trainer_spec.pad_id = -1
  proto.normalizer_spec.name = "identity"
  proto.normalizer_spec.add_dummy_prefix = proto.normalizer_spec.remove_extra_whitespaces = False
  scores = {"x": -5.869627, "▁": -6.73489, "▁▁▁": -1.6850755, "▁▁▁▁▁": -11.103114}
  for text, score, kind in [("<unk>", 0.0, 2)] + [(p, s, 1) for p, s in scores.items()]:
    piece = proto.pieces.add()
    piece.piece, piece.score, piece.type = text, score, kind
  return proto


def test_a_unigram_model_whose_ties_float32_breaks_otherwise_is_exported_once_on_the_grid(tmp_path, caplog):
  """Off the score grid, the tokenizer.json would split a run of spaces otherwise than sentencepiece: refused, and the
  refusal does not hang on which vocabulary sample is drawn. Rounded as train_tokenizer rounds its models'
  scores (on_exact_grid), it is written and AutoTokenizer gives sentencepiece's ids on every run."""
  import sentencepiece as spm

  from MaxLite.checkpoint.tokenizer_export import write_tokenizer
  from MaxLite.data.tokenizer_training import on_exact_grid

  for name, proto in [("off", _unigram_with_a_float32_tie()), ("on", on_exact_grid(_unigram_with_a_float32_tie()))]:
    model = tmp_path / f"{name}.model"
    model.write_bytes(proto.SerializeToString())
    config = types.SimpleNamespace(tokenizer_type="sentencepiece", tokenizer_path=str(model), add_bos=False)
    os.makedirs(tmp_path / name)
    written = write_tokenizer(config, str(tmp_path / name))
    if name == "off":
      assert written == ["tokenizer.model"] and "differently from sentencepiece" in caplog.text
      continue
    assert "tokenizer.json" in written
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / name), local_files_only=True)
    ours = spm.SentencePieceProcessor(model_file=str(model))
    for text in [RUNS, "xxxx" + " " * 11 + "x"]:
      assert theirs.encode(text, add_special_tokens=False) == ours.encode(text), text


def test_a_tokenizer_json_that_would_encode_differently_is_not_written(tmp_path, monkeypatch, caplog):
  """The built tokenizer.json is checked against sentencepiece first: one that lost the dummy prefix is refused."""
  from tokenizers import normalizers

  from MaxLite.checkpoint import tokenizer_export

  build = tokenizer_export.tokenizers_from_sentencepiece

  def without_prefix(proto):
    built = build(proto)
    built.normalizer = normalizers.Replace(" ", "▁")
    return built

  monkeypatch.setattr(tokenizer_export, "tokenizers_from_sentencepiece", without_prefix)
  sentencepiece = TOKENIZERS["sentencepiece"]
  config = types.SimpleNamespace(tokenizer_type="sentencepiece", tokenizer_path=sentencepiece, add_bos=True)
  os.makedirs(tmp_path / "export")
  assert tokenizer_export.write_tokenizer(config, str(tmp_path / "export")) == ["tokenizer.model"]
  assert "encodes 'Hello world' differently from sentencepiece" in caplog.text
  assert sorted(os.listdir(tmp_path / "export")) == ["tokenizer.model"]


def test_export_with_a_tokenizer_that_is_not_the_models_writes_none(tmp_path):
  """No tokenizer_path and the shipped one does not fit the model: no tokenizer files rather than someone else's."""
  _, path = hf_model(tmp_path, num_hidden_layers=1)  # vocab 384
  step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])
  files = convert_hf.to_hf(step_dir, str(tmp_path / "export"), [])
  assert not [f for f in files if f.startswith("tokenizer")], files


@pytest.mark.slow
def test_maxlite_trained_model_exports_to_transformers(tmp_path):
  """A tiny model trained by MaxLite, exported: transformers gives MaxLite's logits."""
  from MaxLite.training.trainer import train

  config = make_config(
    "model_name=tiny",
    "dataset_type=synthetic",
    "steps=2",
    f"max_target_length={SEQ}",
    "enable_checkpointing=true",
    f"base_output_directory={tmp_path}",
    "run_name=t",
    "enable_tensorboard=false",
  )
  train(config, first_devices(1))
  step_dir = str(tmp_path / "t" / "checkpoints" / "2")
  model, loaded, params = export_gives_maxlite_logits(step_dir, str(tmp_path / "hf"))
  # Greedy decoding with MaxLite's KV cache picks the same tokens as transformers' generate.
  prompt = [1, 523, 77, 4096, 12]
  decoded = maxlite_config(step_dir, "max_prefill_predict_length=8", "max_decode_steps=12")
  ours, _ = generate(decoded, params, [prompt], eos_id=2)
  with torch.no_grad():
    theirs = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=0)[
      0, len(prompt) :
    ].tolist()
  assert ours[0] == theirs, (ours[0], theirs)


@pytest.mark.slow
def test_command_line(tmp_path):
  import subprocess
  import sys

  script = os.path.join(os.path.dirname(BASE_YML), "..", "MaxLite", "convert_hf.py")
  _, path = hf_model(tmp_path)
  run = lambda *a: subprocess.run([sys.executable, script, *a], capture_output=True, text=True, timeout=300)
  done = run("to_maxlite", f"--hf_path={path}", f"--output_path={tmp_path / 'ml'}", "scan_layers=false")
  assert done.returncode == 0 and f"load_parameters_path={tmp_path / 'ml' / '0'}" in done.stdout, done.stderr[-2000:]
  back = run("to_hf", f"--checkpoint_path={tmp_path / 'ml' / '0'}", f"--output_path={tmp_path / 'hf2'}")
  assert back.returncode == 0 and os.path.isfile(tmp_path / "hf2" / "model.safetensors"), back.stderr[-2000:]
  for args, fragment in (
    (("sideways",), "invalid choice: 'sideways'"),
    (("to_hf",), "--checkpoint_path=... is required"),
  ):
    bad = run(*args)
    assert bad.returncode == 2 and fragment in bad.stderr and "Traceback" not in bad.stderr


# --- broken safetensors files: one error line naming the file, never garbage weights ---------------------------

A = np.arange(12, dtype=np.float32).reshape(3, 4)
B = np.array([0.5, -1.5, 2.5, -3.5], np.float32)


def _safetensors_file(path, header, data, header_length=None):
  raw = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(raw) if header_length is None else header_length) + raw + data)


def _valid_parts():
  """The header and data bytes of a valid file holding A then B (written by hand so each case below is one edit)."""
  header = {
    "__metadata__": {"format": "pt"},
    "a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
    "b": {"dtype": "F32", "shape": [4], "data_offsets": [48, 64]},
  }
  return header, A.tobytes() + B.tobytes()


def _broken(case):
  """(header, data, header_length) of a broken file; each one the old hand-written reader turned into garbage
  (uninitialised or misplaced bytes) or a traceback."""
  header, data = _valid_parts()
  a, b = header["a"], header["b"]
  if case == "truncated":
    return header, data[:-10], None
  if case == "header_length_past_end":
    return header, data, 10**6
  if case == "offsets_past_end":  # dtype, shape and byte length agree; the bytes are not in the file
    return {**header, "b": {**b, "shape": [8], "data_offsets": [48, 80]}}, data, None
  if case == "overlapping_offsets":  # b would read a's last 4 values
    return {**header, "b": {**b, "data_offsets": [32, 48]}}, data, None
  if case == "negative_offset":
    return {**header, "b": {**b, "data_offsets": [-16, 0]}}, data, None
  if case == "shape_disagrees_with_bytes":
    return {**header, "a": {**a, "shape": [2, 4]}}, data, None
  if case == "dtype_disagrees_with_bytes":
    return {**header, "a": {**a, "dtype": "F64"}}, data, None
  raise ValueError(case)


BROKEN = [
  "truncated",
  "header_length_past_end",
  "offsets_past_end",
  "overlapping_offsets",
  "negative_offset",
  "shape_disagrees_with_bytes",
  "dtype_disagrees_with_bytes",
]


# file:// goes through fsspec like gs://: MaxLite's own in-place URL reader (safe_open needs a local file).
@pytest.mark.parametrize("where", ["local", "url"])
def test_safetensors_reader_reads_valid_files_exactly(tmp_path, where):
  _safetensors_file(tmp_path / "model.safetensors", *_valid_parts())
  reader = SafetensorsReader(str(tmp_path) if where == "local" else f"file://{tmp_path}")
  assert reader.names() == ["a", "b"] and reader.shape("a") == (3, 4)
  np.testing.assert_array_equal(reader.read("a"), A)
  np.testing.assert_array_equal(reader.read("b"), B)


@pytest.mark.parametrize("where", ["local", "url"])
def test_write_checkpoint_round_trips_bfloat16_and_shards(tmp_path, where):
  import ml_dtypes

  from MaxLite.checkpoint.safetensors_io import write_checkpoint

  rng = np.random.default_rng(0)
  tensors = {f"t{i}": rng.standard_normal((i + 1, 5)).astype(ml_dtypes.bfloat16) for i in range(4)}
  tensors["f"] = rng.standard_normal(7).astype(np.float32)
  directory = str(tmp_path) if where == "local" else f"file://{tmp_path}"
  files = write_checkpoint(directory, [(n, t.shape, t.dtype, lambda t=t: t) for n, t in tensors.items()], 40)
  assert "model.safetensors.index.json" in files and len(files) > 2  # 40-byte shards: several files
  reader = SafetensorsReader(directory)
  assert reader.names() == sorted(tensors)
  for name, tensor in tensors.items():
    got = reader.read(name)
    assert got.dtype == tensor.dtype and got.tobytes() == tensor.tobytes(), name


@pytest.mark.parametrize("where", ["local", "url"])
@pytest.mark.parametrize("case", BROKEN)
def test_broken_safetensors_is_one_line_naming_the_file(tmp_path, where, case):
  path = tmp_path / "model.safetensors"
  _safetensors_file(path, *_broken(case))
  directory = str(tmp_path) if where == "local" else f"file://{tmp_path}"
  with pytest.raises(InputError, match=f"^{'file://' if where == 'url' else ''}{path}: not a valid safetensors file"):
    reader = SafetensorsReader(directory)
    print({name: reader.read(name) for name in reader.names()})  # what the old reader returned
  with pytest.raises(InputError) as error:
    SafetensorsReader(directory)
  assert "\n" not in str(error.value)


def test_url_reader_checks_every_read_length(tmp_path):
  """A file cut after its header was checked: the read fails instead of returning a partly filled tensor."""
  path = tmp_path / "model.safetensors"
  _safetensors_file(path, *_valid_parts())
  reader = SafetensorsReader(f"file://{tmp_path}")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 8)
  np.testing.assert_array_equal(reader.read("a"), A)
  with pytest.raises(InputError, match=r"model.safetensors: not a valid safetensors file \(it ends 8 bytes short"):
    reader.read("b")


def test_bad_shard_index_and_duplicate_tensors_are_one_line(tmp_path):
  header, data = _valid_parts()
  _safetensors_file(tmp_path / "one.safetensors", header, data)
  _safetensors_file(tmp_path / "two.safetensors", header, data)
  index = tmp_path / "model.safetensors.index.json"
  index.write_text(json.dumps({"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}))
  with pytest.raises(InputError, match="tensor 'a' is in both .*one.safetensors and .*two.safetensors"):
    SafetensorsReader(str(tmp_path))
  for content, fragment in (
    ("{not json", "not a safetensors index"),
    (json.dumps({"weight_map": {"a": "../one.safetensors"}}), "not a file in the same directory"),
  ):
    index.write_text(content)
    with pytest.raises(InputError, match=fragment):
      SafetensorsReader(str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["offsets_past_end"])  # a truncated file fails in the same reader (tested above)
def test_command_line_refuses_broken_safetensors(tmp_path, case):
  hf_dir = tmp_path / "hf"
  hf_dir.mkdir()
  config = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=4,
    intermediate_size=8,
    num_attention_heads=1,
    num_hidden_layers=1,
    vocab_size=3,
  )
  (hf_dir / "config.json").write_text(json.dumps(config))
  _safetensors_file(hf_dir / "model.safetensors", *_broken(case))
  script = os.path.join(os.path.dirname(BASE_YML), "..", "MaxLite", "convert_hf.py")
  out = tmp_path / "ml"
  done = subprocess.run(
    [sys.executable, script, "to_maxlite", f"--hf_path={hf_dir}", f"--output_path={out}"],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 2, done.stderr[-2000:]
  assert done.stderr.startswith(f"error: {hf_dir / 'model.safetensors'}: not a valid safetensors file (")
  assert len(done.stderr.strip().splitlines()) == 1, done.stderr
  assert not out.exists()

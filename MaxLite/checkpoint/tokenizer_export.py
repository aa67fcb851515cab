"""The tokenizer a Hugging Face export carries, so `AutoTokenizer.from_pretrained(<export>)` gives the ids the model
was trained on, offline: a `huggingface` tokenizer's files are copied; a `sentencepiece` model is written as
tokenizer.model (for sentencepiece readers) and as a tokenizer.json built from it with the `tokenizers` library.

That tokenizer.json is the pipeline transformers' Llama converter wrote for Llama 2 (legacy=True): sentencepiece's
normalization, its dummy-prefix "▁" and spaces as "▁", then BPE (merges ranked by the merged piece's score) or
Unigram, byte fallback, control pieces special. transformers 5's LlamaTokenizer class would rebuild that pipeline on
load with a pre-tokenizer that adds no "▁" before text starting with a space (" a": [▁a] where sentencepiece gives
[▁, ▁a]), so tokenizer_config.json names PreTrainedTokenizerFast, which runs tokenizer.json as written (transformers
4.x and 5 alike). Before it is written the built tokenizer must encode awkward text (and a sample of the vocabulary)
exactly as sentencepiece does; a model it cannot reproduce ships as tokenizer.model alone, with a warning. A
Unigram model whose scores are off a coarse grid usually cannot be: sentencepiece adds scores in float32, tokenizers
in float64, and the two break ties between segmentations of one character's runs differently (MaxLite's
train_tokenizer puts scores on such a grid: data.tokenizer_training.on_exact_grid).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from MaxLite import storage

# Where converted sentencepiece tokenizers usually part from sentencepiece: the dummy prefix before leading and
# repeated spaces, tabs and newlines, digits, bytes outside the vocabulary, the literal "▁", full-width and combining
# characters (normalization rules), runs of one character (ties between segmentations), an empty string.
PROBES = (
  "Hello world",
  " leading space",
  "  two  spaces, trailing ",
  "tabs\tand\nnew lines\n\n    indented(x) ** 2",
  "digits 1234567 and 3.14159",
  "naïve café, 東京, emoji 🙂 \u200b",
  "a literal ▁ and ▁▁two",
  "Ｆｕｌｌ width ½ ﬁ e\u0301",
  "",
)
# Each run on its own: whether float32 and float64 break a tie the same way turns on the score of the text before it.
RUNS = tuple(f"{'x' * m}{c * n}x" for c in " \t-=#*0" for m in range(1, 6) for n in range(1, 33))

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6  # sentencepiece's piece types
_UNIGRAM, _BPE = 1, 2


def write_tokenizer(config: Any, output_path: str) -> list[str]:
  """Writes the configured tokenizer into output_path; returns the file names written."""
  if config.tokenizer_type == "huggingface":
    return _copy_huggingface(storage.resolve(config.tokenizer_path), output_path)
  if config.tokenizer_type == "sentencepiece":
    return _write_sentencepiece(storage.resolve(config.tokenizer_path), output_path, config.add_bos)
  logging.warning(
    "to_hf: a tiktoken tokenizer is not written into the export; copy the model's own tokenizer files beside it"
  )
  return []


def _copy_huggingface(source: str, output_path: str) -> list[str]:
  folder = source if storage.isdir(source) else storage.dirname(source)
  files = {"tokenizer.json": source if storage.isfile(source) else storage.join(folder, "tokenizer.json")}
  others = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")  # as transformers 5 saves
  files.update({name: storage.join(folder, name) for name in others})
  copied = []
  for name, path in files.items():
    if storage.isfile(path):
      storage.write_bytes(storage.join(output_path, name), storage.read_bytes(path))
      copied.append(name)
  return copied


def _write_sentencepiece(path: str, output_path: str, add_bos: bool) -> list[str]:
  import sentencepiece as spm
  from sentencepiece import sentencepiece_model_pb2

  data = storage.read_bytes(path)
  storage.write_bytes(storage.join(output_path, "tokenizer.model"), data)
  proto = sentencepiece_model_pb2.ModelProto()
  proto.ParseFromString(data)
  processor = spm.SentencePieceProcessor()
  processor.load_from_serialized_proto(data)
  built = tokenizers_from_sentencepiece(proto)
  if built is None:
    logging.warning("to_hf: %s is neither BPE nor Unigram; only tokenizer.model is written", path)
    return ["tokenizer.model"]
  pieces = [p.piece.replace("▁", " ") for p in proto.pieces if p.type == _NORMAL]
  samples = [*PROBES, *RUNS, "".join(pieces[::7]), " ".join(pieces[3::11])]
  samples += [f"a{p.piece}b {p.piece}" for p in proto.pieces if p.type == _USER_DEFINED]
  for text in samples:
    if built.encode(text, add_special_tokens=False).ids != processor.encode(text):
      logging.warning(
        "to_hf: the tokenizer.json built from %s encodes %r differently from sentencepiece; only tokenizer.model "
        "is written (transformers would convert it with its own rules)",
        path,
        text[:60],
      )
      return ["tokenizer.model"]

  def piece(i: int) -> str | None:
    return proto.pieces[i].piece if 0 <= i < len(proto.pieces) else None

  spec = proto.trainer_spec
  bos = piece(spec.bos_id) if add_bos else None
  if bos is not None:  # MaxLite's documents begin with BOS when add_bos (and the tokenizer has one): so do prompts
    from tokenizers import processors

    built.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, spec.bos_id)]
    )
  storage.write_text(storage.join(output_path, "tokenizer.json"), built.to_str())
  settings = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": piece(spec.bos_id),
    "eos_token": piece(spec.eos_id),
    "unk_token": piece(spec.unk_id),
    "pad_token": piece(spec.pad_id),
    "add_bos_token": bos is not None,
    "add_eos_token": False,  # a prompt must not end a document; training appends EOS per add_eos
    "clean_up_tokenization_spaces": False,
  }
  storage.write_text(storage.join(output_path, "tokenizer_config.json"), json.dumps(settings, indent=2))
  return ["tokenizer.model", "tokenizer.json", "tokenizer_config.json"]


def tokenizers_from_sentencepiece(proto: Any) -> Any:
  """A `tokenizers.Tokenizer` computing the sentencepiece ModelProto's ids; None for a model type it cannot build."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers

  pieces, spec, normalizer = proto.pieces, proto.trainer_spec, proto.normalizer_spec
  if spec.model_type == _BPE:
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    # sentencepiece merges the adjacent pair whose merged piece scores highest: merges ranked by that score
    mergeable = {p.piece: p.score for p in pieces if p.type == _NORMAL}
    ranked = []
    for merged, score in mergeable.items():
      for cut in range(1, len(merged)):
        left, right = merged[:cut], merged[cut:]
        if left in mergeable and right in mergeable:
          ranked.append((-score, vocab[merged], vocab[left], (left, right)))
    ranked.sort()
    model = models.BPE(
      vocab=vocab,
      merges=[merge for *_, merge in ranked],
      unk_token=pieces[spec.unk_id].piece,
      fuse_unk=True,
      byte_fallback=spec.byte_fallback,
    )
  elif spec.model_type == _UNIGRAM:
    # sentencepiece never matches a byte piece's text ("<0x41>"); tokenizers would, at score 0: never chosen here.
    lowest = min((p.score for p in pieces if p.type == _NORMAL), default=0.0) - 1000.0
    scores = [(p.piece, lowest if p.type == _BYTE else p.score) for p in pieces]
    model = models.Unigram(scores, unk_id=spec.unk_id, byte_fallback=spec.byte_fallback)
  else:
    return None
  built = Tokenizer(model)
  steps = [normalizers.Precompiled(normalizer.precompiled_charsmap)] if normalizer.precompiled_charsmap else []
  if normalizer.remove_extra_whitespaces:
    steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
  if normalizer.add_dummy_prefix:
    steps.append(normalizers.Prepend("▁"))
  steps.append(normalizers.Replace(" ", "▁"))
  built.normalizer = normalizers.Sequence(steps)
  decoding = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
  built.decoder = decoders.Sequence(decoding + ([decoders.Strip(" ", 1, 0)] if normalizer.add_dummy_prefix else []))
  built.add_special_tokens(
    [AddedToken(p.piece, special=True, normalized=False) for p in pieces if p.type in (_UNKNOWN, _CONTROL)]
  )
  built.add_tokens([AddedToken(p.piece, normalized=False) for p in pieces if p.type == _USER_DEFINED])
  return built

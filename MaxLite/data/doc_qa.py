"""A chat set and a preference set built from the shipped Python documentation corpus (no download).

Each section of the reStructuredText sources (a heading underlined with = - ~ ^ * or ") is paired with the leading
sentences (up to 200 characters) of its first prose paragraph, with the markup removed. A chat asks about the
section's heading and is answered with that text (some chats ask about two sections in two turns, some open with a
system message). A preference pair asks the same kind of question; the chosen answer quotes the right section, the
rejected one another section of the same split (two pairs per train section, with other wordings and sections).
The train sets come from the train shards, the eval sets from the eval shard, so eval questions are held out; one more
preference eval set holds new pairs about trained sections (`new_pairs`).

Everything is a pure function of the corpus and the seed: make_post_training_data.py writes the shipped files and a
test checks that they are what this module builds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from MaxLite import storage
from MaxLite.data.sources import open_source

_UNDERLINE = re.compile(r'^([=\-~^*"])\1{2,}\s*$')
_ROLE = re.compile(r":[a-z:]+:`~?!?([^`<]*?)(?:\s*<[^>]*>)?`")  # :func:`len` -> len, :ref:`text <target>` -> text
_LITERAL = re.compile(r"``([^`]*)``")
_EMPHASIS = re.compile(r"(?<![\w*])\*{1,2}([^*\n]+?)\*{1,2}(?![\w*])")
_LINK = re.compile(r"`([^`<]+?)\s*(?:<[^>]*>)?`_{1,2}")
_QUESTIONS = (
  "What does the Python documentation say about {}?",
  "Can you explain {}?",
  "Tell me about {}.",
  "I am reading the Python docs. What is {} about?",
)
SYSTEM = "You answer questions about Python from its documentation."
_ANSWER = 'The section "{}" says: {}'


def first_sentences(paragraph: str, limit: int = 200) -> str:
  """The paragraph's leading sentences that fit in `limit` characters (at least its first sentence)."""
  sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z])", paragraph)
  out = sentences[0]
  for sentence in sentences[1:]:
    if len(out) + 1 + len(sentence) > limit:
      break
    out += " " + sentence
  return out


def plain(text: str) -> str:
  """reStructuredText inline markup removed, lines joined."""
  for pattern in (_ROLE, _LITERAL, _LINK, _EMPHASIS):
    text = pattern.sub(r"\1", text)
  return " ".join(text.split())


def _is_prose(block: list[str]) -> bool:
  first = block[0]
  return not (
    first.startswith((" ", "\t", "..", ">>>", "|", "+", "*", "-", "#"))
    or block[-1].rstrip().endswith("::")
    or re.match(r"^\d+\.", first)
  )


def sections(document: str) -> list[tuple[str, str]]:
  """(heading, first prose paragraph of 80-700 characters after it) of each section of one document."""
  lines = document.split("\n")
  out, heading, block = [], None, []

  def close_block() -> None:
    nonlocal heading, block
    if heading and block and _is_prose(block):
      paragraph = plain(" ".join(block))
      if 80 <= len(paragraph) <= 700:
        out.append((heading, first_sentences(paragraph)))
        heading = None
    block = []

  for i, line in enumerate(lines):
    following = lines[i + 1] if i + 1 < len(lines) else ""
    if line.strip() and _UNDERLINE.match(following) and len(following.rstrip()) >= len(line.rstrip()):
      close_block()
      heading = plain(line.strip())
      heading = heading if 3 <= len(heading) <= 80 else None
    elif _UNDERLINE.match(line):
      continue
    elif line.strip():
      block.append(line)
    else:
      close_block()
  close_block()
  return out


def _pairs(files: str) -> list[tuple[str, str]]:
  source = open_source(storage.resolve_list(files))
  seen, out = set(), []
  for i in range(len(source)):
    for heading, paragraph in sections(source[i].decode("utf-8")):
      if heading not in seen:  # the same heading twice ("Introduction") would make an ambiguous question
        seen.add(heading)
        out.append((heading, paragraph))
  return out


def _question(rng: np.random.Generator, heading: str) -> str:
  return _QUESTIONS[int(rng.integers(len(_QUESTIONS)))].format(heading.rstrip("?.:"))


def chats(pairs: Sequence[tuple[str, str]], seed: int) -> list[dict[str, Any]]:
  """Conversations: one question (or two, in two turns) answered with the sections' paragraphs."""
  rng = np.random.default_rng(seed)
  out, i = [], 0
  while i < len(pairs):
    turns = 2 if rng.random() < 0.25 and i + 1 < len(pairs) else 1
    messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
    for heading, paragraph in pairs[i : i + turns]:
      messages += [
        {"role": "user", "content": _question(rng, heading)},
        {"role": "assistant", "content": _ANSWER.format(heading, paragraph)},
      ]
    out.append({"messages": messages})
    i += turns
  return out


def preferences(pairs: Sequence[tuple[str, str]], seed: int, per_section: int = 1) -> list[dict[str, str]]:
  """Pairs: a question about one section, its paragraph chosen, another section's paragraph rejected (for each
  section `per_section` pairs, each with its own question wording and wrong section)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(per_section):
    for i, (heading, paragraph) in enumerate(pairs):
      other = (i + 1 + int(rng.integers(len(pairs) - 1))) % len(pairs)
      wrong_heading, wrong = pairs[other]
      out.append(
        {
          "prompt": _question(rng, heading),
          "chosen": _ANSWER.format(heading, paragraph),
          "rejected": _ANSWER.format(wrong_heading, wrong),
        }
      )
  return out


def new_pairs(pairs: Sequence[tuple[str, str]], seed: int, count: int = 60) -> list[dict[str, str]]:
  """Held-out pairs about trained sections: for `count` of the even-numbered sections, a question and a wrong section
  (an odd-numbered one) drawn afresh. Every paragraph in them is also chosen (and rejected) in the train pairs, so only
  a policy that matches the answer to the question prefers the right one."""
  rng = np.random.default_rng(seed)
  asked, others = pairs[0::2][:count], pairs[1::2]
  out = []
  for heading, paragraph in asked:
    wrong_heading, wrong = others[int(rng.integers(len(others)))]
    out.append(
      {
        "prompt": _question(rng, heading),
        "chosen": _ANSWER.format(heading, paragraph),
        "rejected": _ANSWER.format(wrong_heading, wrong),
      }
    )
  return out


def jsonl(records: Iterable[dict[str, Any]]) -> str:
  return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def build(train_files: str, eval_files: str, seed: int = 0) -> dict[str, str]:
  """{file name: JSONL text} of the five shipped sets."""
  train, held_out = _pairs(train_files), _pairs(eval_files)
  return {
    "chats-train.jsonl": jsonl(chats(train, seed)),
    "chats-eval.jsonl": jsonl(chats(held_out, seed + 1)),
    "preferences-train.jsonl": jsonl(preferences(train, seed + 2, per_section=2)),
    "preferences-eval.jsonl": jsonl(preferences(held_out, seed + 3)),
    "preferences-eval-trained-sections.jsonl": jsonl(new_pairs(train, seed + 99)),
  }

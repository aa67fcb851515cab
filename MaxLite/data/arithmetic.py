"""A verifiable task for GRPO that the tiny CPU models can partly learn: one-step addition and subtraction word
problems, with reward functions that check the answer (TRL's reward-function convention).

A problem is a sentence template and two operands (1..10; a subtraction never goes below 0). The prompt asks the
question and ends with "Answer:"; the completion restates the equation and ends with "The answer is N.":

  prompt      "Question: Ana has 7 apples and buys 5 more. How many apples does Ana have?\\nAnswer:"
  completion  "7 + 5 = 12. The answer is 12."
  answer      "12"

Records are a pure function of (count, seed, exclude): Python's random.Random, whose integer seeding, shuffle and
choice give the same stream on every Python 3 version (numpy's Generator streams may change between releases), so
the shipped files can be rebuilt byte for byte and a test checks that they are. The held-out eval set shares no
(template, operands) problem with the train set: `problem_key` recovers that key from a prompt.

Usage:   python -m MaxLite.data.arithmetic [--out assets/grpo]
Writes OUT/arithmetic-train.jsonl (420 records, seed 0) and OUT/arithmetic-eval.jsonl (200 held-out records, seed 1).
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

TRAIN_FILE, EVAL_FILE = "arithmetic-train.jsonl", "arithmetic-eval.jsonl"
TRAIN_COUNT, EVAL_COUNT = 420, 200
TRAIN_SEED, EVAL_SEED = 0, 1
LOW, HIGH = 1, 10  # operands, both ends included: sums a 4-layer model can learn in a short SFT

NAMES = ("Ana", "Ben", "Dana", "Eli", "Hugo", "Ivy", "Kai", "Leo", "Maya", "Nora", "Omar", "Sam", "Tom", "Zoe")
# (singular, plural): an operand of 1 reads "1 apple"
OBJECTS = (
  ("apple", "apples"),
  ("book", "books"),
  ("coin", "coins"),
  ("marble", "marbles"),
  ("pencil", "pencils"),
  ("card", "cards"),
  ("shell", "shells"),
  ("stamp", "stamps"),
  ("cookie", "cookies"),
  ("ball", "balls"),
)
# (operator, question). {a} is the first operand with its noun ("7 apples"), {b} the second alone, {objs} the
# plural noun, {name} and {friend} two different people. Each template's text around the fields is unique, so a
# prompt names its template (problem_key).
TEMPLATES = (
  ("+", "{name} has {a} and buys {b} more. How many {objs} now?"),
  ("+", "{name} has {a} and gets {b} from {friend}. How many now?"),
  ("+", "A box holds {a}. {name} adds {b}. How many are in it now?"),
  ("+", "{name} found {a}, then {b} more. How many in all?"),
  ("-", "{name} has {a} and gives {b} to {friend}. How many are left?"),
  ("-", "A box holds {a}. {name} takes {b}. How many are left in it?"),
  ("-", "{name} had {a} and lost {b}. How many are left?"),
  ("-", "{name} has {a}. {friend} has {b} fewer. How many does {friend} have?"),
)
PROMPT = "Question: {}\nAnswer:"
# No leading space: a sentencepiece encoding of the completion alone adds its word-start marker itself, so prompt +
# completion ids read "Answer: 7 + 5 ..." with one space, as the model is then asked to continue.
COMPLETION = "{} {} {} = {}. The answer is {}."

Key = tuple[int, int, int]  # (template index, first operand, second operand)


def _counted(n: int, noun: tuple[str, str]) -> str:
  return f"{n} {noun[0] if n == 1 else noun[1]}"


def all_keys() -> list[Key]:
  """Every problem the templates can ask, in a fixed order: additions take any two operands, subtractions a
  second operand no larger than the first."""
  return [
    (t, a, b)
    for t, (op, _) in enumerate(TEMPLATES)
    for a in range(LOW, HIGH + 1)
    for b in range(LOW, HIGH + 1)
    if op == "+" or b <= a
  ]


def record(key: Key, name: str, friend: str, noun: tuple[str, str]) -> dict[str, str]:
  """The prompt, completion and answer of one problem."""
  template, a, b = key
  op, text = TEMPLATES[template]
  result = a + b if op == "+" else a - b
  question = text.format(name=name, friend=friend, a=_counted(a, noun), b=b, objs=noun[1])
  return {
    "prompt": PROMPT.format(question),
    "completion": COMPLETION.format(a, op, b, result, result),
    "answer": str(result),
  }


def problems(count: int, seed: int, exclude: set[Key] | None = None) -> list[dict[str, str]]:
  """`count` distinct problems (no two share a template and operands, so no two prompts are equal), drawn in an
  order fixed by `seed`, leaving out the keys in `exclude` (problem_key of another set's records)."""
  rng = random.Random(seed)
  keys = all_keys()
  rng.shuffle(keys)
  keys = [k for k in keys if not exclude or k not in exclude]
  if count > len(keys):
    raise ValueError(f"asked for {count} arithmetic problems; only {len(keys)} are left after the exclusions")
  out = []
  for key in keys[:count]:
    name, friend = rng.sample(NAMES, 2)
    out.append(record(key, name, friend, rng.choice(OBJECTS)))
  return out


def _template_pattern(text: str) -> re.Pattern[str]:
  fields = {"name": r"\w+", "friend": r"\w+", "objs": r"\w+", "a": r"(?P<a>[0-9]+) \w+", "b": r"(?P<b>[0-9]+)"}
  parts = re.split(r"(\{\w+\})", text)
  pattern = "".join(fields[p[1:-1]] if p.startswith("{") else re.escape(p) for p in parts)
  return re.compile(re.escape(PROMPT.split("{}")[0]) + pattern + re.escape(PROMPT.split("{}")[1]) + r"\Z")


_PATTERNS = tuple(_template_pattern(text) for _, text in TEMPLATES)


def problem_key(prompt: str) -> Key:
  """(template index, a, b) of a prompt this module wrote; ValueError for any other text."""
  for template, pattern in enumerate(_PATTERNS):
    match = pattern.match(prompt)
    if match:
      return template, int(match["a"]), int(match["b"])
  raise ValueError(f"not an arithmetic prompt: {prompt!r}")


def build() -> dict[str, list[dict[str, str]]]:
  """The shipped sets: file name -> records."""
  train = problems(TRAIN_COUNT, TRAIN_SEED)
  held_out = problems(EVAL_COUNT, EVAL_SEED, exclude={problem_key(r["prompt"]) for r in train})
  return {TRAIN_FILE: train, EVAL_FILE: held_out}


def to_jsonl(records: Iterable[dict[str, Any]]) -> str:
  # Compact separators: the train file stays under 300 KB.
  return "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in records)


# ---- reward functions: fn(prompts, completions, **columns) -> one float (or None: not scored) per completion ----

# An integer standing alone: an optional minus sign, then digits that are not part of a word ("x2", "2nd") or of a
# decimal ("2.5"). A minus sign right after a word character is an operator ("10-3" holds 10 and 3).
_INTEGER = re.compile(r"(?<![\w.])-?[0-9]+(?!\w|\.[0-9])")
_FINAL_SENTENCE = re.compile(r"(?:\A|\s)The answer is -?[0-9]+\.\Z")


def _text(completion: Any) -> str:
  """A completion's text: a string, or TRL's conversational form (a list of messages; the last one's content)."""
  if isinstance(completion, list):
    return str(completion[-1].get("content", "")) if completion else ""
  return completion


def last_integer(text: str) -> int | None:
  """The last integer standing alone in `text` (see _INTEGER), or None."""
  found = _INTEGER.findall(text)
  return int(found[-1]) if found else None


def exact_match(
  prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
  """1.0 where the completion's last integer equals int(answer), else 0.0 (also when it has no integer); None for a
  record without an answer (no `answer` column, or None or "" in it), which GRPO leaves out of the reward."""
  if answer is None:
    return [None] * len(completions)
  out: list[float | None] = []
  for completion, expected in zip(completions, answer, strict=True):
    if expected is None or expected == "":
      out.append(None)
      continue
    got = last_integer(_text(completion))
    out.append(1.0 if got is not None and got == int(str(expected).strip()) else 0.0)
  return out


def format_reward(prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
  """1.0 where the completion (stripped) ends with the sentence "The answer is <integer>." and nothing after it,
  else 0.0."""
  return [1.0 if _FINAL_SENTENCE.search(_text(c).strip()) else 0.0 for c in completions]


def run(argv: Sequence[str]) -> None:
  from MaxLite import cli

  parser = cli.FlagParser(__doc__, prog="python -m MaxLite.data.arithmetic")
  parser.add_argument("--out", default="assets/grpo", help="the directory the two JSONL files are written to")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  for name, records in build().items():
    path = os.path.join(args.out, name)
    with open(path, "w", encoding="utf-8") as f:
      f.write(to_jsonl(records))
    print(f"{path}: {len(records)} records")


def main(argv: Sequence[str] | None = None) -> int:
  from MaxLite import cli

  return cli.run(run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
  sys.exit(main())

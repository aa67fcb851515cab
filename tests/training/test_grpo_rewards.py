"""GRPO's shipped arithmetic task (its files are what the module builds; train and eval disjoint), its reward
functions on awkward completions, and loading and calling reward functions named in the config
(training/rewards.py): each malformed entry is one line naming it."""

import json
import math
import os
import sys

import numpy as np
import pytest
from support.config import REPO

from MaxLite.cli.errors import ConfigError
from MaxLite.data import arithmetic
from MaxLite.data.arithmetic import exact_match, format_reward, problem_key, problems
from MaxLite.data.tokenizer import load_tokenizer
from MaxLite.training import rewards

GRPO_DIR = os.path.join(REPO, "assets", "grpo")


def _shipped(name):
  with open(os.path.join(GRPO_DIR, name), encoding="utf-8") as f:
    return f.read()


def test_shipped_files_are_what_the_module_builds():
  built = arithmetic.build()
  assert sorted(built) == sorted([arithmetic.TRAIN_FILE, arithmetic.EVAL_FILE])
  for name, records in built.items():
    text = _shipped(name)
    assert text == arithmetic.to_jsonl(records), f"{name} drifted: rerun python -m MaxLite.data.arithmetic"
    assert len(text.encode()) < 300_000
  train, held_out = built[arithmetic.TRAIN_FILE], built[arithmetic.EVAL_FILE]
  assert (len(train), len(held_out)) == (420, 200)
  assert train == problems(420, seed=0)
  assert all(set(r) == {"prompt", "completion", "answer"} for r in train + held_out)


def test_train_and_eval_share_no_problem_and_no_prompt_repeats():
  built = arithmetic.build()
  train, held_out = built[arithmetic.TRAIN_FILE], built[arithmetic.EVAL_FILE]
  train_keys = {problem_key(r["prompt"]) for r in train}
  eval_keys = {problem_key(r["prompt"]) for r in held_out}
  assert len(train_keys) == 420 and len(eval_keys) == 200 and not train_keys & eval_keys
  assert len({r["prompt"] for r in train + held_out}) == 620
  # Every problem the templates can ask reads back as its own key, so the disjointness above is real.
  for key in arithmetic.all_keys():
    assert problem_key(arithmetic.record(key, "Ana", "Ben", ("apple", "apples"))["prompt"]) == key


def test_problems_are_deterministic_and_well_formed():
  assert problems(50, seed=3) == problems(50, seed=3)
  assert problems(50, seed=3) != problems(50, seed=4)
  for r in problems(300, seed=5):
    template, a, b = problem_key(r["prompt"])
    op = arithmetic.TEMPLATES[template][0]
    result = a + b if op == "+" else a - b
    assert 1 <= a <= 20 and 1 <= b <= 20 and result >= 0
    assert r["prompt"].startswith("Question: ") and r["prompt"].endswith("\nAnswer:")
    assert r["completion"] == f"{a} {op} {b} = {result}. The answer is {result}."
    assert r["answer"] == str(result)
  with pytest.raises(ValueError, match="only"):
    problems(len(arithmetic.all_keys()) + 1, seed=0)


def test_every_shipped_completion_earns_full_reward_and_a_wrong_number_none():
  files = (arithmetic.TRAIN_FILE, arithmetic.EVAL_FILE)
  records = [json.loads(line) for name in files for line in _shipped(name).splitlines()]
  prompts = [r["prompt"] for r in records]
  completions = [r["completion"] for r in records]
  answers = [r["answer"] for r in records]
  assert exact_match(prompts, completions, answer=answers) == [1.0] * len(records)
  assert format_reward(prompts, completions, answer=answers) == [1.0] * len(records)
  wrong = [c.replace(f"is {a}.", f"is {int(a) + 1}.") for c, a in zip(completions, answers)]
  assert exact_match(prompts, wrong, answer=answers) == [0.0] * len(records)
  assert format_reward(prompts, wrong) == [1.0] * len(records)  # the format holds; the number is wrong


@pytest.mark.parametrize(
  "completion, answer, expected",
  [
    (" 2 - 5 = -3. The answer is -3.", "-3", 1.0),  # a negative answer
    (" The answer is -3.", "3", 0.0),
    (" 10-3", "3", 1.0),  # a minus sign after a number is an operator
    ("The answer is 12!", "12", 1.0),  # punctuation after the number
    ("The answer is 12,", "12", 1.0),
    ("(12)", "12", 1.0),
    ("The answer is 12th", "12", 0.0),  # inside a word: not an integer
    ("x12 abc12def", "12", 0.0),
    ("The answer is 12.5.", "12", 0.0),  # a decimal is not an integer
    ("12 12 12", "12", 1.0),  # repeated numbers
    (" 7 + 5 = 12. The answer is 13.", "12", 0.0),  # the last integer counts, not the first right one
    (" 7 + 5 = 13. The answer is 12.", "12", 1.0),
    ("", "12", 0.0),  # empty completion
    ("no number here", "0", 0.0),
    ("The answer is 12.", 12, 1.0),  # an int in the answer column
    ("The answer is 12.", " 12 ", 1.0),
    ("The answer is ١٢.", "12", 0.0),  # only ASCII digits
  ],
)
def test_exact_match_awkward_completions(completion, answer, expected):
  assert exact_match(["p"], [completion], answer=[answer], other_column=["x"]) == [expected]


def test_exact_match_unscored_without_an_answer():
  assert exact_match(["p", "q"], ["The answer is 3.", "4"]) == [None, None]  # no answer column
  assert exact_match(["p", "q", "r"], ["3", "4", "5"], answer=[None, "4", ""]) == [None, 1.0, None]
  # TRL's conversational completions: the last message's content
  assert exact_match(["p"], [[{"role": "assistant", "content": "The answer is 4."}]], answer=["4"]) == [1.0]


@pytest.mark.parametrize(
  "completion, expected",
  [
    (" 7 + 5 = 12. The answer is 12.", 1.0),
    ("The answer is 12.", 1.0),
    ("The answer is -3.\n\n  ", 1.0),  # trailing whitespace is stripped
    ("The answer is 12. And more.", 0.0),  # text after the sentence
    ("The answer is 12", 0.0),  # no full stop
    ("The answer is twelve.", 0.0),
    ("The answer is 12.5.", 0.0),
    ("XThe answer is 12.", 0.0),  # not a sentence of its own
    ("the answer is 12.", 0.0),
    ("", 0.0),
  ],
)
def test_format_reward(completion, expected):
  assert format_reward(["p"], [completion], answer=["12"]) == [expected]


def test_records_round_trip_through_the_shipped_tokenizer_and_fit_the_lengths():
  tokenizer = load_tokenizer(f"{REPO}/assets/tokenizer/maxlite_sp8k.model", "sentencepiece")
  for r in problems(200, seed=7):
    for text, limit in ((r["prompt"], 40 - 1), (r["completion"], 24 - 1)):  # room for BOS / EOS
      ids = tokenizer.encode(text)
      assert tokenizer.decode(ids) == text and 0 not in ids and len(ids) <= limit  # 0: <unk>


# ---- rewards.py ----

REWARD_FILE = """
def always_half(prompts, completions, **kwargs):
  return [0.5] * len(completions)

def answer_only(prompts, completions, answer):
  return [float(a == "1") for a in answer]
"""


def test_load_module_and_file_entries(tmp_path, monkeypatch):
  path = tmp_path / "my_rewards.py"
  path.write_text(REWARD_FILE)
  monkeypatch.chdir(tmp_path)
  entries = [
    "MaxLite.data.arithmetic:exact_match",
    f"{path}:always_half",
    "my_rewards.py:always_half",  # relative to the working directory
    "./my_rewards.py:answer_only",
    "my_rewards:always_half",  # a module in the working directory, as `python -m` finds it
  ]
  functions = rewards.load(entries)
  assert functions[0] is exact_match
  assert functions[1] is functions[2]  # one file loads once
  assert [f.__name__ for f in functions] == ["exact_match", "always_half", "always_half", "answer_only", "always_half"]
  assert rewards.names(entries) == ["exact_match", "always_half", "always_half_2", "answer_only", "always_half_3"]
  assert str(tmp_path) not in sys.path
  assert rewards.names(["a:f", "b:f", "c:f_2", "d:f"]) == ["f", "f_3", "f_2", "f_4"]


@pytest.mark.parametrize(
  "entry, message",
  [
    ("foo.bar:baz", r"'foo\.bar:baz' does not import \(ModuleNotFoundError: No module named 'foo'\)"),
    ("MaxLite.data.arithmetic", r"'MaxLite\.data\.arithmetic' has no ':'"),
    ("MaxLite.data.arithmetic:", r"is not a Python name"),
    (":exact_match", r"names no module or file before the ':'"),
    ("MaxLite.data.arithmetic:nope", r"arithmetic has no attribute 'nope' \(its functions: .*exact_match"),
    ("MaxLite.data.arithmetic:TRAIN_COUNT", r"arithmetic:TRAIN_COUNT' is not callable \(a value of type int\)"),
    ("MaxLite.data.arithmetic:last_integer", r"cannot be called as fn\(prompts=\.\.\., completions=\.\.\."),
    ("missing_dir/r.py:f", r"'missing_dir/r\.py:f': no file .*missing_dir/r\.py"),
    ("", r"entry 0 is ''"),
  ],
)
def test_load_errors_are_one_line_naming_the_entry(entry, message):
  with pytest.raises(ConfigError, match=r"^reward_functions: .*" + message) as e:
    rewards.load([entry])
  assert "\n" not in str(e.value)


def test_load_errors_for_files_and_lists(tmp_path):
  broken = tmp_path / "broken.py"
  broken.write_text("def f(:\n")
  with pytest.raises(ConfigError, match=r"broken\.py:f' does not load \(SyntaxError") as e:
    rewards.load([f"{broken}:f"])
  assert "\n" not in str(e.value)
  good = tmp_path / "good.py"
  good.write_text(REWARD_FILE)
  with pytest.raises(ConfigError, match=r"good\.py:missing'.* has no attribute 'missing' \(its functions: always_half"):
    rewards.load([f"{good}:missing"])
  with pytest.raises(ConfigError, match="reward_functions is empty"):
    rewards.load([])
  with pytest.raises(ConfigError, match=r"entry 1 is 3"):
    rewards.load(["MaxLite.data.arithmetic:exact_match", 3])


def _none_for_odd(prompts, completions, **kwargs):
  return [None if i % 2 else 1.0 for i in range(len(completions))]


def _short(prompts, completions, **kwargs):
  return [1.0] * (len(completions) - 1)


def _text_reward(prompts, completions, **kwargs):
  return ["good"] * len(completions)


def _raises(prompts, completions, **kwargs):
  raise KeyError("answer")


def _named_columns(prompts, completions, answer):  # no **kwargs: gets only the columns it names
  return [float(len(a)) for a in answer]


def test_score():
  prompts, completions = ["p"] * 4, [" 1 + 1 = 2. The answer is 2.", "The answer is 3.", "2", ""]
  columns = {"answer": ["2", "2", None, "2"], "extra": [1, 2, 3, 4]}
  got = rewards.score([exact_match, format_reward, _none_for_odd], prompts, completions, columns)
  assert got.dtype == np.float32 and got.shape == (4, 3)
  np.testing.assert_array_equal(got[:, 0], [1.0, 0.0, np.nan, 0.0])
  np.testing.assert_array_equal(got[:, 1], [1.0, 1.0, 0.0, 0.0])
  assert [math.isnan(v) for v in got[:, 2]] == [False, True, False, True]
  named = rewards.score([_named_columns], ["p"], ["c"], {"answer": ["123"], "extra": [0]})
  np.testing.assert_array_equal(named, [[3.0]])
  assert rewards.score([exact_match], [], [], {"answer": []}).shape == (0, 1)


@pytest.mark.parametrize(
  "function, error, message",
  [
    (_short, ConfigError, r"^reward_functions: _short returned 1 rewards for 2 completions"),
    (_text_reward, ConfigError, r"^reward_functions: _text_reward returned 'good' \(str\) for completion 0"),
    (lambda prompts, completions, **k: 1.0, ConfigError, r"<lambda> returned a float; a reward function returns"),
    (lambda prompts, completions, **k: [math.inf, 0], ConfigError, r"returned inf for completion 0"),
    (_raises, RuntimeError, r"^reward function _raises failed: KeyError: 'answer'"),
  ],
)
def test_score_errors_name_the_function(function, error, message):
  with pytest.raises(error, match=message) as e:
    rewards.score([function], ["p", "q"], ["a", "b"], {"answer": ["1", "2"]})
  assert "\n" not in str(e.value)

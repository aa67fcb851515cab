"""The objectives are a registry: outside MaxLite/objectives/ and the registry (config/objectives.py) no code reads
which one runs (use_sft, use_dpo, dpo_algo, use_grpo); it asks the objective the config selects. Read from the
source, so a new `if config.use_dpo:` anywhere fails here with its file and line."""

from __future__ import annotations

import ast
import pathlib

import pytest
from support.config import REPO, make_config

from MaxLite.config import objectives

FLAGS = frozenset({"use_sft", "use_dpo", "use_grpo", "dpo_algo"})
PACKAGE = pathlib.Path(REPO, "MaxLite")
# The registry itself, the objectives, and config_keys.py (generated: each key's annotation, read by nothing).
ALLOWED = ("objectives/", "config/objectives.py", "config/config_keys.py")


def flag_reads(root: pathlib.Path) -> list[str]:
  """file:line: what, for every attribute, subscript or string naming an objective flag under root/MaxLite."""
  found = []
  for path in sorted((root / "MaxLite").rglob("*.py")):
    relative = path.relative_to(root / "MaxLite").as_posix()
    if relative.startswith(ALLOWED):
      continue
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      name = None
      if isinstance(node, ast.Attribute) and node.attr in FLAGS:
        name = node.attr
      elif isinstance(node, ast.Constant) and node.value in FLAGS:
        name = node.value
      if name:
        found.append(f"MaxLite/{relative}:{node.lineno}: reads {name}")
  return found


def test_no_code_outside_the_objectives_branches_on_which_one_runs():
  reads = flag_reads(pathlib.Path(REPO))
  assert not reads, "ask objectives.of(config) instead:\n" + "\n".join(reads)


def test_the_check_finds_a_flag_read(tmp_path):
  (tmp_path / "MaxLite" / "training").mkdir(parents=True)
  (tmp_path / "MaxLite" / "objectives").mkdir()
  (tmp_path / "MaxLite" / "training" / "step.py").write_text("def f(c, d):\n  return c.use_dpo or d['use_grpo']\n")
  (tmp_path / "MaxLite" / "objectives" / "dpo.py").write_text("def f(c):\n  return c.use_dpo\n")
  assert flag_reads(tmp_path) == [
    "MaxLite/training/step.py:2: reads use_dpo",
    "MaxLite/training/step.py:2: reads use_grpo",
  ]


@pytest.mark.parametrize(
  "keys, name",
  [
    ((), "pretraining"),
    (("use_sft=true", "train_data_columns=['prompt','completion']"), "sft"),
    (("use_dpo=true", "load_parameters_path=x"), "dpo"),
    (("use_dpo=true", "dpo_algo=orpo"), "orpo"),
    (("use_grpo=true",), "grpo"),
  ],
)
def test_each_flag_selects_its_objective(keys, name):
  data = () if name in ("pretraining", "grpo") else ("grain_file_type=jsonl", "grain_train_files=x.jsonl")
  config = make_config("dataset_type=grain", *data, *keys)
  assert config.objective == name
  assert objectives.of(config).name == name

"""The typed config schema (MaxLite/config/schema.py) is the one definition of every key: configs/base.yml must say
the same keys, defaults and descriptions, the closed sets of values must be choices.py's, the loader must type values
by it, and the config tools must describe keys from it."""

from __future__ import annotations

import re
import subprocess
import sys
import typing

import pytest
import yaml

from MaxLite import cli
from MaxLite.cli.errors import ConfigError
from MaxLite.config import choices, loader, schema

_KEY = re.compile(r"^([A-Za-z_]\w*):(.*)$")
_CONTINUATION = re.compile(r"^\s+#\s?(.*)$")


def base_yml_descriptions(text: str) -> dict[str, str]:
  """key -> its comment in base.yml: the text after ` #` on its line, joined with the indented comment lines below."""
  out: dict[str, str] = {}
  key = None
  for line in text.splitlines():
    match = _KEY.match(line)
    if match:
      key, rest = match.groups()
      out[key] = rest[rest.find(" #") + 2 :].strip() if " #" in rest else ""
    elif key is not None and _CONTINUATION.match(line):
      out[key] = f"{out[key]} {_CONTINUATION.match(line).group(1).strip()}".strip()
    else:
      key = None  # a block comment, a blank line or logical_axis_rules' rows end a key's comment
  return out


def drift(text: str) -> list[str]:
  """Every way base.yml's text differs from the schema, one line each."""
  values = yaml.safe_load(text)
  comments = base_yml_descriptions(text)
  problems = [f"{k}: in base.yml, not in the schema" for k in values if k not in schema.FIELDS]
  problems += [f"{k}: in the schema, not in base.yml" for k in schema.FIELDS if k not in values]
  for key, field in schema.FIELDS.items():
    if key not in values:
      continue
    if values[key] != field.default or type(values[key]) is not type(field.default):
      problems.append(f"{key}: base.yml's default {values[key]!r}, the schema's {field.default!r}")
    if comments.get(key) != field.description:
      problems.append(f"{key}: base.yml's description {comments.get(key)!r}, the schema's {field.description!r}")
  return problems


def test_base_yml_matches_the_schema():
  with open(loader.BASE_CONFIG_PATH, encoding="utf-8") as f:
    assert drift(f.read()) == []


@pytest.mark.parametrize(
  "edit, problem",
  [
    (("steps: 200 ", "steps: 201 "), "steps: base.yml's default 201, the schema's 200"),
    (("steps: 200 ", "steps: 200.0 "), "steps: base.yml's default 200.0"),
    (("# number of optimizer steps to train", "# optimizer steps"), "steps: base.yml's description 'optimizer steps'"),
    (("init_weights_seed: 0 ", "init_weight_seed: 0 "), "init_weight_seed: in base.yml, not in the schema"),
  ],
)
def test_a_base_yml_that_drifts_is_named(edit, problem):
  with open(loader.BASE_CONFIG_PATH, encoding="utf-8") as f:
    text = f.read()
  assert text.count(edit[0]) == 1
  assert any(p.startswith(problem) for p in drift(text.replace(*edit))), drift(text.replace(*edit))


def test_literals_are_the_choices_lists():
  expected = {
    "dtype": choices.DTYPES,
    "weight_dtype": choices.DTYPES,
    "rope_type": choices.ROPE_TYPES,
    "quantization": choices.QUANTIZATIONS,
    "remat_policy": choices.REMAT_POLICIES,
    "attention": choices.ATTENTION,
    "dataset_type": choices.DATASET_TYPES,
    "grain_file_type": choices.FILE_TYPES,
    "tokenizer_type": choices.TOKENIZER_TYPES,
    "lora_weight_qtype": choices.LORA_WEIGHT_QTYPES,
    "profiler": choices.PROFILERS,
    "decode_sampling_strategy": choices.DECODE_SAMPLING_STRATEGIES,
  } | {name: choices.PLACEMENTS for name in choices.REMAT_NAMES}
  assert {k: schema.allowed_values(k) for k in expected} == expected
  assert all(
    typing.get_origin(schema.FIELDS[k].annotation) is not typing.Literal for k in schema.FIELDS if k not in expected
  )


def test_every_key_has_a_group_type_and_description():
  assert set(schema.GROUP_OF) == set(schema.FIELDS)
  for key, field in schema.FIELDS.items():
    assert field.description, key
    assert schema.coerce(key, field.default, "test") == field.default, key


@pytest.mark.parametrize(
  "override, message",
  [
    ("train_data_columns=[1]", "config key 'train_data_columns' (from command line) expects list[str], got [1]"),
    ("ensemble_learning_rates=[fast]", "config key 'ensemble_learning_rates' (from command line) expects list[float]"),
    ("steps=2.5", "config key 'steps' (from command line) expects int, got 2.5"),
    ("add_bos=1", "config key 'add_bos' (from command line) expects bool, got 1"),
    ("query_proj=sometimes", "query_proj='sometimes' is not one of: 'remat', 'device', 'offload'"),
  ],
)
def test_overrides_are_typed_by_the_schema(override, message):
  with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
    loader.load_raw(["configs/base.yml", override])


def test_list_items_take_the_schema_type():
  raw = loader.load_raw(["configs/base.yml", "ensemble_learning_rates=[1e-3, 2]"])
  assert raw["ensemble_learning_rates"] == [0.001, 2.0]


def _tool(argv, capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.run_config_tool(lambda _: None, "Train.\n\nUsage: python MaxLite/train.py CONFIG.yml\n", argv, keys=schema)
  out = capsys.readouterr()
  return exit_.value.code, out.out, out.err


def test_describe_prints_type_default_allowed_and_description(capsys):
  code, out, _ = _tool(["train.py", "--describe", "dtype"], capsys)
  assert code == 0
  assert "type:        string" in out and "default:     'float32'" in out
  assert "allowed:     'float32' | 'bfloat16'" in out and "activation / compute dtype" in out
  code, out, _ = _tool(["train.py", "--describe=Checkpointing"], capsys)
  assert code == 0 and "  checkpoint_period (int, default 100): save after every N-th step" in out


def test_describe_of_an_unknown_key_is_one_line_with_the_closest(capsys):
  code, out, err = _tool(["train.py", "--describe", "ensemble_sise"], capsys)
  assert code == 2 and out == ""
  assert err == "error: unknown config key 'ensemble_sise'; closest: ensemble_size, ensemble_member, ensemble_data\n"


def test_help_lists_the_keys_by_concern(capsys):
  code, out, _ = _tool(["train.py", "--help"], capsys)
  assert code == 0 and out.startswith("Train.")
  assert "--describe KEY" in out
  listed = re.findall(r"\b\w+\b", out.split("Config keys by concern", 1)[1])
  assert set(schema.FIELDS) <= set(listed)
  assert "  Checkpointing: enable_checkpointing, async_checkpointing" in out


def test_maxlite_train_describe_runs_as_a_command():
  proc = subprocess.run(
    [sys.executable, "MaxLite/train.py", "--describe", "steps"], capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("steps (RunInfo)\n  type:        int\n  default:     200\n")

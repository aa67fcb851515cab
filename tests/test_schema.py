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
from MaxLite.config.keys_derived import Derived

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
    "synthetic_tokens": choices.SYNTHETIC_TOKENS,
    "grain_file_type": choices.FILE_TYPES,
    "tokenizer_type": choices.TOKENIZER_TYPES,
    "lora_weight_qtype": choices.LORA_WEIGHT_QTYPES,
    "ensemble_data": choices.ENSEMBLE_DATA,
    "profiler": choices.PROFILERS,
    "decode_sampling_strategy": choices.DECODE_SAMPLING_STRATEGIES,
    "loss_algo": choices.GRPO_LOSS_ALGOS,
    "loss_agg_mode": choices.GRPO_LOSS_AGG_MODES,
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
    ("train_data_columns=[[a]]", "config key 'train_data_columns' (from command line) expects list[str], got [['a']]"),
    ("ensemble_learning_rates=[fast]", "config key 'ensemble_learning_rates' (from command line) expects list[float]"),
    ("steps=2.5", "config key 'steps' (from command line) expects int, got 2.5"),
    ("add_bos=1", "config key 'add_bos' (from command line) expects bool, got '1'"),
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
  code, out, _ = _tool(["train.py", "--describe", "quantization"], capsys)
  assert code == 0 and "  not here:    Qwix's quantized training; int4 and MaxText's other modes" in out
  code, out, _ = _tool(["train.py", "--describe=Checkpointing"], capsys)
  assert code == 0 and "  checkpoint_period (int, default 100): save after every N-th step" in out


def test_describe_group_headers_are_whole_sentences(capsys):
  """Each group's header in `--describe all` (and `--describe GROUP`) is its docstring's first paragraph, whole: the
  first line of a wrapped docstring stopped Quantization, Remat, SplashAttention, Grpo and Mesh mid-sentence."""
  code, out, _ = _tool(["train.py", "--describe", "all"], capsys)
  assert code == 0
  headers = dict(line.split(": ", 1) for line in out.splitlines() if not line.startswith(" "))
  assert set(headers) == {g.__name__ for g in (*schema.GROUPS, Derived)}
  for name, header in headers.items():
    group = next(g for g in (*schema.GROUPS, Derived) if g.__name__ == name)
    paragraph = " ".join(group.__doc__.strip().split("\n\n")[0].split())
    assert header == paragraph and header.endswith("."), (name, header)
  assert headers["Mesh"].endswith('may hold one -1 = "the rest".')
  assert headers["Quantization"].endswith("everything stored in full precision.")
  code, out, _ = _tool(["train.py", "--describe", "Remat"], capsys)
  assert out.splitlines()[0].endswith("device (kept in HBM) or offload (host memory).")


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


# The derived keys: every key validate_and_derive adds is declared in schema.Derived, with its type.


@pytest.mark.parametrize(
  "argv, devices, platform",
  [
    (["configs/base.yml"], 1, "cpu"),
    (["configs/base.yml", "model_name=tiny-deepseek", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"], 8, "tpu"),
    (["configs/base.yml", "model_name=tiny-gemma3", "ensemble_size=2", "ensemble_data=distinct"], 2, "gpu"),
    (["configs/base.yml", "use_grpo=true", "num_generations=4", "per_device_batch_size=8"], 1, "cpu"),
  ],
)
def test_every_derived_key_is_declared_with_its_type(argv, devices, platform):
  import MaxLite.models  # noqa: F401  (registers the families whose parameter counts the derive step asks for)
  from MaxLite.config import validation

  derived = validation.validate_and_derive(
    loader.load_raw(argv), num_devices=devices, num_slices=1, process_count=1, platform=platform
  )
  assert schema.derived_problems(derived) == []
  assert set(derived) == set(schema.FIELDS) | set(schema.DERIVED)


def test_a_derived_key_the_schema_does_not_declare_is_named():
  derived = schema.defaults() | {"explicit_keys": []} | {k: None for k in schema.DERIVED if k != "explicit_keys"}
  derived |= {"global_batch": 8, "mesh_shape": [1.5], "attention_kernel": "flash"}
  problems = schema.derived_problems(derived)
  assert "global_batch: held by the config, declared nowhere in the schema" in problems
  assert any(p.startswith("mesh_shape.0: Input should be a valid integer") for p in problems), problems
  assert any(p.startswith("attention_kernel: Input should be 'dot_product', 'splash' or 'cudnn'") for p in problems)
  del derived["num_params"]
  assert "num_params: declared in Derived, not in the config" in schema.derived_problems(derived)


def test_describe_answers_for_a_derived_key():
  assert schema.describe("mesh_shape").startswith("mesh_shape (Derived)\n  type:        list[int]\n")
  assert "  global_batch_size_to_train_on (int): sequences one optimizer step sees" in schema.describe("Derived")


def test_decode_ranges_sit_beside_their_keys_as_a_model_validator():
  from MaxLite.config.keys_job import Decoding

  assert Decoding in schema.CHECKED_GROUPS
  values = {key: schema.FIELDS[key].default for key in Decoding.model_fields}
  Decoding.model_validate(values)
  with pytest.raises(ConfigError, match=r"^decode_seed must be in \[0, 2\*\*32\), got -1$"):
    Decoding.model_validate(values | {"decode_seed": -1})
  with pytest.raises(
    ConfigError, match="^decode_sampling_temperature must be in \\(0, inf\\) for decode_sampling_strat"
  ):
    schema.check_cross_keys(
      schema.defaults() | {"decode_sampling_strategy": "topk", "decode_sampling_temperature": 0.0}
    )


def test_numeric_bounds_sit_on_the_fields_and_are_checked_wherever_a_value_comes_from(tmp_path, capsys):
  """A key's bounds are its Field's (gt/ge/lt/le): every default lies inside them, --describe prints them, and a value
  outside them is one line whether it comes from the command line, a YAML file or code that builds a config dict."""
  assert schema.range_text("adam_b1") == "[0, 1)" and schema.range_text("steps") == "positive"
  assert schema.range_text("learning_rate_final_fraction") == "[0, 1]" and schema.range_text("seed") == "[0, 2**32)"
  assert schema.range_text("eval_interval") is None
  for key in schema.FIELDS:
    schema.check_range(key, schema.FIELDS[key].default)
  code, out, _ = _tool(["train.py", "--describe", "warmup_steps_fraction"], capsys)
  assert code == 0 and "  allowed:     [0, 1)\n" in out
  from MaxLite.config import validation

  (tmp_path / "base.yml").write_text(open("configs/base.yml").read())
  (tmp_path / "bad.yml").write_text("base_config: base.yml\nadam_b2: 1.0\n")
  with pytest.raises(ConfigError, match=r"^adam_b2 must be in \[0, 1\), got 1.0$"):
    loader.load_raw([str(tmp_path / "bad.yml")])
  raw = loader.load_raw(["configs/base.yml"]) | {"z_loss_multiplier": float("nan")}
  with pytest.raises(ConfigError, match=r"^z_loss_multiplier must be in \[0, inf\), got nan$"):
    validation.validate_and_derive(raw, num_devices=1, num_slices=1, process_count=1, platform="cpu")


def test_every_closed_key_is_checked_on_a_config_built_in_code():
  """A value set in code (the planner's candidates, a tool's own dict) skips the reading of files and overrides:
  validate_and_derive checks every key with a Literal against its values all the same."""
  from MaxLite.config import validation

  for key, value in (("quantization", "int4"), ("lora_weight_qtype", "fp4"), ("query_proj", "disk")):
    raw = loader.load_raw(["configs/base.yml"]) | {key: value}
    with pytest.raises(ConfigError, match=rf"^{key}='{value}' is not one of: ") as caught:
      validation.validate_and_derive(raw, num_devices=1, num_slices=1, process_count=1, platform="cpu")
    # the Field's note on unsupported values comes along on this path too
    assert ("int4 and MaxText's other modes are not supported" in str(caught.value)) == (key == "quantization")


# `config.key` is typed for editors: Config declares every key's type, and reads stay as they were.


def test_config_declares_every_key_with_the_type_it_reads_as():
  hints = typing.get_type_hints(loader.Config)
  declared = {k: f.annotation for k, f in schema.FIELDS.items()} | {k: f.return_type for k, f in schema.DERIVED.items()}
  for key, want in declared.items():
    if typing.get_origin(want) is list:  # a Config hands lists out as tuples
      want = tuple[typing.get_args(want)[0], ...]
    assert hints.get(key) == want, (key, hints.get(key), want)
  assert set(hints) == set(schema.FIELDS) | set(schema.DERIVED)
  with open(schema.CONFIG_KEYS_PATH, encoding="utf-8") as f:
    generated = f.read()
  # Text compared without the wrapping `ruff format` adds, so a regenerated file only differs where the schema did.
  squash = lambda text: re.sub(r"\s+|,(?=\s*\])", "", text).replace("'", '"')  # noqa: E731
  assert squash(generated) == squash(schema.config_keys_source()), "run schema.write_config_keys() and ruff format"


def test_config_reads_stay_attribute_reads_of_a_frozen_hashable_view():
  config = loader.Config({"steps": 3, "mesh_shape": [1, 2]})
  assert config.steps == 3 and config.mesh_shape == (1, 2) and "steps" in config and "seed" not in config
  assert "steps" not in vars(type(config)) and not hasattr(config, "seed")  # declared, not a class attribute
  with pytest.raises(AttributeError, match="config has no key 'seed'"):
    config.seed  # noqa: B018
  with pytest.raises(AttributeError, match="config is frozen"):
    config.steps = 4
  assert {config: 1}[config] == 1 and config.to_dict() == {"steps": 3, "mesh_shape": [1, 2]}


# The README's tables of keys say what the schema says.


def _table_cells(text: str) -> list[tuple[list[str], list[list[str]]]]:
  """Each Markdown table: its header cells and its rows' cells."""
  tables, lines = [], text.splitlines()
  for i, line in enumerate(lines[:-1]):
    if (
      line.startswith("|")
      and re.match(r"^\|(\s*:?-+:?\s*\|)+$", lines[i + 1])
      and not (i and lines[i - 1].startswith("|"))
    ):
      rows = []
      for row in lines[i + 2 :]:
        if not row.startswith("|"):
          break
        rows.append([c.strip() for c in row.strip("|").split("|")])
      tables.append(([c.strip() for c in line.strip("|").split("|")], rows))
  return tables


_KEY_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_KEY_COLUMNS = ("key", "keys", "asked by")
_STATED_DEFAULT = re.compile(r"`([a-z][a-z0-9_]*)` \(default (?:`([^`]+)`|(-?[0-9][0-9.e+-]*)(?=[,)]))")


def readme_key_problems(text: str) -> list[str]:
  """Every key a README table names that the schema lacks, every `key=value` there it cannot take and every default
  the README states that is not the schema's, one line each."""
  problems = []
  known = set(schema.FIELDS) | set(schema.DERIVED)
  for header, rows in _table_cells(text):
    for row in [header, *rows]:  # a header may name settings too
      for column, cell in zip(header, row):
        for span in re.findall(r"`([^`]+)`", cell):
          for token in span.split():
            key, eq, value = token.partition("=")
            if eq and _KEY_NAME.match(key) and token != "key=value":  # not the placeholder of `CONFIG.yml key=value`
              if key not in schema.FIELDS:
                problems.append(f"{key}: set in a README table ({token}), not a settable key of the schema")
                continue
              try:
                schema.coerce(key, value, "README.md")
              except ConfigError as e:
                problems.append(f"{key}: README table's {token}: {e}")
          first = span.split()[0]
          if column.lower() in _KEY_COLUMNS and _KEY_NAME.match(first) and first not in known:
            problems.append(f"{first}: in a README table's {column!r} column, not in the schema")
    if header[0].lower() == "value":  # a key's values, one a row: which key is the one whose values they all are
      values = [re.match(r"`([^`]+)`", row[0]).group(1) for row in rows if re.match(r"`([^`]+)`", row[0])]
      keys = [k for k in schema.FIELDS if set(values) <= set(schema.allowed_values(k) or ())]
      if len(keys) != 1:
        problems.append(f"README table of values {values}: the values of {keys or 'no key'}, not of exactly one")
        continue
      for row in rows:
        marked = re.match(r"`([^`]+)` \(default\)", row[0])
        if marked and marked.group(1) != schema.FIELDS[keys[0]].default:
          problems.append(
            f"{keys[0]}: README says default {marked.group(1)!r}, the schema's {schema.FIELDS[keys[0]].default!r}"
          )
  # Anywhere in the text, a default stated as a value (`key` (default `value`) or (default 512, ...)), not in words.
  for key, quoted, number in _STATED_DEFAULT.findall(text):
    if key not in schema.FIELDS:
      problems.append(f"{key}: README states its default, not a settable key of the schema")
    elif schema.coerce(key, quoted or number, "README.md") != schema.FIELDS[key].default:
      problems.append(f"{key}: README says default {quoted or number!r}, the schema's {schema.FIELDS[key].default!r}")
  return problems


def _readme() -> str:
  with open("README.md", encoding="utf-8") as f:
    return f.read()


def test_readme_tables_of_keys_match_the_schema():
  assert _table_cells(_readme()), "README.md has no tables"
  assert readme_key_problems(_readme()) == []


@pytest.mark.parametrize(
  "edit, problem",
  [
    (("| `autoselected` (default) |", "| `autoselected` |"), None),
    (("| `dot_product` | XLA", "| `dot_product` (default) | XLA"), "attention: README says default 'dot_product'"),
    (("| `ici_fsdp_parallelism` |", "| `ici_fsdp_parallelizm` |"), "ici_fsdp_parallelizm: in a README table's 'keys'"),
    (("activations | `dtype=float32`", "activations | `dtype=float31`"), "dtype: README table's dtype=float31: dtype="),
    (("`sa_block_kv_dq` (default 512,", "`sa_block_kv_dq` (default 256,"), "sa_block_kv_dq: README says default '256'"),
    (("`grain_text_column` (default `text`)", "`grain_text_column` (default `txt`)"), "grain_text_column: README says"),
    (("(`num_vocab_slices=1 ", "(`num_vocab_slice=1 "), "num_vocab_slice: set in a README table (num_vocab_slice=1)"),
    (("| `splash` (MaxText", "| `splish` (MaxText"), "README table of values ['autoselected', 'dot_product', 'splish'"),
  ],
)
def test_a_readme_table_that_drifts_is_named(edit, problem):
  text = _readme()
  assert text.count(edit[0]) == 1, edit[0]
  problems = readme_key_problems(text.replace(*edit))
  if problem is None:
    assert problems == []
  else:
    assert any(p.startswith(problem) for p in problems), problems

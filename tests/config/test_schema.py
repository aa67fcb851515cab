"""The typed config schema (MaxLite/config/schema.py) is the one definition of every key: configs/base.yml,
config_keys.py and the README's tables of keys are written from it (and fail here when stale), which keys a checkpoint
saves is each Field's marker, the closed sets of values must be choices.py's, the loader must type values by it, and
the config tools must describe keys from it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import typing

import pytest
import yaml

from MaxLite import cli
from MaxLite.cli.errors import ConfigError
from MaxLite.config import choices, generate, keys_model, loader, schema
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


# The files written from the schema: each is what `python -m MaxLite.config.generate` writes, or a test names it.


@pytest.mark.parametrize("path", [generate.BASE_YML_PATH, generate.CONFIG_KEYS_PATH, generate.README_PATH])
def test_every_file_written_from_the_schema_is_up_to_date(path):
  relative = os.path.relpath(path, generate.REPO)
  stale = generate.stale()
  assert relative not in stale, (
    f"{relative} is stale (the schema says otherwise): run `{generate.COMMAND}` to rewrite it\n{stale[relative]}"
  )


def test_a_changed_field_makes_every_written_file_stale(monkeypatch):
  """A description changed in its Field (the one place it is declared) shows in base.yml's comment, the README's
  table and, for a new key's type, config_keys.py; the check names each file with the command that rewrites it."""
  monkeypatch.setattr(schema.FIELDS["steps"], "description", "optimizer steps")
  stale = generate.stale()
  assert set(stale) == {"configs/base.yml", "README.md"}
  assert "+steps: 200                        # optimizer steps" in stale["configs/base.yml"]
  monkeypatch.setattr(schema.FIELDS["steps"], "annotation", float)
  assert "MaxLite/config/config_keys.py" in generate.stale()
  lines = []
  monkeypatch.setattr("builtins.print", lambda *a: lines.append(" ".join(map(str, a))))
  assert generate.main(["--check"]) == 1
  assert any(line.startswith(f"configs/base.yml is stale: run `{generate.COMMAND}`") for line in lines), lines


def test_written_base_yml_reads_back_as_the_defaults():
  """The YAML spellings the generator picks (quoted strings, 1.0e-5, multi-line lists with their notes) read back as
  each default with its type, by YAML and by the loader."""
  text = generate.base_yml()
  assert drift(text) == []
  assert loader.load_raw(["configs/base.yml"]) == schema.defaults() | {"explicit_keys": []}
  for value in (1e-05, 3e-3, 1e30, -2.5e-12, float("inf"), "3.10", "no", "", ["a", 1.0e-8], [["x", []]]):
    assert yaml.safe_load(f"k: {generate.yaml_value(value)}")["k"] == value, value


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_written_config_keys_is_as_ruff_formats_it():
  """config_keys.py needs no `ruff format` after it is written: a repository-wide format leaves it as written."""
  proc = subprocess.run(
    ["ruff", "format", "--stdin-filename", generate.CONFIG_KEYS_PATH, "-"],
    input=generate.config_keys(),
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout == generate.config_keys()


# Which keys a checkpoint saves is a marker on each Field (json_schema_extra "saved"), never a list kept by hand.


def model_groups() -> list[type]:
  """The groups that describe the network: keys_model.py's, a model family's own (declared under MaxLite.models), and
  any other group in which some key carries a checkpoint marker."""

  def marked(group: type) -> bool:
    return any("saved" in (f.json_schema_extra or {}) for f in group.model_fields.values())

  return [
    g
    for g in schema.GROUPS
    if g.__module__ == keys_model.__name__ or g.__module__.startswith("MaxLite.models") or marked(g)
  ]


def unmarked_keys(groups: list[type]) -> list[str]:
  """`Group.key` for each key of these groups whose Field does not say true or false to `saved`."""
  return [
    f"{group.__name__}.{key}"
    for group in groups
    for key, field in group.model_fields.items()
    if not isinstance(field.json_schema_extra, dict) or not isinstance(field.json_schema_extra.get("saved"), bool)
  ]


def test_every_model_key_says_whether_a_checkpoint_saves_it():
  """A new model key cannot be silently left out of the checkpoint: its Field must say saved (it changes the parameters
  or the function they compute) or not saved (how or at what precision it is computed, or how it is trained)."""
  groups = model_groups()
  assert {g.__name__ for g in groups} >= {"ModelArchitecture", "Rope", "Remat", "SplashAttention", "MlaAttention"}
  assert unmarked_keys(groups) == [], (
    'mark each with json_schema_extra={"saved": True} or {"saved": False} (keys_model.py says which)'
  )


def test_a_model_key_without_a_marker_is_named():
  from pydantic import BaseModel, Field

  class Family(BaseModel):
    sinks: bool = Field(False, description="a learned logit per head", json_schema_extra={"saved": True})
    sink_block: int = Field(128, description="a kernel's tile")
    sink_scale: float = Field(1.0, description="", json_schema_extra={"saved": "yes"})

  assert unmarked_keys([Family]) == ["Family.sink_block", "Family.sink_scale"]


def _another_value(key: str):
  """A value of the key's type other than its default (and inside its bounds): the next allowed value, the other
  boolean, the default moved by 2 or 0.5, a longer string or list."""
  default = schema.FIELDS[key].default
  allowed = schema.allowed_values(key)
  if allowed is not None:
    return next(v for v in allowed if v != default)
  if isinstance(default, bool):
    return not default
  if isinstance(default, (int, float)):
    return default + (2 if isinstance(default, int) else 0.5)
  if isinstance(default, str):
    return default + "_other"
  return [*default, "other"]


def test_model_keys_are_the_keys_marked_saved_and_a_checkpoint_gives_each_back(tmp_path):
  """loader.MODEL_KEYS is the Fields marked saved, and each of them, saved with a checkpoint, is what a run that loads
  it gets (unless set) and what a resume may not change."""
  from MaxLite.checkpoint import resume_checks

  marked = [k for g in schema.GROUPS for k in g.model_fields if (schema.FIELDS[k].json_schema_extra or {}).get("saved")]
  assert loader.MODEL_KEYS == schema.SAVED_KEYS == tuple(marked)
  assert {"decoder_block", "base_emb_dim", "vocab_size", "scan_layers", "rope_type", "num_experts"} <= set(marked)
  assert not {"dtype", "remat_policy", "attention", "sa_block_q", "num_vocab_tiling"} & set(marked)
  saved = {key: _another_value(key) for key in loader.MODEL_KEYS}
  step = tmp_path / "checkpoints" / "3"
  (step / "state").mkdir(parents=True)
  (step / "config").mkdir()
  (step / "config" / "config.json").write_text(json.dumps(saved))
  raw = loader.load_raw(["configs/base.yml", f"load_parameters_path={step}"])
  assert {key: raw[key] for key in saved} == saved
  assert loader.checkpoint_model_settings(str(step)) == saved
  differences = resume_checks.resume_differences(saved, schema.defaults())
  assert [d.split(" ", 1)[0] for d in differences if d.split(" ", 1)[0] in saved] == list(loader.MODEL_KEYS)


def test_the_loader_types_values_through_the_schema_alone():
  """The loader's own `coerce` (a second typing for keys the schema lacks, which every key is in) is gone."""
  import MaxLite.config as config_lib

  assert not hasattr(loader, "coerce") and "coerce" not in config_lib.__all__
  assert all(hasattr(loader, name) for name in config_lib.__all__)


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
    "context_parallel_strategy": choices.CONTEXT_PARALLEL_STRATEGIES,
    "context_parallel_reorder_strategy": choices.CONTEXT_REORDER_STRATEGIES,
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


def _cells(row: str) -> list[str]:
  """A table row's cells; `\\|` is a pipe inside a cell (the written tables of keys have many), not a separator."""
  return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


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
        rows.append(_cells(row))
      tables.append((_cells(line), rows))
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
    (
      ("| FSDP | `ici_fsdp_parallelism` |", "| FSDP | `ici_fsdp_parallelizm` |"),
      "ici_fsdp_parallelizm: in a README table",
    ),
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

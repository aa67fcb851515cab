"""Build the one validated, frozen config object from YAML files and key=value overrides.

Order of precedence (later wins): the `base_config:` chain, the YAML named on the command line,
`configs/models/<model_name>.yml`, then command-line overrides. Every key must be defined in the schema
(`schema.py`, from which configs/base.yml is written), which also gives its default and type and types every value.
Derived values (mesh shape, global batch, run directories, parameter count) are `keys_derived.Derived`'s computed
fields, added by `validation.py` after its checks, so the rest of MaxLite reads a single object and never recomputes
them.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import os
import sys
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import yaml
from absl import logging

from MaxLite import storage
from MaxLite.cli.errors import ConfigError
from MaxLite.config import maxtext_compat, schema, validation
from MaxLite.config.config_keys import ConfigKeys
from MaxLite.storage.layout import DATA_POSITIONS, newest_step, saved_config_path, step_dir_of, step_numbers

BASE_CONFIG_PATH = os.path.join(storage.configs_dir(), "base.yml")
MODELS_DIR = os.path.join(storage.configs_dir(), "models")


class Config(ConfigKeys):
  """Read-only attribute view over a dict of config values (lists become tuples). `ConfigKeys` only declares each
  key's type for editors and type checkers (its annotations create no attributes): every read comes here."""

  def __init__(self, values: Mapping[str, Any]):
    object.__setattr__(self, "_values", MappingProxyType({k: _freeze(v) for k, v in values.items()}))

  def __getattr__(self, name: str) -> Any:
    try:
      return self._values[name]
    except KeyError:
      raise AttributeError(f"config has no key {name!r}") from None

  def __setattr__(self, name: str, value: Any) -> None:
    raise AttributeError(f"config is frozen; cannot set {name!r}")

  def __contains__(self, name: str) -> bool:
    return name in self._values

  def to_dict(self) -> dict[str, Any]:
    return {k: _thaw(v) for k, v in self._values.items()}


def _freeze(value: Any) -> Any:
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  return value


def _thaw(value: Any) -> Any:
  if isinstance(value, tuple):
    return [_thaw(v) for v in value]
  return value


def _read_yaml(path: str) -> dict[str, Any]:
  if not os.path.isfile(path):
    raise ConfigError(f"config file not found: {path}")
  with open(path) as f:
    text = f.read()
  # A copy: the callers pop and update what they get. Parsing base.yml's 400 keys costs ~60 ms, which a program that
  # builds many configs (plan.py's search, an ensemble, the tests) paid on every build; reading it costs nothing.
  return copy.deepcopy(_parsed_yaml(path, text))


@functools.lru_cache(maxsize=64)
def _parsed_yaml(path: str, text: str) -> dict[str, Any]:
  try:
    data = yaml.load(text, Loader=schema.TextLoader) or {}  # scalars as written: the schema types them
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}" if mark else ""
    raise ConfigError(f"config file {path}{where} is not valid YAML: {getattr(e, 'problem', e)}") from None
  if not isinstance(data, dict):
    raise ConfigError(f"config file {path} must hold a mapping of key: value, got {type(data).__name__}")
  return data


def _read_with_inheritance(path: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
  path = os.path.abspath(path)
  if path in seen:
    raise ConfigError(f"base_config cycle: {' -> '.join(seen + (path,))}")
  data = _read_yaml(path)
  parent = data.pop("base_config", None)
  if parent is None:
    return data
  parent_path = parent if os.path.isabs(parent) else os.path.join(os.path.dirname(path), parent)
  shipped = os.path.join(storage.bundled_root(), parent)
  if not os.path.isfile(parent_path) and not os.path.isabs(parent) and os.path.isfile(shipped):
    # A shipped config by its path in the checkout (plan.py writes base_config: configs/base.yml), found from any
    # checkout or install; a file beside the YAML still wins.
    parent_path = shipped
  merged = _read_with_inheritance(parent_path, seen + (path,))
  merged.update(data)
  return merged


def _unknown_key_error(key: str, source: str, known: Sequence[str]) -> ConfigError:
  if key in maxtext_compat.unimplemented():
    return ConfigError(
      f"config key {key!r} ({source}) is a MaxText key that MaxLite does not implement; "
      "remove it (configs/base.yml lists every key MaxLite has)"
    )
  close = difflib.get_close_matches(key, known, n=1)
  hint = f"; did you mean {close[0]!r}?" if close else "; every key must be defined in configs/base.yml"
  return ConfigError(f"unknown config key {key!r} ({source}){hint}")


def _merge(
  config: dict[str, Any], updates: Mapping[str, Any], source: str, defaults: Mapping[str, Any]
) -> dict[str, Any]:
  """Set `updates` on `config`, each typed by its key; returns the typed updates."""
  typed = {}
  for key, value in updates.items():
    if key not in defaults:
      raise _unknown_key_error(key, source, list(defaults))
    config[key] = typed[key] = schema.coerce(key, value, source)
  return typed


def _canonical(updates: Mapping[str, Any], source: str) -> dict[str, Any]:
  """Old MaxLite key names -> MaxText's, with a one-line deprecation warning each; MaxText's `rl:` group flattened."""
  out = {}
  for key, value in maxtext_compat.flatten_nested(dict(updates), source).items():
    new = maxtext_compat.RENAMED.get(key)
    if new is not None:
      print(
        f"warning: config key {key!r} ({source}) is deprecated; use MaxText's name {new!r} "
        "(the old name will be removed in the next release)",
        file=sys.stderr,
      )
      key = new
    new_value = maxtext_compat.RENAMED_VALUES.get(key, {}).get(value) if isinstance(value, str) else None
    if new_value is not None:
      print(
        f"warning: {key}={value!r} ({source}) is deprecated; use MaxText's value {new_value!r} "
        "(the old value will be removed in the next release)",
        file=sys.stderr,
      )
      value = new_value
    out[key] = value
  return out


def parse_overrides(overrides: Sequence[str]) -> dict[str, str | None]:
  """key=value arguments as {key: text}; YAML's null (`key=null`, `key=~`) is None, as it is in a file."""
  parsed: dict[str, str | None] = {}
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"command-line argument {item!r} is not key=value")
    key, value = item.split("=", 1)
    parsed[key.strip()] = None if value.strip() in schema.NULL_TEXTS else value
  return parsed


def available_models() -> list[str]:
  return sorted(f[: -len(".yml")] for f in os.listdir(MODELS_DIR) if f.endswith(".yml"))


def load_raw(argv: Sequence[str], *, resuming: bool = False) -> dict[str, Any]:
  """Merge YAML files, the model overlay and overrides into a typed dict (no derived values). `resuming` (a training
  run, which resumes its run_name's newest checkpoint) takes the model from that checkpoint."""
  if not argv:
    # Not a tool's name: decode, plan and launch_local come here too (each config tool prints its own usage first).
    raise ConfigError("no config file: the arguments are CONFIG.yml [key=value ...]")
  config_path = argv[0]
  if "=" in config_path:
    raise ConfigError(f"first argument must be a YAML config file, got {config_path!r}")
  # A shipped config (configs/base.yml) is found by its relative name outside a checkout too, as shipped assets are;
  # a file of that name under the working directory still wins.
  config_path = storage.resolve(config_path)
  overrides = _canonical(parse_overrides(argv[1:]), "from command line")
  defaults = schema.defaults()
  config = schema.defaults()
  from_file = _canonical(_read_with_inheritance(config_path), f"from {config_path}")
  typed_from_file = _merge(config, from_file, f"from {config_path}", defaults)

  model_name = schema.coerce("model_name", overrides.get("model_name", config["model_name"]), "model_name")
  if model_name != "default":
    model_path = os.path.join(MODELS_DIR, f"{model_name}.yml")
    if not os.path.isfile(model_path):
      raise ConfigError(f"unknown model_name {model_name!r}; available: default, {', '.join(available_models())}")
    _merge(config, _read_yaml(model_path), f"from {model_path}", defaults)
  _merge(config, overrides, "from command line", defaults)
  # Where each explicitly set key was set, for errors. A YAML chain ends in base.yml itself, so only its values that
  # differ from base.yml count as set.
  explicit = {k: f"in {config_path}" for k, v in typed_from_file.items() if defaults.get(k) != v}
  if model_name != "default":
    explicit |= {k: f"by model_name={model_name}" for k in _read_yaml(os.path.join(MODELS_DIR, f"{model_name}.yml"))}
  explicit |= {k: "on the command line" for k in overrides}
  if "grain_train_files" in explicit and "grain_eval_files" not in explicit and config["grain_eval_files"]:
    # The default eval files are the shipped corpus's: beside the user's own training data they would measure
    # something else (and, in another file type, not even load). No eval data until the user names some.
    logging.info("no eval data: grain_train_files is set and grain_eval_files is not (set it to evaluate)")
    config["grain_eval_files"] = ""
  for key in ("load_parameters_path", "load_full_state_path"):
    step = newest_step(config[key])
    if step != config[key]:
      logging.info("%s=%s: its newest complete step, %s", key, config[key], step)
      config[key] = step
  _take_model_from_checkpoint(config, explicit, _resumed_step(config) if resuming else None)
  # A default that follows something else (add_bos follows whether the tokenizer has a BOS) warns only about a value
  # somebody chose, so the Config says which keys those are.
  config["explicit_keys"] = sorted(explicit)
  return config


# The keys that define the network's shapes, math and parameter layout: a checkpoint carries them, so loading one
# needs no model arguments. Each is its Field's `saved` marker (keys_model.py says which keys carry one), never a list
# kept by hand: a key left out here would be silently absent from a converted checkpoint's config.
MODEL_KEYS: tuple[str, ...] = schema.SAVED_KEYS


def checkpoint_model_settings(path: str) -> dict[str, Any] | None:
  """The model keys stored with a checkpoint step (…/<step> or …/<step>/state), if it has them."""
  saved = saved_config_path(step_dir_of(path))
  if not storage.isfile(saved):
    return None
  stored = json.loads(storage.read_text(saved))
  return {k: stored[k] for k in MODEL_KEYS if k in stored}


def _resumed_step(config: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
  """(directory, saved config) of the newest step a training run of this run_name resumes; None for a new run."""
  if not (config["enable_checkpointing"] and config["run_name"]):
    return None
  run_dir = storage.join(storage.absolute(config["base_output_directory"]), config["run_name"])
  # Emergency checkpoints keep each step's config beside its data positions, local steps' too.
  folder = storage.join(run_dir, DATA_POSITIONS if config["enable_emergency_checkpoint"] else "checkpoints")
  try:
    steps = step_numbers(folder)
  except Exception:  # an unreachable bucket: the run's bucket check names it next
    return None
  for step in reversed(steps):
    step_dir = storage.join(folder, str(step))
    try:
      stored = json.loads(storage.read_text(saved_config_path(step_dir)))
    except Exception:  # no config, or a corrupt one: the resume skips (or reports) that step itself
      continue
    if isinstance(stored, dict):
      return step_dir, stored
  return None


def _take_model_from_checkpoint(
  config: dict[str, Any],
  explicit: Mapping[str, str],
  resumed: tuple[str, dict[str, Any]] | None,
) -> None:
  """Model keys nobody set explicitly come from the checkpoint being resumed (`resumed`) or loaded. Explicit ones
  win over a loaded checkpoint (a real mismatch is then named by its shape check); a resumed run keeps its model, so
  there an explicit key that differs is an error naming it."""
  if resumed is not None:
    path, stored = resumed
  else:
    path = config["load_parameters_path"] or config["load_full_state_path"]
    if not path or not storage.isfile(saved_config_path(step_dir_of(path))):
      return
    stored = json.loads(storage.read_text(saved_config_path(step_dir_of(path))))
  taken, conflicts = [], []
  for key in ("model_name", *MODEL_KEYS):
    if key not in stored:  # converted checkpoints name no model_name; older ones may lack newer keys
      continue
    saved = schema.coerce(key, stored[key], f"from the checkpoint {path}")
    if key not in explicit:
      if config[key] != saved:
        taken.append(f"{key}={saved}")
      config[key] = saved
    elif config[key] != saved and resumed is not None:
      conflicts.append((key, saved))
    elif config[key] != saved and key not in ("scan_layers", "model_name"):
      # Legitimate (a longer context by a new rope_max_timescale / rope_factor), but never silent.
      logging.warning("%s=%s overrides the value %s of the checkpoint %s", key, config[key], saved, path)
  if conflicts:
    given = ", ".join(f"{k}={config[k]} (set {explicit[k]})" for k, _ in conflicts)
    held = ", ".join(f"{k}={v}" for k, v in conflicts)
    raise ConfigError(
      f"run_name={config['run_name']} resumes the checkpoint {path}, whose model has {held}, but {given}; a resumed "
      "run keeps its model: drop those settings (the model then comes from the checkpoint) or use a new run_name"
    )
  if taken:
    logging.info(
      "model from the checkpoint %s: %s (keys the command line and config file leave unset)", path, ", ".join(taken)
    )


def build(
  raw: dict[str, Any],
  *,
  num_devices: int | None = None,
  num_slices: int | None = None,
  process_count: int | None = None,
  platform: str | None = None,
) -> Config:
  """The validated, frozen config from `load_raw`'s keys: the one way every command makes its Config. Device
  counts and platform default to what JAX sees (compile-only tools pass the target's)."""
  return Config(
    validation.validate_and_derive(
      raw, num_devices=num_devices, num_slices=num_slices, process_count=process_count, platform=platform
    )
  )


def load_config(
  argv: Sequence[str],
  *,
  num_devices: int | None = None,
  num_slices: int | None = None,
  process_count: int | None = None,
) -> Config:
  """load_raw + build: the validated, frozen config of a command line."""
  return build(load_raw(argv), num_devices=num_devices, num_slices=num_slices, process_count=process_count)

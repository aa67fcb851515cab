"""The one definition of every config key: its name, type, default, allowed values and one-line description.

The keys are pydantic models grouped by concern (as MaxText's configs/types.py), in `keys_model.py` and
`keys_run.py`; `MaxLiteConfig` composes them. The loader takes each key's default and type from here and checks every
value a YAML file or a `key=value` sets through `coerce`; `--help` and `--describe KEY` read the descriptions;
configs/base.yml must say the same (tests/test_schema.py). Nothing here imports jax, so a tool's `--describe` and
a config's type errors come before any runtime starts.
"""

from __future__ import annotations

import copy
import difflib
import functools
import textwrap
import typing
from typing import Any

import pydantic
import yaml
from pydantic import ConfigDict
from pydantic.fields import FieldInfo

from MaxLite.cli.errors import ConfigError
from MaxLite.config.keys_model import (
  DataTypes,
  DeepSeekMoE,
  Gemma,
  MemoryLayout,
  MlaAttention,
  ModelArchitecture,
  MoEGeneral,
  Quantization,
  Remat,
  Rope,
  SplashAttention,
)
from MaxLite.config.keys_run import (
  Checkpointing,
  Compilation,
  Dataset,
  Decoding,
  Distributed,
  Ensemble,
  Lora,
  Mesh,
  Metrics,
  Optimizer,
  Planning,
  PostTraining,
  RunInfo,
)

# In the order --help lists them: the run, the model, then training, data, parallelism and the tools.
GROUPS: tuple[type[pydantic.BaseModel], ...] = (
  RunInfo,
  ModelArchitecture,
  Rope,
  Gemma,
  DataTypes,
  Quantization,
  Remat,
  SplashAttention,
  MemoryLayout,
  MoEGeneral,
  DeepSeekMoE,
  MlaAttention,
  Optimizer,
  Ensemble,
  Dataset,
  PostTraining,
  Lora,
  Mesh,
  Metrics,
  Checkpointing,
  Compilation,
  Planning,
  Decoding,
  Distributed,
)


class MaxLiteConfig(*GROUPS):
  """Every settable key. Derived values (mesh shape, global batch, run directories) are added by validation.py."""

  model_config = ConfigDict(extra="forbid", frozen=True)


FIELDS: dict[str, FieldInfo] = dict(MaxLiteConfig.model_fields)
GROUP_OF: dict[str, type[pydantic.BaseModel]] = {key: group for group in GROUPS for key in group.model_fields}
_BASE_TYPES = (bool, int, float, str, list)


def defaults() -> dict[str, Any]:
  """Each key's default (a fresh copy: callers may change the lists)."""
  return {key: copy.deepcopy(field.default) for key, field in FIELDS.items()}


def allowed_values(key: str) -> tuple[Any, ...] | None:
  """The closed set of values a key takes (its Literal), or None where any value of its type goes."""
  annotation = FIELDS[key].annotation
  return typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None


def base_type(key: str) -> type:
  """bool, int, float, str or list: what a YAML or command-line value is converted to before the full check."""
  annotation = FIELDS[key].annotation
  choices = allowed_values(key)
  if choices is not None:
    return type(choices[0])
  origin = typing.get_origin(annotation) or annotation
  assert origin in _BASE_TYPES, f"{key}: {annotation} is not one of the config value types"
  return origin


def type_name(key: str) -> str:
  """The key's type as errors and --describe spell it."""
  annotation = FIELDS[key].annotation
  if typing.get_origin(annotation) is list:
    return repr(annotation).replace("typing.", "")
  return {str: "string"}.get(base_type(key), base_type(key).__name__)


@functools.cache
def _adapter(key: str) -> pydantic.TypeAdapter:
  return pydantic.TypeAdapter(FIELDS[key].annotation)


def coerce(key: str, value: Any, source: str) -> Any:
  """`value` (from a YAML file, a command line or a checkpoint's saved config) as the key's type, or one ConfigError
  line naming the key, where it was set and what it takes."""
  want = base_type(key)
  if isinstance(value, str) and want in (int, float):
    for parse in (int, float):  # YAML 1.1 reads "1e-4" as a string; Python does not
      try:
        value = parse(value)
        break
      except ValueError:
        pass
  if isinstance(value, str) and want is not str:
    try:
      value = yaml.safe_load(value) if value.strip() else value
    except yaml.YAMLError:
      pass
  bad = ConfigError(f"config key {key!r} ({source}) expects {type_name(key)}, got {value!r}")
  # Deliberately stricter than pydantic's lax mode: 1 is not a bool, 2.5 is not an int, true is not a string.
  if want is bool:
    if not isinstance(value, bool):
      raise bad
  elif want is int:
    if isinstance(value, float) and value.is_integer():
      value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
      raise bad
  elif want is float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
      raise bad
    value = float(value)
  elif want is str:
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
      raise bad
    value = str(value)
  elif want is list:
    if not isinstance(value, (list, tuple)):
      raise bad
    value = list(value)
  choices = allowed_values(key)
  if choices is not None and value not in choices:
    raise ConfigError(f"{key}={value!r} is not one of: {', '.join(repr(x) for x in choices)}")
  try:
    return _adapter(key).validate_python(value)  # list items: list[str], list[float] ("1e-3" becomes 0.001)
  except pydantic.ValidationError:
    raise bad from None


def closest_keys(name: str, n: int = 3) -> list[str]:
  return difflib.get_close_matches(name, list(FIELDS), n=n, cutoff=0.5)


def describe_key(key: str) -> str:
  """Type, default, allowed values and description of one key, a few lines."""
  field = FIELDS[key]
  lines = [f"{key} ({GROUP_OF[key].__name__})", f"  type:        {type_name(key)}", f"  default:     {field.default!r}"]
  choices = allowed_values(key)
  if choices is not None:
    wrapped = textwrap.wrap(" | ".join(repr(x) for x in choices), 104, break_on_hyphens=False)
    lines.append("  allowed:     " + "\n               ".join(wrapped))
  wrapped = textwrap.wrap(field.description or "", 104)
  lines.append("  description: " + "\n               ".join(wrapped))
  return "\n".join(lines)


def describe(name: str) -> str:
  """--describe's answer: one key; a group of keys by its name (e.g. Checkpointing), each key's line; or `all`."""
  if name in FIELDS:
    return describe_key(name)
  groups = {g.__name__.lower(): g for g in GROUPS}
  chosen = list(GROUPS) if name.lower() == "all" else [groups[name.lower()]] if name.lower() in groups else []
  if not chosen:
    close = closest_keys(name) or difflib.get_close_matches(name, [g.__name__ for g in GROUPS], n=3, cutoff=0.5)
    hint = f"; closest: {', '.join(close)}" if close else "; a group name (e.g. Checkpointing) or `all` lists several"
    raise ConfigError(f"unknown config key {name!r}{hint}")
  out = []
  for group in chosen:
    out.append(f"{group.__name__}: {group.__doc__.strip().splitlines()[0]}")
    out += [
      f"  {key} ({type_name(key)}, default {f.default!r}): {f.description}" for key, f in group.model_fields.items()
    ]
  return "\n".join(out)


def keys_help(program: str) -> str:
  """The keys by concern, names only, for a tool's --help: with descriptions the list would be 250 lines and bury
  the usage; --describe gives them."""
  lines = [
    "",
    f"Config keys by concern (`{program} --describe KEY` for a key's type, default, allowed values and description;",
    "`--describe GROUP` for a group's keys with their descriptions, `--describe all` for every key):",
  ]
  for group in GROUPS:
    text = f"{group.__name__}: {', '.join(group.model_fields)}"
    lines += textwrap.wrap(text, 118, initial_indent="  ", subsequent_indent="    ")
  return "\n".join(lines)

"""The one definition of every config key: its name, type, default, allowed values, one-line description and whether a
checkpoint saves it.

The keys are pydantic models grouped by concern (as MaxText's configs/types.py), in `keys_model.py`, `keys_train.py`
and `keys_job.py`, and the groups a capability declares beside its code (`key_groups.py`, e.g. each objective's);
`MaxLiteConfig` composes them. The loader takes each key's default and type (and bounds) from here and checks every
value a YAML file or a `key=value` sets through `coerce`; `--help` and `--describe KEY` read the descriptions. The keys
nobody sets (mesh shape, global batch, run directories, ...) are the computed fields of `keys_derived.py`'s `Derived`,
so every key a Config holds is named, typed and described here. configs/base.yml, `config_keys.py` (every key as an
annotation of `Config`, for editors and type checkers) and the README's tables of keys are written from this schema by
`python -m MaxLite.config.generate`, and tests/config/test_schema.py fails when one is stale. Which keys a checkpoint
saves (`SAVED_KEYS`, the loader's MODEL_KEYS) is each Field's `saved` marker. Nothing here imports jax, so a tool's
`--describe` and a config's type errors come before any runtime starts.
"""

from __future__ import annotations

import copy
import difflib
import functools
import math
import re
import textwrap
import typing
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import pydantic
import yaml
from pydantic import ConfigDict
from pydantic.fields import ComputedFieldInfo, FieldInfo

from MaxLite.cli.errors import ConfigError
from MaxLite.config import key_groups
from MaxLite.config.keys_derived import Derived
from MaxLite.config.keys_job import Checkpointing, Compilation, Decoding, Distributed, Mesh, Metrics, Planning
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
from MaxLite.config.keys_train import Dataset, Ensemble, Lora, Optimizer, PostTraining, RunInfo

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
  # The objectives' and families' own groups (config/key_groups.py), after the training keys.
  *key_groups.groups(),
  Mesh,
  Metrics,
  Checkpointing,
  Compilation,
  Planning,
  Decoding,
  Distributed,
)


class MaxLiteConfig(*GROUPS):
  """Every settable key. Derived values (mesh shape, global batch, run directories) are `Derived`'s computed fields,
  added by validation.py."""

  model_config = ConfigDict(extra="forbid", frozen=True)


FIELDS: dict[str, FieldInfo] = dict(MaxLiteConfig.model_fields)
GROUP_OF: dict[str, type[pydantic.BaseModel]] = {key: group for group in GROUPS for key in group.model_fields}
DERIVED: dict[str, ComputedFieldInfo] = dict(Derived.model_computed_fields)
assert not set(DERIVED) & set(FIELDS), "a derived key is settable too: declare it in one group"
_BASE_TYPES = (bool, int, float, str, list)


def defaults() -> dict[str, Any]:
  """Each key's default (a fresh copy: callers may change the lists)."""
  return {key: copy.deepcopy(field.default) for key, field in FIELDS.items()}


@functools.cache  # the schema is fixed: validation asks for every key's set each time a config is built
def allowed_values(key: str) -> tuple[Any, ...] | None:
  """The closed set of values a key takes (its Literal), or None where any value of its type goes."""
  annotation = FIELDS[key].annotation
  return typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None


@functools.cache
def closed_sets() -> Mapping[str, tuple[Any, ...]]:
  """{key: its closed set} for every key with a Literal."""
  return MappingProxyType({key: values for key in FIELDS if (values := allowed_values(key)) is not None})


def _extra(key: str) -> dict[str, Any]:
  """The Field's json_schema_extra: MaxLite's notes on a key beyond pydantic's (`unsupported`, `saved`)."""
  extra = FIELDS[key].json_schema_extra if key in FIELDS else None
  return extra if isinstance(extra, dict) else {}


def unsupported_note(key: str) -> str | None:
  return _extra(key).get("unsupported")


def saved(key: str) -> bool | None:
  """The Field's checkpoint marker (keys_model.py says what it means): True = a checkpoint saves the key and a run
  that loads or resumes one takes it from there; False = a run chooses it anew; None = the Field says neither."""
  return _extra(key).get("saved")


# The keys a checkpoint saves: the Fields marked saved, by group as --help lists them (the loader's MODEL_KEYS).
SAVED_KEYS: tuple[str, ...] = tuple(key for group in GROUPS for key in group.model_fields if saved(key))


def not_one_of(key: str, value: Any, choices: Sequence[Any]) -> ConfigError:
  """The one line for a value outside a closed set, with the Field's `unsupported` note (json_schema_extra) when it
  has one: what the user probably meant and why MaxLite has no such value."""
  note = unsupported_note(key)
  return ConfigError(
    f"{key}={value!r} is not one of: {', '.join(repr(x) for x in choices)}" + (f" ({note})" if note else "")
  )


@functools.cache
def value_range(key: str) -> tuple[float, float, bool, bool] | None:
  """(low, high, low included, high included) of a numeric key whose Field declares bounds (gt/ge/lt/le), else None;
  a missing bound is -inf or inf, excluded."""
  bounds = {
    name: getattr(m, name) for m in FIELDS[key].metadata for name in ("gt", "ge", "lt", "le") if hasattr(m, name)
  }
  if not bounds:
    return None
  low, low_in = (bounds["ge"], True) if "ge" in bounds else (bounds.get("gt", -math.inf), False)
  high, high_in = (bounds["le"], True) if "le" in bounds else (bounds.get("lt", math.inf), False)
  return low, high, low_in, high_in


_BOUNDED = tuple(key for key in FIELDS if value_range(key) is not None)


def _bound_text(bound: float) -> str:
  """A bound as written: 2**32 for a large power of two (a seed's limit), else the number."""
  if isinstance(bound, int) and bound >= 2**16 and bound & (bound - 1) == 0:
    return f"2**{bound.bit_length() - 1}"
  return f"{bound:g}"


def range_text(key: str) -> str | None:
  """The key's bounds as an interval, "(0, inf)", "[0, 1)", "[0, 2**32)"; "positive" for a count (an int key above
  0)."""
  bounds = value_range(key)
  if bounds is None:
    return None
  low, high, low_in, high_in = bounds
  if (low, low_in, high) == (0, False, math.inf) and base_type(key) is int:
    return "positive"
  return f"{'[' if low_in else '('}{_bound_text(low)}, {_bound_text(high)}{']' if high_in else ')'}"


def check_range(key: str, value: Any, written: str | None = None) -> None:
  """One ConfigError line when a numeric key's value is outside its declared bounds (NaN is outside every one);
  `written` is the value as the user wrote it (1e30 rather than its 31 digits), when it came as text."""
  bounds = value_range(key)
  if bounds is None:
    return
  low, high, low_in, high_in = bounds
  above = value >= low if low_in else value > low
  below = value <= high if high_in else value < high
  if not (above and below):
    shown = range_text(key)
    # An int written as 1e30 is shown so, not as its 31 digits; every other value as it was read (0 -> 0.0).
    got = written if written is not None and isinstance(value, int) and len(str(value)) > len(written) + 3 else value
    raise ConfigError(f"{key} must be {shown if shown == 'positive' else 'in ' + shown}, got {got}")


def check_ranges(config: Mapping[str, Any]) -> None:
  """check_range on every bounded key of a merged config (defaults and values set in code included)."""
  for key in _BOUNDED:
    check_range(key, config[key])


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


class TextLoader(yaml.SafeLoader):
  """YAML as config files and `key=value` lists are read: every plain scalar stays the text as written, except YAML's
  null (`null`, `~`, nothing) and `<<` merges. YAML 1.1 would read `run_name: 2024_01_15` as 20240115, `12:30` as 750,
  `010` as 8 and `prompt: 3.10` as 3.1; `coerce` types each value from its key instead (text for a string key,
  decimal numbers for a number key)."""


TextLoader.yaml_implicit_resolvers = {
  first: kept
  for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
  if (kept := [(tag, regexp) for tag, regexp in resolvers if tag.endswith((":null", ":merge"))])
}


# How YAML writes null: on the command line `key=null` means the same as in a file (never the text "null").
NULL_TEXTS = frozenset({"null", "Null", "NULL", "~"})
_BOOL_TEXTS = {
  **dict.fromkeys(("true", "True", "TRUE", "yes", "Yes", "YES", "on", "On", "ON"), True),
  **dict.fromkeys(("false", "False", "FALSE", "no", "No", "NO", "off", "Off", "OFF"), False),
}
_NOT_DECIMAL = {
  "hexadecimal": re.compile(r"[-+]?0[xX]"),
  "octal": re.compile(r"[-+]?0[oO]"),
  "binary": re.compile(r"[-+]?0[bB]"),
  "a leading 0 (octal in YAML 1.1)": re.compile(r"[-+]?0[0-9_]+$"),
  "base 60 (YAML 1.1's h:m:s)": re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?$"),
}
_YAML_SPECIAL_FLOATS = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}


def _number(key: str, text: str, source: str) -> int | float | str:
  """A number key's text as the number it writes in decimal (1000, 1_000, -3, 2.5, 1e-4, 3E5, inf, nan), else the
  text unchanged (the caller's type error names it); hexadecimal, octal, binary, a leading 0 and base 60 are one
  ConfigError line, as YAML 1.1 and Python read them differently (0x10, 010, 12:30)."""
  stripped = text.strip()
  for what, pattern in _NOT_DECIMAL.items():
    if pattern.match(stripped):
      raise ConfigError(
        f"config key {key!r} ({source}) takes a decimal number (e.g. 16, -3, 2.5, 1e-4), got {text!r}: {what} is not "
        "read"
      )
  for parse in (int, float):
    try:
      return parse(stripped)
    except ValueError:
      pass
  return _YAML_SPECIAL_FLOATS.get(stripped.lower(), text)


def _null(key: str, source: str) -> str:
  """A string key given null: "" where "" is the key's unset value (run_name="" = a timestamp name), else an error."""
  default = FIELDS[key].default
  if default == "":
    return ""
  raise ConfigError(
    f"config key {key!r} ({source}) is a string and got null; give the text (default {default!r}), or quote it "
    '("null") to mean the word'
  )


def _list_items(key: str, value: list[Any], source: str) -> list[Any]:
  """A list key's text items typed as its items: numbers in decimal (as `_number`), text kept."""
  (item_type,) = typing.get_args(FIELDS[key].annotation) or (Any,)
  if item_type in (int, float):
    return [_number(key, v, source) if isinstance(v, str) else v for v in value]
  return value


def coerce(key: str, value: Any, source: str) -> Any:
  """`value` (a YAML file's or a command line's text, a checkpoint's saved config, a value set in code) as the key's
  type, or one ConfigError line naming the key, where it was set and what it takes. A string key keeps the text as
  written; a number key takes decimal numbers; None is YAML's null."""
  want = base_type(key)
  written = value
  if isinstance(value, str) and want in (int, float):
    value = _number(key, value, source)
  elif isinstance(value, str) and want is bool:
    value = _BOOL_TEXTS.get(value.strip(), value)
  elif isinstance(value, str) and want is list:
    try:
      value = yaml.load(value, Loader=TextLoader) if value.strip() else value
    except yaml.YAMLError:
      pass
  if value is None and want is str:
    value = _null(key, source)
  shown = "null" if value is None else repr(value)
  bad = ConfigError(f"config key {key!r} ({source}) expects {type_name(key)}, got {shown}")
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
    value = _list_items(key, list(value), source)
  choices = allowed_values(key)
  if choices is not None and value not in choices:
    raise not_one_of(key, value, choices)
  try:
    value = _adapter(key).validate_python(value)  # list items: list[str], list[float] ("1e-3" becomes 0.001)
  except pydantic.ValidationError:
    raise bad from None
  check_range(key, value, written.strip() if isinstance(written, str) else None)
  return value


def closest_keys(name: str, n: int = 3) -> list[str]:
  return difflib.get_close_matches(name, list(FIELDS), n=n, cutoff=0.5)


def describe_key(key: str) -> str:
  """Type, default, allowed values and description of one key, a few lines."""
  if key in DERIVED:
    return _describe_derived(key)
  field = FIELDS[key]
  lines = [f"{key} ({GROUP_OF[key].__name__})", f"  type:        {type_name(key)}", f"  default:     {field.default!r}"]
  choices = allowed_values(key)
  if choices is not None:
    wrapped = textwrap.wrap(" | ".join(repr(x) for x in choices), 104, break_on_hyphens=False)
    lines.append("  allowed:     " + "\n               ".join(wrapped))
  if range_text(key) is not None:
    lines.append(f"  allowed:     {range_text(key)}")
  if unsupported_note(key):
    lines.append("  not here:    " + "\n               ".join(textwrap.wrap(unsupported_note(key), 104)))
  wrapped = textwrap.wrap(field.description or "", 104)
  lines.append("  description: " + "\n               ".join(wrapped))
  return "\n".join(lines)


def _annotation_name(annotation: Any) -> str:
  return repr(annotation).replace("typing.", "") if typing.get_origin(annotation) else annotation.__name__


def _describe_derived(key: str) -> str:
  field = DERIVED[key]
  lines = [f"{key} (Derived)", f"  type:        {_annotation_name(field.return_type)}", "  default:     (derived)"]
  wrapped = textwrap.wrap(field.description or "", 104)
  lines.append("  description: " + "\n               ".join(wrapped))
  return "\n".join(lines)


def group_summary(group: type) -> str:
  """A group's header line: its docstring's first paragraph, whole (a wrapped first line would stop mid-sentence)."""
  return " ".join((group.__doc__ or "").strip().split("\n\n")[0].split())


def describe(name: str) -> str:
  """--describe's answer: one key; a group of keys by its name (e.g. Checkpointing), each key's line; or `all`."""
  if name in FIELDS or name in DERIVED:
    return describe_key(name)
  groups = {g.__name__.lower(): g for g in (*GROUPS, Derived)}
  everything = [*GROUPS, Derived]
  chosen = everything if name.lower() == "all" else [groups[name.lower()]] if name.lower() in groups else []
  if not chosen:
    close = closest_keys(name) or difflib.get_close_matches(name, [g.__name__ for g in GROUPS], n=3, cutoff=0.5)
    hint = f"; closest: {', '.join(close)}" if close else "; a group name (e.g. Checkpointing) or `all` lists several"
    raise ConfigError(f"unknown config key {name!r}{hint}")
  out = []
  for group in chosen:
    out.append(f"{group.__name__}: {group_summary(group)}")
    if group is Derived:
      out += [f"  {key} ({_annotation_name(f.return_type)}): {f.description}" for key, f in DERIVED.items()]
      continue
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
  for group in (*GROUPS, Derived):
    text = f"{group.__name__}: {', '.join(group_keys(group))}"
    lines += textwrap.wrap(text, 118, initial_indent="  ", subsequent_indent="    ")
  return "\n".join(lines)


CHECKED_GROUPS = tuple(g for g in GROUPS if g.__pydantic_decorators__.model_validators)
_FLOAT_KEYS = tuple(key for key in FIELDS if base_type(key) is float)


def check_cross_keys(config: Mapping[str, Any]) -> None:
  """Run the cross-key checks that sit beside their keys (a group's model validators, e.g. Decoding's ranges) on a
  merged config's already typed values; each raises its one-line ConfigError. The keys' own bounds are checked first
  (pydantic would otherwise answer a value outside its Field's bounds with its own multi-line error)."""
  check_ranges(config)
  for group in CHECKED_GROUPS:
    group.model_validate({key: config[key] for key in group.model_fields})
  # No key means anything by NaN: one without bounds or a check of its own would take it silently.
  for key in _FLOAT_KEYS:
    if math.isnan(config[key]):
      raise ConfigError(f"{key} must be a number, got nan")


def derived_problems(config: Mapping[str, Any]) -> list[str]:
  """Every way a derived config (validate_and_derive's dict) disagrees with the schema, one line each: a key neither
  settable nor declared in `Derived`, a declared one missing, or a value not of its declared type."""
  declared = FIELDS.keys() | DERIVED.keys()
  problems = [f"{k}: held by the config, declared nowhere in the schema" for k in config if k not in declared]
  problems += [f"{k}: declared in Derived, not in the config" for k in DERIVED if k not in config]
  for key in (k for k in DERIVED if k in config):
    try:
      _derived_adapter(key).validate_python(config[key], strict=True)
    except pydantic.ValidationError as e:
      problems += [f"{'.'.join(map(str, (key, *err['loc'])))}: {err['msg']}" for err in e.errors()]
  return problems


@functools.cache
def _derived_adapter(key: str) -> pydantic.TypeAdapter:
  return pydantic.TypeAdapter(DERIVED[key].return_type)


def group_keys(group: type[pydantic.BaseModel]) -> list[str]:
  """A group's keys in their order: Derived's are its computed fields (its own fields are its inputs)."""
  return list(group.model_computed_fields if group is Derived else group.model_fields)


def _frozen(annotation: Any) -> Any:
  """The type a Config hands out for a value of this type: Config freezes lists into tuples."""
  if typing.get_origin(annotation) is list:
    (item,) = typing.get_args(annotation)
    return tuple[_frozen(item), ...]
  return annotation


def config_annotations() -> dict[str, Any]:
  """Every key a Config can hold, set or derived, with the type `config.key` reads it as."""
  settable = {key: field.annotation for key, field in FIELDS.items()}
  derived = {key: field.return_type for key, field in DERIVED.items()}
  return {key: _frozen(annotation) for key, annotation in (settable | derived).items()}

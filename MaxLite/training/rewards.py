"""GRPO's reward functions, named in the config (`reward_functions`), loaded and called as TRL calls them.

An entry is `module.path:function` (imported) or `path/to/file.py:function` (a local or gs:// file; a relative
path is relative to the working directory); the function may be an attribute path (`module:Class.method`). A
reward function is called as fn(prompts=[...], completions=[...], **columns), where columns holds the records'
other fields, one list per field aligned with completions, and returns one float per completion or None where it
does not score that completion (NaN here; GRPO leaves it out). A function without **kwargs gets only the columns
it names. Every mistake in an entry, or in what a function returns, is one line naming the function.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from MaxLite import storage
from MaxLite.cli.errors import ConfigError, first_line

KEY = "reward_functions"
FORMS = "'module.path:function' or 'path/to/file.py:function' (e.g. 'MaxLite.data.arithmetic:exact_match')"


def _split(entry: Any, index: int) -> tuple[str, str]:
  if not isinstance(entry, str) or not entry.strip():
    raise ConfigError(f"{KEY}: entry {index} is {entry!r}; write {FORMS}")
  where, colon, attribute = entry.strip().rpartition(":")
  if not colon:
    raise ConfigError(f"{KEY}: {entry!r} has no ':' before the function's name; write {FORMS}")
  if not where:
    raise ConfigError(f"{KEY}: {entry!r} names no module or file before the ':'; write {FORMS}")
  if not attribute or not all(part.isidentifier() for part in attribute.split(".")):
    raise ConfigError(f"{KEY}: {entry!r}: {attribute!r} after the ':' is not a Python name; write {FORMS}")
  return where, attribute


def _is_file(where: str) -> bool:
  return where.endswith(".py") or "/" in where or os.sep in where


def _module_from_file(entry: str, path: str) -> types.ModuleType:
  path = storage.absolute(path)
  if not storage.isfile(path):
    raise ConfigError(f"{KEY}: {entry!r}: no file {path}")
  try:
    source = storage.read_text(path)
  except Exception as e:
    raise ConfigError(f"{KEY}: {entry!r}: cannot read {path} ({first_line(e, with_type=True)})") from None
  # A name of its own per file, registered before the file runs, so its dataclasses, pickling and relative
  # lookups through sys.modules work; two files with one stem stay apart.
  name = f"maxlite_reward_{os.path.splitext(os.path.basename(path))[0]}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"
  if name in sys.modules:
    return sys.modules[name]
  module = types.ModuleType(name)
  module.__file__ = path
  sys.modules[name] = module
  try:
    exec(compile(source, path, "exec"), module.__dict__)
  except Exception as e:
    del sys.modules[name]
    raise ConfigError(f"{KEY}: {entry!r} does not load ({first_line(e, with_type=True)})") from None
  return module


def _module(entry: str, where: str) -> types.ModuleType:
  if _is_file(where):
    return _module_from_file(entry, where)
  try:
    return importlib.import_module(where)
  except Exception as e:
    # `python MaxLite/train.py` puts MaxLite/ on sys.path, not the working directory: a module there (my_rewards.py
    # for 'my_rewards:fn') is loaded from its file, as `python -m` would find it, after everything installed.
    local = os.path.join(os.getcwd(), *where.split(".")) + ".py"
    if isinstance(e, ModuleNotFoundError) and e.name == where.split(".")[0] and os.path.isfile(local):
      return _module_from_file(entry, local)
    raise ConfigError(f"{KEY}: {entry!r} does not import ({first_line(e, with_type=True)})") from None


def _public_callables(module: types.ModuleType) -> str:
  found = [n for n, v in vars(module).items() if not n.startswith("_") and inspect.isfunction(v)]
  return ", ".join(sorted(found)[:12]) or "none"


def _check_signature(entry: str, function: Callable) -> None:
  """The call GRPO makes must bind prompts and completions by keyword; columns are checked when called (score)."""
  try:
    signature = inspect.signature(function)
  except (TypeError, ValueError):  # a builtin or C callable: nothing to check before calling it
    return
  try:
    signature.bind_partial(prompts=[], completions=[])
  except TypeError as e:
    raise ConfigError(
      f"{KEY}: {entry!r} cannot be called as fn(prompts=..., completions=..., **columns): {function.__name__}"
      f"{signature} ({e})"
    ) from None


def load(paths: Sequence[str]) -> list[Callable]:
  """The reward functions the entries name (module docstring), in order; ConfigError (one line) for an entry that
  is malformed, does not import or load, or names something missing or not callable."""
  if isinstance(paths, str):
    paths = [paths]
  if not paths:
    raise ConfigError(f"{KEY} is empty; GRPO needs at least one reward function, named as {FORMS}")
  functions = []
  for index, entry in enumerate(paths):
    where, attribute = _split(entry, index)
    module = _module(entry, where)
    target: Any = module
    for part in attribute.split("."):
      if not hasattr(target, part):
        owner = module.__name__ if target is module else f"{where}:{attribute}"
        raise ConfigError(
          f"{KEY}: {entry!r}: {owner} has no attribute {part!r} (its functions: {_public_callables(module)})"
        )
      target = getattr(target, part)
    if not callable(target):
      raise ConfigError(f"{KEY}: {entry!r} is not callable (a value of type {type(target).__name__})")
    _check_signature(entry, target)
    functions.append(target)
  return functions


def names(paths: Sequence[str]) -> list[str]:
  """A short name per entry for metric keys (rewards/<name>/mean): the function's name, with _2, _3... added to
  the later of two entries that share one."""
  if isinstance(paths, str):
    paths = [paths]
  base = [_split(entry, i)[1].rsplit(".", 1)[-1] for i, entry in enumerate(paths)]
  taken: set[str] = set(base)
  seen: set[str] = set()
  out = []
  for name in base:
    unique = name
    if name in seen:
      n = 2
      while f"{name}_{n}" in taken:
        n += 1
      unique = f"{name}_{n}"
    seen.add(name)
    taken.add(unique)
    out.append(unique)
  return out


def _name(function: Callable) -> str:
  return getattr(function, "__name__", None) or repr(function)


def _columns_for(function: Callable, columns: Mapping[str, Sequence[Any]]) -> dict[str, Sequence[Any]]:
  """All columns for a function with **kwargs (TRL's convention), else only those it names."""
  try:
    parameters = inspect.signature(function).parameters.values()
  except (TypeError, ValueError):
    return dict(columns)
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
    return dict(columns)
  accepted = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  return {k: v for k, v in columns.items() if k in accepted}


def _reward(name: str, value: Any, index: int) -> float:
  """One reward as a float: None -> NaN; a number (Python, numpy or a 0-d tensor) as it is; anything else, or an
  infinity (it would swamp its group's advantages), a ConfigError."""
  if value is None:
    return math.nan
  number = None
  if not isinstance(value, (str, bytes)) and hasattr(value, "__float__"):
    try:
      number = float(value)
    except (TypeError, ValueError):
      pass
  if number is None:
    raise ConfigError(
      f"{KEY}: {name} returned {value!r} ({type(value).__name__}) for completion {index}; a reward is a number or None"
    )
  if math.isinf(number):
    raise ConfigError(f"{KEY}: {name} returned {number} for completion {index}; a reward is a finite number or None")
  return number


def score(
  functions: Sequence[Callable],
  prompts: Sequence[str],
  completions: Sequence[str],
  columns: Mapping[str, Sequence[Any]],
) -> np.ndarray:
  """Rewards float32 [completions, functions], NaN where a function returned None. A function that returns other
  than one number or None per completion is a ConfigError (one line); an exception inside one is re-raised as a
  RuntimeError naming it (its traceback chained)."""
  prompts, completions = list(prompts), list(completions)
  for column, values in columns.items():
    if len(values) != len(completions):
      raise ValueError(f"column {column!r} holds {len(values)} values for {len(completions)} completions")
  out = np.empty((len(completions), len(functions)), np.float32)
  for j, function in enumerate(functions):
    name = _name(function)
    try:
      # Copies: a function that edits its lists in place changes nothing the next one sees.
      given = {k: list(v) for k, v in _columns_for(function, columns).items()}
      result = function(prompts=list(prompts), completions=list(completions), **given)
    except Exception as e:
      raise RuntimeError(f"reward function {name} failed: {first_line(e, with_type=True)}") from e
    if isinstance(result, np.ndarray):
      result = result.tolist() if result.ndim == 1 else result
    if not isinstance(result, (list, tuple)):
      raise ConfigError(
        f"{KEY}: {name} returned a {type(result).__name__}; a reward function returns a list with one number or "
        "None per completion"
      )
    if len(result) != len(completions):
      raise ConfigError(
        f"{KEY}: {name} returned {len(result)} rewards for {len(completions)} completions; a reward function returns "
        "one number or None per completion"
      )
    out[:, j] = [_reward(name, value, i) for i, value in enumerate(result)]
  return out

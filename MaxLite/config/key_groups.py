"""Key groups declared beside the capability that reads them (an objective, a family) rather than in keys_*.py.

The schema composes these with its own groups when it is first imported. The capability packages sit above config,
so the package root names them (`add_source("MaxLite.objectives")`, as it names MaxLite.models for the family
registry) and config never imports them by name. A source is a package whose `__init__` imports without jax or flax
(`--help` and `--describe` read the schema before any runtime starts) and lists its groups as `KEY_GROUPS`.
"""

from __future__ import annotations

import importlib
from typing import Any

_SOURCES: list[str] = []


def add_source(package: str) -> None:
  """`package` declares key groups in its KEY_GROUPS; read when the schema is first imported."""
  if package not in _SOURCES:
    _SOURCES.append(package)


def groups() -> tuple[Any, ...]:
  """Every declared group, sources in the order added, each source's groups in its own order."""
  found: list[Any] = []
  for package in _SOURCES:
    found += [g for g in importlib.import_module(package).KEY_GROUPS if g not in found]
  return tuple(found)

"""A module imported at its first attribute read.

The objectives declare their keys and checks beside their losses, and config validation and `--help` read those
without starting jax (0.9 s on 2 cores): their loss code reaches jax through these names, which import it when a
loss is first traced.
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyModule:
  """Stands for `name` until an attribute is read, then is that module's attribute."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr: str) -> Any:
    return getattr(importlib.import_module(self._name), attr)

  def __repr__(self) -> str:
    return f"<lazy module {self._name!r}>"


jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")

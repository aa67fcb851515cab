"""Small shared type aliases and dtype lookup for the layers."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

DType = Any

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def dtype_of(name: str) -> DType:
  return _DTYPES[name]

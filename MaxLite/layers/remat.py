"""The jax.checkpoint policy a config's `remat_policy` names (the names and presets are in config/choices.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from MaxLite.config.choices import placement


def remat_policy(config: Mapping[str, Any] | Any) -> Any:
  """The jax.checkpoint policy for the config's remat_policy (None = save nothing: `full`)."""
  kept = placement(config)
  if not kept.offloaded:
    return jax.checkpoint_policies.save_only_these_names(*kept.on_device) if kept.on_device else None
  return jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=list(kept.on_device),
    names_which_can_be_offloaded=list(kept.offloaded),
    offload_src="device",
    offload_dst="pinned_host",
  )

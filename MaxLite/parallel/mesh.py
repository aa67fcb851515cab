"""Arrange devices into the named mesh the config asks for."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from MaxLite.config import Config
from MaxLite.config.choices import MESH_AXES


def _slice_groups(devices: Sequence[jax.Device], num_slices: int) -> list[list[jax.Device]]:
  """Devices of each slice: by slice_index on TPU, by process on multi-host CPU/GPU, else in order."""
  if len({getattr(d, "slice_index", 0) for d in devices}) == num_slices > 1:  # TPU: every device knows its slice
    key = lambda d: d.slice_index
  elif len({d.process_index for d in devices}) == num_slices:
    key = lambda d: d.process_index
  else:  # one process simulating several slices
    per_slice = len(devices) // num_slices
    key = lambda d: devices.index(d) // per_slice
  groups: dict[int, list[jax.Device]] = {}
  for d in devices:
    groups.setdefault(key(d), []).append(d)
  if len(groups) != num_slices or len({len(g) for g in groups.values()}) != 1:
    raise ValueError(f"cannot split {len(devices)} devices into {num_slices} equal slices")
  return [groups[k] for k in sorted(groups)]


def _device_array(config: Config, devices: Sequence[jax.Device]) -> np.ndarray:
  ici, dcn = list(config.ici_mesh_shape), list(config.dcn_mesh_shape)
  # Within a slice the ICI topology decides which devices are neighbours; mesh_utils knows it for
  # TPUs and falls back to a plain reshape elsewhere.
  per_slice = [
    mesh_utils.create_device_mesh(ici, group, allow_split_physical_axes=True)
    for group in _slice_groups(devices, config.num_slices)
  ]
  # Stack slices on the dcn axes, then interleave (dcn_i, ici_i) so each mesh axis is slice-major:
  # its outer factor steps across slices (slow DCN), its inner factor stays inside a slice.
  n = len(ici)
  stacked = np.stack(per_slice).reshape(dcn + ici)
  order = [ax for i in range(n) for ax in (i, n + i)]
  return stacked.transpose(order).reshape([d * i for d, i in zip(dcn, ici)])


def create_mesh(config: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Mesh with axes (ensemble, data, stage, fsdp, sequence, tensor, expert), all Auto-typed for GSPMD."""
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) != config.num_devices:
    raise ValueError(f"config was resolved for {config.num_devices} devices but {len(devices)} were given")
  array = _device_array(config, devices)
  return Mesh(array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe_mesh(mesh: Mesh) -> str:
  shape = " x ".join(f"{name}={size}" for name, size in mesh.shape.items() if size > 1) or "1 device"
  return f"mesh {shape} ({mesh.devices.size} devices: {dict(mesh.shape)})"

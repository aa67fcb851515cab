"""Named compile targets (v5p-128, v5e-16, cpu-8, ...): device layout and the chip's HBM and peak FLOP/s.

TPU names follow Cloud TPU: v4-N and v5p-N count TensorCores (2 per chip, one JAX device per chip
in megacore mode), v5e-N and v6e-N count chips (one core each). The chip numbers are the public
per-chip specifications (HBM capacity, dense bf16 peak).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from MaxLite.cli.errors import ConfigError

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
  family: str
  cores_per_chip: int  # how many of the N in "<family>-N" one chip accounts for
  dims: int  # 3 = 3D torus (v4, v5p), 2 = 2D (v5e, v6e)
  hbm_bytes: int
  peak_bf16_tflops: float
  chip_config_name: str | None  # libtpu's name for the per-device layout
  hbm_gbytes_per_s: float  # HBM bandwidth
  ici_link_gbytes_per_s: float  # one inter-chip link, one way, at the rate a collective's payload moves over it
  dcn_gbits_per_s: float  # data-center network share of one chip (between slices)
  pcie_gbytes_per_s: float = 15.0  # host memory <-> chip (host offload)
  peak_int8_tops: float = 0.0  # int8 matmuls (0 = none faster than bf16)
  peak_fp8_tflops: float = 0.0  # fp8 matmuls (0 = no native fp8: fp8 runs emulated, at best at the bf16 rate)

  def peak_flops(self, operand_type: str) -> float:
    """FLOP/s of a matmul whose operands are of this HLO type (s8, f8e4m3fn, bf16, ...) at the chip's peak."""
    if operand_type in ("s8", "u8") and self.peak_int8_tops:
      return self.peak_int8_tops * 1e12
    if operand_type.startswith("f8") and self.peak_fp8_tflops:
      return self.peak_fp8_tflops * 1e12
    return self.peak_bf16_tflops * 1e12

  @property
  def ici_send_bytes_per_s(self) -> float:
    """What one chip sends over all its ICI links at once (two per torus dimension), bytes/s."""
    return self.ici_link_gbytes_per_s * 1e9 * 2 * self.dims


# Cloud TPU's published per-chip figures (cloud.google.com/tpu/docs: v4, v5e, v5p, v6e system architecture pages).
# ICI per link, one way, at the rate payloads reach, not the nominal link rate (Cloud's 4800 / 1600 / 3584 Gbit/s per
# v5p / v5e / v6e chip are 100 / 50 / 112 GB/s a link): measured where a measurement is published, v5p 86.3 and v6e
# 86.8 GB/s (lax.ppermute of 1 KiB to 64 MiB per device between two chips of a v5p-8 / v6e-8, the large-payload slope
# of time over bytes: marin-community/marin issue 6736, 2026-06-28); else the per-link table of "How to Scale Your
# Model" (Austin et al. 2025, TPU chapter: 4.5e10 bytes/s one way for v4 and v5e; 9e10 for v5p and v6e, which the
# measurements come within 4% of).
# PCIe: about 15 GB/s per chip on v4/v5, 32 GB/s on v6e (the same book's TPU chapter).
# DCN: about 25 GB/s per host (the same book), shared by the host's chips: 4 on v4 / v5p (2x2x1), 8 on v5e / v6e
# (4x2): 50 and 25 Gbit/s per chip.
# HBM of v5p and v5e: what libtpu's compiler lets one program use, from its RESOURCE_EXHAUSTED message here ("95.74G
# hbm", "15.75G hbm"), not the nominal 95 / 16 GiB: a program between 15.75 and 16 GiB does not run on a v5e chip.
# int8: Cloud TPU's published per-chip peaks (the same system architecture pages): v4 275 (no faster than bf16),
# v5p 918, v5e 394, v6e 1836 TOPS. None of these four has an fp8 matrix unit (Ironwood, v7, is the first).
CHIPS = {
  "v4": Chip("v4", 2, 3, 32 * GiB, 275.0, "megacore", 1200.0, 45.0, 50.0, peak_int8_tops=275.0),
  "v5p": Chip("v5p", 2, 3, int(95.74 * GiB), 459.0, "megacore", 2765.0, 86.3, 50.0, peak_int8_tops=918.0),
  "v5e": Chip("v5e", 1, 2, int(15.75 * GiB), 197.0, None, 819.0, 45.0, 25.0, peak_int8_tops=394.0),
  "v6e": Chip("v6e", 1, 2, 32 * GiB, 918.0, None, 1640.0, 86.8, 25.0, 32.0, peak_int8_tops=1836.0),
}

# NVIDIA's published dense (no sparsity) per-GPU figures (H100/H200/A100/B200 datasheets): bf16, fp8 and int8
# tensor-core peaks, HBM capacity and bandwidth. NVLink one way: 18 links of 25 GB/s on H100/H200 (450 GB/s), 12 on
# A100 (300), 18 of 50 on B200 (900), entered as half that (the model counts two links per dimension, dims=1); one
# 400 Gbit/s NIC per GPU between nodes (200 on A100 systems); PCIe Gen5 x16 to the host (Gen4 on A100). Matched by
# jax's device_kind, e.g. "NVIDIA H100 80GB HBM3", "NVIDIA H200".
GPU_CHIPS = {
  "H100 PCIe": Chip("H100 PCIe", 1, 1, 80 * 10**9, 756.0, None, 2000.0, 150.0, 400.0, 64.0, 1513.0, 1513.0),
  "H100": Chip("H100", 1, 1, 80 * 10**9, 989.4, None, 3350.0, 225.0, 400.0, 64.0, 1978.9, 1978.9),
  "H200": Chip("H200", 1, 1, 141 * 10**9, 989.4, None, 4800.0, 225.0, 400.0, 64.0, 1978.9, 1978.9),
  "A100": Chip("A100", 1, 1, 80 * 10**9, 312.0, None, 2039.0, 150.0, 200.0, 32.0, 624.0, 0.0),
  "B200": Chip("B200", 1, 1, 180 * 10**9, 2250.0, None, 8000.0, 450.0, 400.0, 64.0, 4500.0, 4500.0),
}


def gpu_chip(device_kind: str) -> Chip | None:
  """The GPU_CHIPS entry for jax's device_kind (the most specific name it contains), or None for one not listed."""
  for name in sorted(GPU_CHIPS, key=len, reverse=True):
    if name.replace(" ", "").lower() in device_kind.replace(" ", "").lower():
      return GPU_CHIPS[name]
  return None


def accelerator_chip(platform: str, device_kind: str, environ: dict[str, str]) -> Chip | None:
  """This machine's chip, where its figures are known: a TPU by TPU_ACCELERATOR_TYPE, a GPU by its device_kind."""
  if platform == "tpu":
    family = family_of_accelerator(environ.get("TPU_ACCELERATOR_TYPE", ""))
    return CHIPS.get(family) if family else None
  if platform in ("gpu", "cuda"):
    return gpu_chip(device_kind)
  return None


def device_chip(device: Any, environ: dict[str, str] | None = None) -> Chip | None:
  """`accelerator_chip` of a jax device (this process's first, say): its platform and device_kind."""
  environ = dict(os.environ) if environ is None else environ
  return accelerator_chip(device.platform, getattr(device, "device_kind", ""), environ)


# XLA flags for TPU collectives, per chip generation, from MaxText's performance recipes (MaxText commit 30c0d0d4c:
# configs/v5p/*.sh, v5e/*.sh and v4/*.sh export them as LIBTPU_INIT_ARGS): all-gathers and reduce-scatters run
# asynchronously and fused, overlapped with compute, pipelined backwards through the scanned layers, and data-parallel
# all-reduces combined. No recipe publishes flags for v6e, so it gets none. train.py sets them on TPU and
# train_compile.py compiles with them, so the memory and schedule it reports are the pod's; a LIBTPU_INIT_ARGS already
# in the environment wins unchanged. One change from the recipes: v5p does not fuse all-gathers into the async
# collective fusion. The libtpu of jax 0.11 refuses to compile that on v5p ("continuation fusion for AllGather ... not
# supported on platforms other than Viperlite", i.e. v5e), which failed every v5p compile and run with these defaults;
# MaxText's current v5p/32b recipe turns it off too, and the libtpu of jax 0.10 leaves it off when not asked (llama2-7b
# on v5p-8: 30.09 GiB allocated with it off or unset, 30.49 with it on).
_FUSE_ALL_GATHERS = "--xla_tpu_enable_async_collective_fusion_fuse_all_gather"
_ASYNC_FUSION = (  # both v5 generations; each adds whether all-gathers join the fusion
  "--xla_tpu_enable_data_parallel_all_reduce_opt=true",
  "--xla_tpu_data_parallel_opt_different_sized_ops=true",
  "--xla_tpu_enable_async_collective_fusion=true",
  "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
  "--xla_tpu_overlap_compute_collective_tc=true",
  "--xla_enable_async_all_gather=true",
)
LIBTPU_FLAGS = {
  "v4": ("--xla_enable_async_all_gather=true",),
  "v5e": (*_ASYNC_FUSION, f"{_FUSE_ALL_GATHERS}=true"),
  "v5p": (
    *_ASYNC_FUSION,
    f"{_FUSE_ALL_GATHERS}=false",
    "--xla_tpu_megacore_fusion_allow_ags=false",
    "--xla_enable_async_collective_permute=true",
    "--xla_tpu_enable_ag_backward_pipelining=true",
  ),
  "v6e": (),
}


def libtpu_init_args(family: str, environ: dict[str, str]) -> tuple[str, str]:
  """(LIBTPU_INIT_ARGS to use, where it came from) for a chip family: the environment's own value wins."""
  if "LIBTPU_INIT_ARGS" in environ:
    return environ["LIBTPU_INIT_ARGS"], "LIBTPU_INIT_ARGS from the environment"
  return " ".join(LIBTPU_FLAGS.get(family, ())), f"MaxLite's {family} defaults (topologies.LIBTPU_FLAGS)"


def family_of_accelerator(accelerator_type: str) -> str | None:
  """'v5p-128' / 'v5litepod-256' / 'v6e-8' (TPU_ACCELERATOR_TYPE on a TPU VM) -> the chip family, or None."""
  match = re.match(r"(v4|v5p|v5e|v5litepod|v6e)-", accelerator_type)
  if not match:
    return None
  return "v5e" if match.group(1) == "v5litepod" else match.group(1)


def set_libtpu_flags(environ: dict[str, str], tpu_present: bool) -> str | None:
  """On a TPU host, put the chip's flags into `environ` (before jax starts the TPU backend); returns what it did."""
  if not tpu_present:
    return None
  family = family_of_accelerator(environ.get("TPU_ACCELERATOR_TYPE", ""))
  if family is None and "LIBTPU_INIT_ARGS" not in environ:
    return "TPU chip generation unknown (no TPU_ACCELERATOR_TYPE): no default XLA flags set"
  environ["LIBTPU_INIT_ARGS"], source = libtpu_init_args(family or "", environ)
  return f"XLA flags ({source}): {environ['LIBTPU_INIT_ARGS'] or '(none)'}"


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  platform: str  # "tpu" or "cpu"
  num_devices: int  # per slice
  topology_name: str  # libtpu's "<family>:AxBxC" ("" for cpu)
  chip: Chip | None


def chip_grid(chips: int, dims: int) -> tuple[int, ...]:
  """The slice shape Cloud TPU uses for `chips` chips: 3D 4 -> 2x2x1, 8 -> 2x2x2, 16 -> 2x2x4,
  64 -> 4x4x4, 128 -> 4x4x8; 2D 16 -> 4x4, 32 -> 4x8. Grows by doubling the smallest side."""
  shape = [2, 2, 1] if dims == 3 else [1, 1]
  if dims == 3 and chips < 4:
    raise ConfigError(f"{chips} chips: the smallest 3D slice has 4 chips (v4-8 / v5p-8)")
  size = 4 if dims == 3 else 1
  while size < chips:
    smallest = min(shape)
    last = max(i for i, s in enumerate(shape) if s == smallest)
    shape[last] *= 2
    size *= 2
  if size != chips:
    raise ConfigError(f"{chips} chips is not a power-of-two slice")
  return tuple(shape)


def parse(name: str) -> Target:
  """'v5p-128' | 'v5e-16' | 'v4-8' | 'v6e-256' | 'cpu-8' -> Target."""
  match = re.fullmatch(r"(v4|v5p|v5e|v6e|cpu)-(\d+)", name)
  if not match:
    raise ConfigError(
      f"compile_topology={name!r} is not one of v4-N, v5p-N, v5e-N, v6e-N (Cloud TPU names, e.g. v5p-128) or cpu-N"
    )
  family, n = match.group(1), int(match.group(2))
  if family == "cpu":
    if n < 1:
      raise ConfigError(f"compile_topology={name!r}: cpu-N needs N >= 1")
    return Target(name, "cpu", n, "", None)
  chip = CHIPS[family]
  if n % chip.cores_per_chip:
    raise ConfigError(
      f"compile_topology={name!r}: {family}-N counts {chip.cores_per_chip} cores per chip, "
      f"so N must be a multiple of {chip.cores_per_chip}"
    )
  chips = n // chip.cores_per_chip
  grid = chip_grid(chips, chip.dims)
  return Target(name, "tpu", chips, f"{family}:{'x'.join(map(str, grid))}", chip)


def find_libtpu(repo_root: str) -> str | None:
  """libtpu.so from TPU_LIBRARY_PATH, setup.sh's .deps/libtpu, or an installed `libtpu` package."""
  candidates = [
    os.environ.get("TPU_LIBRARY_PATH", ""),
    os.path.join(repo_root, ".deps", "libtpu", "libtpu", "libtpu.so"),
  ]
  for path in candidates:
    if path and os.path.isfile(path):
      return path
  try:
    import libtpu

    return libtpu.get_library_path()
  except ImportError:
    return None

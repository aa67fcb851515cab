"""Predicted step time of a compiled train step on a TPU slice, from its device-level ops (hlo_costs.py).

Each op costs the larger of its matmul FLOPs at the rate XLA's matmuls reach (MATMUL_EFFICIENCY of the chip's bf16
peak) and its HBM bytes at the chip's HBM bandwidth (a per-op roofline). A collective costs its latency plus the
bytes one device sends over the links its group can use: a group inside a slice that spans k of the torus'
dimensions runs a bidirectional ring in each, i.e. k / dims of what the chip sends over all its links at once (at
the per-link rate payloads reach, topologies.py); a collective-permute sends one buffer to one peer, over one link
one way; a group that crosses slices runs at the chip's DCN share. An async copy between memory spaces (a prefetch
into VMEM, an eviction, a layer's activations to or from host memory) runs on the DMA engines at the HBM bandwidth,
or the PCIe bandwidth when host memory takes part. XLA schedules collectives asynchronously (start ... done): the
ops it placed between the two (a loop there with its whole body, every trip) hide the collective, and only the rest of
its time is added to the step. So do async copies. Transfers over the same links (a ring's, per mesh axes; a
permute's own link; one DMA path per memory kind) go one after another in the order they started.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence

from MaxLite.parallel import topologies
from MaxLite.parallel.topologies import Chip, Target
from MaxLite.planning.hlo_costs import Op

# Each hop over an ICI link costs about 1 us whatever the data ("How to Scale Your Model", sharding chapter): a ring
# over n chips takes n - 1 hops (a collective over several torus dimensions one ring per dimension), a permute one.
HOP_LATENCY_S = 1e-6
# The fraction of the bf16 peak a large matmul reaches: jnp.matmul of bf16 8192 x 8192 x 8192 on a TPU v5e ran at
# 92.3% (JAX documentation, Pallas TPU guide "Matrix Multiplication", its XLA baseline; timed with dispatch
# included). The one measured figure published for XLA's TPU matmuls; used for every chip and for the kernels too.
MATMUL_EFFICIENCY = 0.923
# cpu-N (simulated devices sharing this machine's cores): nominal per-device numbers, so plans for the CPU mesh can
# be ranked and their predicted order checked against measured steps. Not a claim about any CPU's speed.
CPU_CHIP = Chip("cpu", 1, 1, 2 * 2**30, 0.05, None, 10.0, 5.0, 8.0)


def planning_target(name: str, hbm_gib: float = -1) -> Target:
  """The compile target with a chip model for every platform (cpu-N gets CPU_CHIP) and, if hbm_gib > 0, that much
  device memory per chip instead of the chip's own (to plan with headroom)."""
  target = topologies.parse(name)
  chip = target.chip or CPU_CHIP
  if hbm_gib > 0:
    chip = dataclasses.replace(chip, hbm_bytes=int(hbm_gib * 2**30))
  return dataclasses.replace(target, chip=chip)


def torus(target: Target) -> tuple[int, ...]:
  """Chips per torus dimension of one slice (a cpu-N mesh is one ring of N)."""
  if not target.topology_name:
    return (target.num_devices,)
  return tuple(int(d) for d in target.topology_name.split(":")[1].split("x"))


@dataclasses.dataclass
class Prediction:
  step_s: float
  compute_s: float  # ops whose FLOPs bound them
  memory_s: float  # ops whose HBM traffic bounds them
  ici_s: float  # all collective time inside a slice (hidden or not)
  dcn_s: float  # all collective time across slices
  exposed_ici_s: float  # the part of ici_s the step waits for
  exposed_dcn_s: float
  mfu: float  # model FLOPs per device / (step_s x peak)
  tokens_per_s_per_chip: float
  copy_s: float = 0.0  # async copies between memory spaces (hidden or not)
  exposed_copy_s: float = 0.0

  @property
  def bottleneck(self) -> str:
    parts = {"compute": self.compute_s, "memory": self.memory_s + self.exposed_copy_s, "ICI": self.exposed_ici_s}
    parts["DCN"] = self.exposed_dcn_s
    return max(parts, key=parts.get)


@dataclasses.dataclass(frozen=True)
class Interconnect:
  chip: Chip
  torus: tuple[int, ...]  # chips per torus dimension in one slice
  ici_sizes: dict[str, int]  # mesh axis -> size inside a slice
  dcn_sizes: dict[str, int]  # mesh axis -> number of slices it spans

  def seconds(self, op: Op) -> float:
    if op.transfer:
      rate = self.chip.pcie_gbytes_per_s if op.transfer == "host" else self.chip.hbm_gbytes_per_s
      return op.moved_bytes / (rate * 1e9)
    latency = self.latency(op)
    if op.moved_bytes <= 0:
      return latency if op.collective else 0.0
    if self.crosses_slices(op):
      return latency + op.moved_bytes / (self.chip.dcn_gbits_per_s / 8 * 1e9)
    if op.collective == "collective-permute":
      return latency + op.moved_bytes / self.link_bandwidth()
    return latency + op.moved_bytes / self.send_bandwidth(self.group(op))

  def group(self, op: Op) -> int:
    # A collective whose replica groups named no mesh axes is costed by its group size (an empty product is 1,
    # which would price it as a collective over one chip).
    return math.prod(self.ici_sizes.get(a, 1) for a in op.axes) if op.axes else op.group_size

  def latency(self, op: Op) -> float:
    if op.collective == "collective-permute" or self.crosses_slices(op):
      return HOP_LATENCY_S
    return HOP_LATENCY_S * max(sum(size - 1 for size in self.ring_dims(self.group(op))), 1)

  def ring_dims(self, group: int) -> list[int]:
    """The torus dimensions a collective over `group` chips of the slice runs its rings in (largest first)."""
    dims, covered = [], 1
    for size in sorted(self.torus, reverse=True):  # the group's chips fill the largest torus dimensions first
      if covered >= group:
        break
      covered *= size
      dims.append(size)
    return dims

  def link_bandwidth(self) -> float:
    """Bytes/s over one link, one way."""
    return self.chip.ici_link_gbytes_per_s * 1e9

  def send_bandwidth(self, group: int) -> float:
    """Bytes/s one chip sends in a collective over `group` chips of its slice: a ring in each torus dimension the
    group spans, over that dimension's two links."""
    return 2 * self.link_bandwidth() * max(len(self.ring_dims(group)), 1)

  def links(self, op: Op) -> tuple:
    """The links a collective occupies: a ring's, shared with every other collective over the same mesh axes; a
    permute's one link one way (told apart by the op)."""
    kind = self.kind(op)
    if op.transfer:
      return (kind, op.transfer)
    return (kind, op.axes, op.name) if op.collective == "collective-permute" else (kind, op.axes)

  def kind(self, op: Op) -> str:
    return "copy" if op.transfer else "dcn" if self.crosses_slices(op) else "ici"

  def crosses_slices(self, op: Op) -> bool:
    return op.across_slices or math.prod(self.dcn_sizes.get(a, 1) for a in op.axes) > 1


@dataclasses.dataclass
class _InFlight:
  done: str  # the op that waits for it ("" = synchronous: the step waits at once)
  left: float  # seconds of transfer still to go
  kind: str  # ici | dcn | copy
  links: tuple  # what it shares with other transfers (Interconnect.links)


def matmul_seconds(op: Op, chip: Chip) -> float:
  """An op's matmul time at the chip's rates: int8 / fp8 FLOPs (quantized training) at that type's peak, the rest at
  the bf16 peak."""
  typed = sum(op.typed_flops.values())
  seconds = (op.flops - typed) / (chip.peak_bf16_tflops * 1e12)
  seconds += sum(flops / chip.peak_flops(kind) for kind, flops in op.typed_flops.items())
  return seconds / MATMUL_EFFICIENCY


def predict(
  ops: Sequence[Op], net: Interconnect, model_flops_per_device: float, tokens_per_device: float
) -> Prediction:
  peak = net.chip.peak_bf16_tflops * 1e12
  hbm = net.chip.hbm_gbytes_per_s * 1e9
  totals: dict[str, float] = defaultdict(float)
  by_computation: dict[str, list[Op]] = defaultdict(list)
  for op in ops:
    by_computation[op.computation].append(op)
  elapsed: dict[str, float] = {}  # seconds one run of a computation takes, its exposed waits included

  def walk(name: str) -> float:  # adds the computation's ops to the totals once; returns its time per run
    if name in elapsed:
      return elapsed[name]
    elapsed[name] = 0.0  # guards against recursion
    computation_ops = by_computation.get(name, [])
    runs = computation_ops[0].runs if computation_ops else 0.0
    in_flight: list[_InFlight] = []  # async collectives and copies, in the order they started
    took = 0.0

    def progress(seconds: float) -> None:  # transfers sharing links go one after another, in start order
      budget: dict[tuple, float] = defaultdict(lambda: seconds)
      for transfer in in_flight:
        used = min(budget[transfer.links], transfer.left)
        transfer.left -= used
        budget[transfer.links] -= used

    def wait(transfer: _InFlight) -> None:  # the step waits until the transfer (and those ahead of it) are done
      nonlocal took
      ahead = [t for t in in_flight[: in_flight.index(transfer)] if t.links == transfer.links]
      left = sum(t.left for t in ahead) + transfer.left
      totals[f"exposed_{transfer.kind}_s"] += left * runs
      took += left
      progress(left)
      in_flight.remove(transfer)

    for op in computation_ops:
      if op.collective or op.transfer:
        seconds, kind = net.seconds(op), net.kind(op)
        totals[f"{kind}_s"] += seconds * runs
        transfer = _InFlight(op.done, seconds, kind, net.links(op))
        in_flight.append(transfer)
        if not op.done:
          wait(transfer)
        continue
      if op.runs_inside:  # a loop or call: its ops are costed in their own computations; its time hides collectives
        seconds = sum(walk(c) * by_computation[c][0].runs / op.runs for c in op.runs_inside if by_computation.get(c))
      else:
        flops_s, bytes_s = matmul_seconds(op, net.chip), op.hbm_bytes / hbm
        seconds = max(flops_s, bytes_s)
        totals["compute_s" if flops_s >= bytes_s else "memory_s"] += seconds * runs
      took += seconds
      progress(seconds)
      for transfer in [t for t in in_flight if t.done == op.name]:
        wait(transfer)
    for transfer in list(in_flight):  # a done we did not see (its op is free, e.g. a *-done): wait for the rest
      wait(transfer)
    elapsed[name] = took
    return took

  for name in list(by_computation):
    walk(name)
  step = totals["compute_s"] + totals["memory_s"] + totals["exposed_ici_s"] + totals["exposed_dcn_s"]
  step += totals["exposed_copy_s"]
  step = max(step, 1e-12)
  return Prediction(
    step_s=step,
    compute_s=totals["compute_s"],
    memory_s=totals["memory_s"],
    ici_s=totals["ici_s"],
    dcn_s=totals["dcn_s"],
    exposed_ici_s=totals["exposed_ici_s"],
    exposed_dcn_s=totals["exposed_dcn_s"],
    mfu=model_flops_per_device / (step * peak),
    tokens_per_s_per_chip=tokens_per_device / step,
    copy_s=totals["copy_s"],
    exposed_copy_s=totals["exposed_copy_s"],
  )

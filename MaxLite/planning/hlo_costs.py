"""What one compiled train step does, read from XLA's compiled (scheduled, SPMD-partitioned) HLO text.

Per device-level instruction, in schedule order: matmul FLOPs (dots and convolutions, also inside fusions;
Pallas kernels by the cost estimate they carry), HBM bytes (operands + result of each top-level fusion or op),
and for collectives the bytes each device moves and the mesh axes the group spans. Every count is multiplied by
how often its computation runs: while loops (the scanned layers, gradient accumulation) by their trip count (XLA's,
or read from the loop's counter), so a 32-layer scan counts 32 layers, not one as XLA's cost_analysis() does.
Reading the text itself is hlo_text.py's; where it had to assume something, the op says what (`Op.assumed`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
from absl import logging

from MaxLite.parallel import context
from MaxLite.planning.hlo_text import (
  BYTES,
  Computations,
  Instr,
  array_bytes,
  arrays,
  called,
  dims,
  fused_body,
  parse_computations,
  replica_groups,
  run_counts,
)

# The op names jax gives grouped matmuls: XLA's TPU lowering of ragged_dot, and the megablox kernels (gmm, tgmm).
_GROUPED_MATMUL = re.compile(r'op_name="[^"]*(ragged_dot_general|jit\(t?gmm\))')
# Splash attention's Pallas kernels, named by jax's splash_attention_kernel.get_kernel_name (mha/mqa, phase).
_SPLASH = re.compile(r"^splash_m[hq]a_(fwd|dq|dkv)")
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# Async copies between memory spaces; the DMA engines run them while the core computes, until their done.
_TRANSFERS = ("copy-start", "slice-start", "dynamic-slice-start", "dynamic-update-slice-start")
_HOST_MEMORY = "S(5)"  # TPU layouts' memory space of host memory
# A multi-slice TPU program is compiled per slice: its collectives across slices are host transfers to the megascale
# runtime (a send that starts it, a recv that brings the result), which runs them over the data-center network.
_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_MEGASCALE_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter"}
# Instructions that move no data of their own (aliases, control flow whose bodies are counted separately).
_FREE = {
  "parameter",
  "get-tuple-element",
  "tuple",
  "constant",
  "bitcast",
  "while",
  "call",
  "conditional",
  "after-all",
  "opt-barrier",
  "partition-id",
  "replica-id",
  "iota",
}


@dataclasses.dataclass
class Op:
  name: str
  opcode: str
  computation: str
  runs: float  # how many times per step (loop trip counts multiplied)
  flops: float = 0.0  # per run
  hbm_bytes: float = 0.0  # per run
  collective: str = ""  # all-gather, all-reduce, ... ("" = none)
  moved_bytes: float = 0.0  # per device per run, for collectives
  group_size: int = 1
  axes: tuple[str, ...] = ()
  done: str = ""  # for an async start: the name of its done instruction
  # an async copy between memory spaces (a prefetch into VMEM, an eviction, a host offload): "hbm" or "host" (the
  # host's memory space takes part); moved_bytes is what it copies
  transfer: str = ""
  grouped_matmul: bool = False  # a grouped-matmul kernel (XLA's TPU ragged dot, megablox): costed on its whole buffer
  # a loop or call: the computations it runs (each costed by its own ops), so that a collective in flight across it
  # is hidden by their time
  runs_inside: tuple[str, ...] = ()
  # a splash attention kernel: (phase, batch, query heads, query length, key length, head dim); its FLOPs depend on
  # the kernel's block sizes, which the HLO does not show (splash_kernel_flops)
  attention: tuple = ()
  assumed: str = ""  # what the reader had to assume for this op (the text did not say), "" if nothing
  across_slices: bool = False  # a megascale transfer: over the data-center network whatever its axes
  # matmul FLOPs per run by operand type where the operands are not bf16/f32 ({"s8": ...} for int8 dots): costed at the
  # chip's rate for that type (quantized training)
  typed_flops: dict = dataclasses.field(default_factory=dict)


_LOW_PRECISION = re.compile(r"(s8|u8|f8\w*)\[")


def _low_precision_type(instr: Instr, shapes: dict[str, str]) -> str:
  """The operand type of a matmul whose operands are all int8 or fp8 ("s8", "f8e4m3fn", ...), else ""."""
  if instr.opcode not in ("dot", "convolution") or len(instr.operands) < 2:
    return ""
  kinds = [_LOW_PRECISION.match(shapes.get(o, "")) for o in instr.operands[:2]]
  return kinds[0].group(1) if all(kinds) else ""


def _matmul_flops(instr: Instr, shapes: dict[str, str]) -> float:
  out = math.prod(dims(instr.shape))
  if instr.opcode == "dot":
    lhs = dims(shapes.get(instr.operands[0], "")) if instr.operands else []
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
    k = math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i) if contracting and lhs else 1
    return 2.0 * out * k
  if instr.opcode == "convolution" and len(instr.operands) > 1:
    return _convolution_flops(instr, shapes)
  return 0.0


def _convolution_flops(instr: Instr, shapes: dict[str, str]) -> float:
  """2 x (batch x output features x input features) x, per spatial dim, the (output, tap) pairs that land inside
  the input. XLA's TPU matmuls are convolutions whose spatial dims often carry a batch dim as a fully padded,
  reversed window: counting only the taps that touch real input gets those right (one tap per output)."""
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instr.attrs)
  lhs, rhs = dims(shapes.get(instr.operands[0], "")), dims(shapes.get(instr.operands[1], ""))
  out = dims(instr.shape)
  if not labels or not lhs or not rhs or not out:
    return 0.0
  lhs_labels, rhs_labels, out_labels = labels.groups()
  window = re.search(r"window=\{([^}]*)\}", instr.attrs)
  settings = dict(re.findall(r"(\w+)=([\w_x-]+)", window.group(1))) if window else {}
  pads = [tuple(int(v) for v in p.split("_")) for p in settings["pad"].split("x")] if "pad" in settings else []
  strides = [int(v) for v in settings["stride"].split("x")] if "stride" in settings else []
  pairs = 1
  for d in sorted(c for c in rhs_labels if c.isdigit()):
    size, taps, outputs = lhs[lhs_labels.index(d)], rhs[rhs_labels.index(d)], out[out_labels.index(d)]
    low = pads[int(d)][0] if int(d) < len(pads) else 0
    stride = strides[int(d)] if int(d) < len(strides) else 1
    pairs *= sum(
      min(taps, size + low - o * stride) - max(0, low - o * stride)
      for o in range(outputs)
      if min(taps, size + low - o * stride) > max(0, low - o * stride)
    )
  batch = lhs[lhs_labels.index("b")]
  return 2.0 * batch * rhs[rhs_labels.index("o")] * rhs[rhs_labels.index("i")] * pairs


def _attention_dims(instr: Instr, shapes: dict[str, str]) -> tuple[int, ...]:
  """(batch, query heads, query length, key length, head dim) of a splash kernel from its operands (it has no other
  description). Queries, keys and values are the operands of the same type, rank and last (head) dim as the one
  with the most bytes; mask blocks, segment ids and index tables differ in one of them. The queries have the most
  heads (grouped-query attention shares keys) and, among those, the shortest length (a sequence shard's queries
  against every key); the key length is the longest."""
  typed = [(t, d) for o in instr.operands for t, d in arrays(shapes.get(o, "")) if len(d) >= 3]
  if not typed:
    return ()
  kind, largest = max(typed, key=lambda td: BYTES.get(td[0], 4) * math.prod(td[1]))
  qkv = [d for t, d in typed if t == kind and len(d) == len(largest) and d[-1] == largest[-1]]
  heads = max(d[-3] for d in qkv)
  q = min((d for d in qkv if d[-3] == heads), key=lambda d: d[-2])
  return math.prod(q[:-3]), heads, q[-2], max(d[-2] for d in qkv), q[-1]


def splash_kernel_flops(
  attention: tuple, block_q: int, block_kv: int, fused_backward: bool = False, reorder: str = ""
) -> float:
  """Matmul FLOPs one run of a splash kernel does. It skips the (block_q x block_kv) blocks the causal mask rules out
  and computes the others whole: the diagonal blocks too. The forward does 2 matmuls per block (q.k, p.v); the dq
  kernel 3 (q.k again, do.v, ds.k); the dkv kernel 4 (q.k again, p.do, do.v, ds.q), 5 when it also makes dq
  (the fused backward). With the queries split over sequence shards the step waits for the shard with the most
  blocks: without load balancing the last, which sees every key; with `reorder` (the config's
  context_parallel_reorder, parallel/context.py) the shards' queries are load-balanced and the busiest is costed."""
  phase, batch, heads, q_len, kv_len, head_dim = attention
  shards = max(1, kv_len // q_len)
  order = context.token_order(kv_len, shards, reorder) if reorder and shards > 1 else np.arange(kv_len)
  pairs = 0
  for shard in np.split(order, shards):
    shard_pairs = 0
    for start in range(0, q_len, block_q):
      last_key = int(shard[start : start + block_q].max()) + 1  # the keys this query block sees end here
      shard_pairs += block_q * math.ceil(last_key / block_kv) * block_kv
    pairs = max(pairs, shard_pairs)
  matmuls = {"fwd": 2, "dq": 3, "dkv": 5 if fused_backward else 4}[phase]
  return 2.0 * matmuls * batch * heads * pairs * head_dim


def _custom_call_flops(instr: Instr) -> float:
  """Pallas kernels (splash attention) carry their own cost estimate in the backend config."""
  found = re.search(r'"flops"\s*:\s*"?(\d+)', instr.attrs) or re.search(r"flops[\"']?\s*[:=]\s*(\d+)", instr.attrs)
  return float(found.group(1)) if found else 0.0


def _group_axes(attrs: str, mesh_axes: Sequence[str], mesh_shape: Sequence[int]) -> tuple[tuple[str, ...], int, str]:
  """(mesh axes a collective's groups span, group size, what was assumed). Replica groups in a spelling not known
  here are taken as one group of every device (the most any collective can span, over every link kind the mesh
  has) rather than as free."""
  num_devices = math.prod(mesh_shape)
  groups = replica_groups(attrs, num_devices)
  if groups is None or groups.size == 0:
    everywhere = tuple(a for a, n in zip(mesh_axes, mesh_shape) if n > 1)
    return everywhere, num_devices, f"replica groups unreadable: costed as one group of all {num_devices} devices"
  coords = np.stack(np.unravel_index(groups[0] % num_devices, tuple(mesh_shape)), axis=-1)
  varying = tuple(a for i, a in enumerate(mesh_axes) if len(set(coords[:, i])) > 1)
  return varying, int(groups.shape[1]), ""


def _across_slices(
  instr: Instr,
  transfer: str,
  shapes: dict[str, str],
  mesh_axes: Sequence[str],
  dcn_shape: Sequence[int],
  computation: str,
  runs: float,
) -> Op:
  """A megascale transfer as the collective it is over the slices (the mesh axes that span slices)."""
  op = Op(instr.name, instr.opcode, computation, runs, collective=_MEGASCALE_KINDS.get(transfer, "all-reduce"))
  op.across_slices = True
  slices = math.prod(dcn_shape) if dcn_shape else 0
  assumed = []
  if slices > 1:
    op.axes, op.group_size = tuple(a for a, n in zip(mesh_axes, dcn_shape) if n > 1), slices
  else:
    op.group_size = 2
    assumed.append("a transfer across slices, the number of slices not given: costed as 2")
  if transfer not in _MEGASCALE_KINDS:
    assumed.append(f"megascale transfer {transfer}: costed as an all-reduce")
  op.assumed = "; ".join(assumed)
  data = array_bytes(shapes.get(instr.operands[0], "")) if instr.operands else 0  # the rest is a token
  op.moved_bytes = _ring_bytes(op.collective, data, data * op.group_size, op.group_size)
  return op


def _collective_kind(opcode: str) -> str:
  base = opcode.removesuffix("-start")
  return base if base in _COLLECTIVES else ""


def device_ops(
  text: str, mesh_axes: Sequence[str], mesh_shape: Sequence[int], dcn_shape: Sequence[int] = ()
) -> list[Op]:
  """The device-level instructions of the compiled step, in schedule order, with their costs. `dcn_shape`: the mesh's
  slices per axis (for the collectives a multi-slice program runs across slices)."""
  computations, shapes, entry = parse_computations(text)
  runs, scheduled, loops_assumed = run_counts(computations, entry)
  flops_in: dict[str, float] = {}
  typed_in: dict[str, dict[str, float]] = {}

  def computation_flops(name: str) -> float:  # matmul FLOPs of a fusion body, nested fusions included
    if name not in flops_in:
      flops_in[name] = 0.0  # guards against recursion
      typed_in[name] = {}
      total, typed = 0.0, {}
      for instr in computations.get(name, []):
        flops = _matmul_flops(instr, shapes)
        total += flops
        kind = _low_precision_type(instr, shapes)
        if kind:
          typed[kind] = typed.get(kind, 0.0) + flops
        if instr.opcode == "fusion":
          for _, c in called(instr.attrs):
            total += computation_flops(c)
            for k, v in typed_in[c].items():
              typed[k] = typed.get(k, 0.0) + v
      flops_in[name], typed_in[name] = total, typed
    return flops_in[name]

  ops: list[Op] = []
  for name in computations:
    if name not in scheduled or runs.get(name, 0) == 0:
      continue
    first = len(ops)
    pending: dict[str, Op] = {}  # open async collectives, by their start's name (or the channel they carry)
    for instr in computations[name]:
      fused_async = _fused_async(instr, computations)
      carried, channels = _carried(instr, computations)
      if instr.opcode.endswith("-done") or fused_async == "done":  # kept (at no cost): where the wait ends
        keys = channels if fused_async else instr.operands[:1]
        for key in keys:
          if key in pending:
            pending.pop(key).done = instr.name
        ops.append(Op(instr.name, instr.opcode, name, runs[name]))
        continue
      if instr.opcode in ("while", "call", "conditional"):
        inside = tuple(c for role, c in called(instr.attrs) if role in ("body", "calls", "branch"))
        ops.append(Op(instr.name, instr.opcode, name, runs[name], runs_inside=inside))
        ops[-1].assumed = loops_assumed.get(instr.name, "")
        continue
      if instr.opcode in _FREE:
        continue
      megascale = _MEGASCALE.search(instr.attrs) if instr.opcode in ("send", "recv") else None
      if megascale:  # the recv only brings the send's result back: one collective
        if instr.opcode == "send":
          ops.append(_across_slices(instr, megascale.group(1), shapes, mesh_axes, dcn_shape, name, runs[name]))
          pending[instr.name] = ops[-1]
        continue
      op = Op(instr.name, instr.opcode, name, runs[name])
      op.hbm_bytes = _hbm_bytes(instr, computations, shapes)
      op.flops = _matmul_flops(instr, shapes)
      kind = _low_precision_type(instr, shapes)
      if kind:
        op.typed_flops[kind] = op.flops
      if instr.opcode == "fusion":
        for _, c in called(instr.attrs):
          op.flops += computation_flops(c)
          for k, v in typed_in[c].items():
            op.typed_flops[k] = op.typed_flops.get(k, 0.0) + v
      elif instr.opcode == "custom-call":
        op.flops += _custom_call_flops(instr)
        op.grouped_matmul = bool(_GROUPED_MATMUL.search(instr.attrs))
        splash = _SPLASH.match(instr.name)
        attention = _attention_dims(instr, shapes) if splash else ()
        op.attention = (splash.group(1), *attention) if attention else ()
      if instr.opcode in _TRANSFERS:
        op.transfer = "host" if _HOST_MEMORY in instr.shape else "hbm"
        op.moved_bytes, op.hbm_bytes = _transfer_bytes(instr, shapes), 0.0
        pending[instr.name] = op
      kind, carrier = _collective_kind(instr.opcode), instr
      if instr.opcode == "async-start":
        inner = [i for _, c in called(instr.attrs) for i in computations.get(c, [])]
        carrier = next((i for i in inner if _collective_kind(i.opcode)), instr)
        kind = _collective_kind(carrier.opcode)
      elif instr.opcode == "fusion":
        # A fusion carrying a collective: the start of an async one (TPU's async collective fusion), or a
        # synchronous one (e.g. an all-reduce-scatter fusion). The fusions between an async start and its done
        # (also inside loops between them) carry a copy of the collective only to pass its buffers on: they are
        # compute it overlaps, costed as such.
        if carried and (fused_async == "start" or not _in_flight(instr, carried, computations)):
          carrier, kind = carried[0], _collective_kind(carried[0].opcode)
          if kind == "all-reduce" and array_bytes(instr.shape) < array_bytes(carrier.shape):
            kind = "reduce-scatter"  # all-reduce then this device's slice: a reduce-scatter on the wire
      if kind:
        op.collective = kind
        op.axes, op.group_size, op.assumed = _group_axes(carrier.attrs, mesh_axes, mesh_shape)
        op.moved_bytes = _moved_bytes(kind, carrier, shapes, op.group_size)
        op.hbm_bytes = 0.0  # a collective's time is its link time (below); its HBM traffic overlaps it
        if instr.opcode.endswith("-start"):
          pending[instr.name] = op
        elif fused_async == "start":
          pending.update({ch: op for ch in channels})
      ops.append(op)
    ops[first:] = _permutes_as_transfers(ops[first:], computations[name])
  for op in ops:
    if op.assumed:
      logging.warning("HLO cost reader: %s %s: %s", op.opcode, op.name, op.assumed)
  return ops


def _permutes_as_transfers(ops: list[Op], body: list[Instr]) -> list[Op]:
  """A computation's ops with each synchronous collective-permute moved to where its input is ready and waited for
  just before its first user (a zero-cost `<name>.wait` op).

  A collective-permute sends one buffer to a neighbour: a DMA over one link, which the core does not run. XLA's
  windowed einsum loops (Wang et al., ASPLOS 2023, "Overlap communication with dependent computation via
  decomposition in large deep learning models") rely on this: each trip sends the next shard while the core
  multiplies the current one, and libtpu leaves these permutes synchronous in the HLO. Compute stays in the
  schedule's order; only the transfer is placed by its data dependencies.
  """
  by_name = {i.name: i for i in body}
  users: Computations = defaultdict(list)
  for instr in body:
    for operand in instr.operands:
      users[operand].append(instr)
  position = {i.name: k for k, i in enumerate(body)}
  aliases = _FREE - {"while", "call", "conditional"}  # pass values on without running (a loop runs its body)

  def producers(value: str) -> list[str]:  # the instructions that compute a value, through aliases
    instr = by_name.get(value)
    if instr is None or instr.opcode == "parameter":
      return []
    if instr.opcode in aliases:
      return [p for operand in instr.operands for p in producers(operand)]
    return [value]

  transfers = {o.name: o for o in ops if o.opcode == "collective-permute" and o.collective and not o.done}
  if not transfers:
    return ops

  def first_user(value: str) -> str:  # the first op that computes with the value (a transfer of it only sends it on)
    found = [first_user(u.name) if u.opcode in aliases else u.name for u in users.get(value, [])]
    found = [f for f in found if f and f not in transfers]
    return min(found, key=position.__getitem__) if found else ""

  ready_after: dict[str, list[Op]] = defaultdict(list)  # op or wait name ("" = the start) -> transfers it releases
  wait_before: dict[str, list[Op]] = defaultdict(list)
  for name, op in transfers.items():
    inputs = [p for operand in by_name[name].operands for p in producers(operand)]
    last = max(inputs, key=position.__getitem__) if inputs else ""
    ready_after[f"{last}.wait" if last in transfers else last].append(op)
    op.done = f"{name}.wait"
    user = first_user(name)
    if user:
      wait_before[user].append(op)
  placed = list(ready_after[""])
  for op in ops:
    if op.name in transfers:
      continue
    for transfer in wait_before.get(op.name, []):
      placed.append(Op(transfer.done, "collective-permute-done", op.computation, op.runs))
      placed += ready_after.get(transfer.done, [])
    placed.append(op)
    placed += ready_after.get(op.name, [])
  seen = {id(o) for o in placed}
  # a transfer whose input comes from an op that is not costed, or that nothing here uses: issued in place, waited
  # for at the end of the computation
  return placed + [o for o in transfers.values() if id(o) not in seen]


def _carried(instr: Instr, computations: Computations) -> tuple[list[Instr], set[str]]:
  """(the collectives inside a fusion, their channel ids)."""
  if instr.opcode != "fusion":
    return [], set()
  carried = [i for i in fused_body(instr, computations) if _collective_kind(i.opcode)]
  channels = {m.group(1) for i in carried if (m := re.search(r"channel_id=(\d+)", i.attrs))}
  return carried, channels


def _in_flight(instr: Instr, carried: list[Instr], computations: Computations) -> bool:
  """True for a fusion that only passes its collectives' results out (an async one continues past it)."""
  body = fused_body(instr, computations)
  root = body[-1] if body else None
  if root is None or root.opcode != "tuple":
    return False
  users = [i for i in body for c in carried if c.name in i.operands]
  return all(u is root for u in users)


def _fused_async(instr: Instr, computations: Computations) -> str:
  """ "start" or "done" for the two ends of a TPU async collective fusion, else ""."""
  if instr.opcode != "fusion":
    return ""
  for inner in fused_body(instr, computations):
    if inner.opcode == "custom-call":
      if 'custom_call_target="AsyncCollectiveStart"' in inner.attrs:
        return "start"
      if 'custom_call_target="AsyncCollectiveDone"' in inner.attrs:
        return "done"
  return ""


def _hbm_bytes(instr: Instr, computations: Computations, shapes: dict[str, str]) -> float:
  """Bytes an op reads and writes in HBM: its operands and result, except that a slice of a big buffer reads only
  the slice and an in-place update (the scan's per-layer stacking) writes only the update."""
  inner = fused_body(instr, computations)
  if instr.opcode != "fusion" or not inner:
    if instr.opcode == "dynamic-slice":
      return 2.0 * array_bytes(instr.shape)
    if instr.opcode == "dynamic-update-slice" and len(instr.operands) > 1:
      return 2.0 * array_bytes(shapes.get(instr.operands[1], ""))
    return sum(array_bytes(shapes.get(o, "")) for o in instr.operands) + array_bytes(instr.shape)
  params = _params(inner)
  by_name = {i.name: i for i in inner}
  root = inner[-1]
  outputs = [by_name[o] for o in root.operands if o in by_name] if root.opcode == "tuple" else [root]
  total = 0.0
  for out in outputs:
    if out.opcode == "parameter" or _collective_kind(out.opcode) or "AsyncCollective" in out.attrs:
      continue  # passed through (aliased), or a collective's buffer: no HBM traffic of this op's own
    if out.opcode == "dynamic-update-slice" and out.operands[0] in params.values() and len(out.operands) > 1:
      total += array_bytes(shapes.get(out.operands[1], ""))  # updated in place: only the update is written
    else:
      total += array_bytes(out.shape)
  for index, operand in enumerate(instr.operands):
    full = array_bytes(shapes.get(operand, ""))
    total += min(full, _value_read(inner, params[index], full, computations)) if index in params else full
  return total


def _transfer_bytes(instr: Instr, shapes: dict[str, str]) -> float:
  """What an async copy moves. Its shape is (its operands, the result, a context scalar): the result is the copied
  buffer or the slice cut from a (host-offloaded) stack; an in-place update moves its update, not the stack."""
  if instr.opcode == "dynamic-update-slice-start":
    return float(array_bytes(shapes.get(instr.operands[1], ""))) if len(instr.operands) > 1 else 0.0
  operands = sum(array_bytes(shapes.get(o, "")) for o in instr.operands)
  found = arrays(instr.shape)
  context = array_bytes(found[-1][0] + "[]") if found else 0
  return float(max(array_bytes(instr.shape) - operands - context, 0))


def _params(body: list[Instr]) -> dict[int, str]:
  return {int(i.args): i.name for i in body if i.opcode == "parameter" and i.args.isdigit()}


def _value_read(body: list[Instr], value: str, full: int, computations: Computations) -> float:
  """Bytes a fusion body reads of its value (a parameter): the slices it cuts (also through a pad or bitcast, as the
  windowed-einsum loops cut their windows, and inside nested fusions), nothing if it does not use it, only passes
  it through, updates it in place or hands it to a collective, else all of it."""
  root = body[-1]
  outputs = set(root.operands) if root.opcode == "tuple" else {root.name}
  read = 0.0
  for use in [i for i in body if value in i.operands]:
    if use.opcode == "dynamic-slice" and use.operands[0] == value:
      read += array_bytes(use.shape)
    elif use.opcode in ("pad", "bitcast") and use.operands[0] == value and use is not root:
      read += _value_read(body, use.name, full, computations)
    elif use is root and use.opcode == "tuple":
      continue
    elif use.opcode == "dynamic-update-slice" and use.operands[0] == value and use.name in outputs:
      continue
    elif _collective_kind(use.opcode):
      continue
    elif use.opcode == "fusion" and (nested := fused_body(use, computations)):
      inner_params = _params(nested)
      read += sum(
        _value_read(nested, inner_params[k], full, computations)
        for k, o in enumerate(use.operands)
        if o == value and k in inner_params
      )
    else:
      return full
  return read


def _moved_bytes(kind: str, instr: Instr, shapes: dict[str, str], n: int) -> float:
  """Bytes one device sends in a ring (bandwidth-optimal) implementation of the collective. A combined collective
  (several arrays in one op, a tuple) moves all of them."""
  operand = sum(array_bytes(shapes.get(o, "")) for o in instr.operands)
  gathered = array_bytes(instr.shape)
  if instr.opcode.endswith("-start"):  # an async start's result holds its operands as well as the gathered arrays
    gathered -= operand
  return _ring_bytes(kind, operand, gathered, n)


def _ring_bytes(kind: str, operand: float, gathered: float, n: int) -> float:
  """Bytes one device sends in a ring over n devices, from what it holds and (for an all-gather) what it gets."""
  if n <= 1:
    return 0.0
  share = (n - 1) / n
  if kind == "all-gather":
    return gathered * share
  if kind == "all-reduce":
    return 2.0 * operand * share
  if kind in ("reduce-scatter", "all-to-all"):
    return operand * share
  return float(operand)  # collective-permute: each device sends its buffer once


def assumptions(ops: Sequence[Op]) -> list[str]:
  """One line per op whose cost rests on an assumption (for reports)."""
  return [f"{op.opcode} {op.name}: {op.assumed}" for op in ops if op.assumed]


def summary(ops: Sequence[Op]) -> dict[str, float]:
  """Totals per step (for reports and tests)."""
  out = {"flops": 0.0, "hbm_bytes": 0.0, "collective_bytes": 0.0}
  for op in ops:
    out["flops"] += op.flops * op.runs
    out["hbm_bytes"] += op.hbm_bytes * op.runs
    out["collective_bytes"] += op.moved_bytes * op.runs if op.collective else 0.0
  return out

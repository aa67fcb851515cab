"""What one compiled train step does, read from XLA's compiled (scheduled, SPMD-partitioned) HLO text.

Per device-level instruction, in schedule order: matmul FLOPs (dots and convolutions, also inside fusions;
Pallas kernels by the cost estimate they carry), HBM bytes (operands + result of each top-level fusion or op),
and for collectives the bytes each device moves and the mesh axes the group spans. Every count is multiplied by
how often its computation runs: while loops (the scanned layers, gradient accumulation) by their known trip
count, so a 32-layer scan counts 32 layers, not one as XLA's cost_analysis() does.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
BYTES.update({"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16})
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s+\((.*)\)\s+->\s+.*\{\s*$")
# The op names jax gives grouped matmuls: XLA's TPU lowering of ragged_dot, and the megablox kernels (gmm, tgmm).
_GROUPED_MATMUL = re.compile(r'op_name="[^"]*(ragged_dot_general|jit\(t?gmm\))')
# Splash attention's Pallas kernels, named by jax's splash_attention_kernel.get_kernel_name (mha/mqa, phase).
_SPLASH = re.compile(r"^splash_m[hq]a_(fwd|dq|dkv)")
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# Async copies between memory spaces; the DMA engines run them while the core computes, until their done.
_TRANSFERS = ("copy-start", "slice-start", "dynamic-slice-start", "dynamic-update-slice-start")
_HOST_MEMORY = "S(5)"  # TPU layouts' memory space of host memory
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


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  attrs: str
  args: str = ""  # the text between the parentheses (a constant's value)


def array_bytes(shape: str) -> int:
  return sum(BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _ARRAY.findall(shape))


def _dims(shape: str) -> list[int]:
  found = _ARRAY.search(shape)
  return [int(d) for d in found.group(2).split(",") if d] if found else []


def _matching(text: str, start: int) -> int:
  """Index just past the bracket that closes the one at `start`."""
  depth = 0
  pairs = {"(": ")", "{": "}", "[": "]"}
  opening = text[start]
  for i in range(start, len(text)):
    if text[i] == opening:
      depth += 1
    elif text[i] == pairs[opening]:
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def _parse_instruction(line: str) -> _Instr | None:
  match = re.match(r"\s*(?:ROOT\s+)?%(\S+)\s+=\s+", line)
  if not match:
    return None
  rest = line[match.end() :]
  if rest.startswith("("):
    end = _matching(rest, 0)
    shape, rest = rest[:end], rest[end:].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  opcode_match = re.match(r"([\w-]+)\(", rest)
  if not opcode_match:
    return None
  close = _matching(rest, opcode_match.end() - 1)
  args = rest[opcode_match.end() : close - 1]
  operands = re.findall(r"%([\w.-]+)", args)
  return _Instr(match.group(1), shape, opcode_match.group(1), operands, rest[close:], args)


def parse_computations(text: str) -> tuple[dict[str, list[_Instr]], dict[str, str], str]:
  """(computation -> instructions in order, value name -> shape, entry computation name)."""
  computations: dict[str, list[_Instr]] = {}
  shapes: dict[str, str] = {}
  entry, current = "", None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header:
      current = header.group(1)
      computations[current] = []
      if line.startswith("ENTRY"):
        entry = current
      for param in re.finditer(r"([\w.-]+):\s+(\([^)]*\)|[a-z0-9]+\[[\d,]*\](?:\{[^}]*\})?)", header.group(2)):
        shapes[param.group(1)] = param.group(2)
      continue
    if current is None:
      continue
    if line.rstrip() == "}":
      current = None
      continue
    instr = _parse_instruction(line)
    if instr:
      computations[current].append(instr)
      shapes[instr.name] = instr.shape
    elif computations[current]:  # a backend config that spans lines (Pallas kernels' metadata)
      computations[current][-1].attrs += "\n" + line
  return computations, shapes, entry


def _trip_count(instr: _Instr, computations: dict[str, list[_Instr]], parent: dict[str, _Instr]) -> int:
  """XLA's known trip count; else (TPU) from the loop itself: `counter < N` in the condition, the counter's
  increment in the body (windowed einsums step by 2) and its start in the while's operand tuple (else 0)."""
  found = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
  if found:
    return int(found.group(1))
  names = dict(re.findall(r"\b(condition|body)=%([\w.-]+)", instr.attrs))
  condition, body = computations.get(names.get("condition"), []), computations.get(names.get("body"), [])
  bound, index, inclusive = _loop_bound(condition)
  if bound is None:
    return 1
  step, start = 1, 0
  body_by_name = {i.name: i for i in body}
  root = next((i for i in reversed(body) if i.opcode == "tuple"), None)
  if root is not None and index < len(root.operands):
    update = body_by_name.get(root.operands[index])
    if update is not None and update.opcode == "add":
      step = next((_constant(body_by_name.get(o)) for o in update.operands if _constant(body_by_name.get(o))), 1)
  init = parent.get(instr.operands[0]) if instr.operands else None
  if init is not None and init.opcode == "tuple" and index < len(init.operands):
    start = _constant(parent.get(init.operands[index])) or 0
  return max(1, math.ceil((bound + inclusive - start) / max(step, 1)))


def _constant(instr: _Instr | None) -> int | None:
  if instr is None or instr.opcode != "constant" or not re.fullmatch(r"-?\d+", instr.args):
    return None
  return int(instr.args)


def _loop_bound(condition: list[_Instr]) -> tuple[int | None, int, int]:
  """(N, tuple index of the counter, 1 if `<=`) of a condition `counter < N`; (None, 0, 0) if not that shape."""
  by_name = {i.name: i for i in condition}
  for i in condition:
    direction = re.search(r"direction=(LT|LE)", i.attrs)
    if i.opcode != "compare" or not direction or len(i.operands) != 2:
      continue
    counter, limit = (by_name.get(o) for o in i.operands)
    bound = _constant(limit)
    index = re.search(r"index=(\d+)", counter.attrs) if counter is not None else None
    if bound is not None and counter is not None and counter.opcode == "get-tuple-element" and index:
      return bound, int(index.group(1)), int(direction.group(1) == "LE")
  return None, 0, 0


def _called(attrs: str) -> list[tuple[str, str]]:
  """(role, computation) pairs an instruction calls."""
  out = [(role, name) for role, name in re.findall(r"\b(calls|body|condition|to_apply)=%([\w.-]+)", attrs)]
  branches = re.search(r"branch_computations=\{([^}]*)\}", attrs)
  if branches:
    out += [("branch", n) for n in re.findall(r"%([\w.-]+)", branches.group(1))]
  return out


def run_counts(computations: dict[str, list[_Instr]], entry: str) -> tuple[dict[str, float], set[str]]:
  """(times each computation runs per step, the computations whose instructions are device-level ops:
  entry, loop bodies and conditions, called and branch computations; not fusions or reducers)."""
  edges: dict[str, list[tuple[str, float]]] = defaultdict(list)
  indegree: dict[str, int] = defaultdict(int)
  scheduled = {entry}
  for name, instrs in computations.items():
    by_name = {i.name: i for i in instrs}
    for instr in instrs:
      trips = _trip_count(instr, computations, by_name) if instr.opcode == "while" else 1
      for role, child in _called(instr.attrs):
        if child not in computations:
          continue
        edges[name].append((child, trips if role in ("body", "condition") else 1))
        indegree[child] += 1
        if role in ("body", "condition", "branch") or (role == "calls" and instr.opcode in ("call", "async-start")):
          scheduled.add(child)
  runs: dict[str, float] = defaultdict(float)
  runs[entry] = 1.0
  ready = [n for n in computations if indegree[n] == 0]
  while ready:  # topological order over the call graph (a DAG)
    name = ready.pop()
    for child, factor in edges[name]:
      runs[child] += runs[name] * factor
      indegree[child] -= 1
      if indegree[child] == 0:
        ready.append(child)
  return dict(runs), scheduled


def _matmul_flops(instr: _Instr, shapes: dict[str, str]) -> float:
  out = math.prod(_dims(instr.shape))
  if instr.opcode == "dot":
    lhs = _dims(shapes.get(instr.operands[0], "")) if instr.operands else []
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instr.attrs)
    k = math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i) if contracting and lhs else 1
    return 2.0 * out * k
  if instr.opcode == "convolution" and len(instr.operands) > 1:
    return _convolution_flops(instr, shapes)
  return 0.0


def _convolution_flops(instr: _Instr, shapes: dict[str, str]) -> float:
  """2 x (batch x output features x input features) x, per spatial dim, the (output, tap) pairs that land inside
  the input. XLA's TPU matmuls are convolutions whose spatial dims often carry a batch dim as a fully padded,
  reversed window: counting only the taps that touch real input gets those right (one tap per output)."""
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instr.attrs)
  lhs, rhs = _dims(shapes.get(instr.operands[0], "")), _dims(shapes.get(instr.operands[1], ""))
  out = _dims(instr.shape)
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


def _attention_dims(instr: _Instr, shapes: dict[str, str]) -> tuple[int, ...]:
  """(batch, query heads, query length, key length, head dim) of a splash kernel from its operands: the queries
  are the largest [..., heads, length, head_dim] operand, the keys' length the longest such operand's."""
  arrays = []
  for operand in instr.operands:
    for _, dims in _ARRAY.findall(shapes.get(operand, "")):
      d = [int(x) for x in dims.split(",") if x]
      if len(d) >= 3:
        arrays.append(d)
  if not arrays:
    return ()
  q = max(arrays, key=lambda d: (math.prod(d), d[-3]))
  return math.prod(q[:-3]), q[-3], q[-2], max(d[-2] for d in arrays if d[-1] == q[-1]), q[-1]


def splash_kernel_flops(attention: tuple, block_q: int, block_kv: int, fused_backward: bool = False) -> float:
  """Matmul FLOPs one run of a splash kernel does. It skips the (block_q x block_kv) blocks the causal mask rules out
  and computes the others whole: the diagonal blocks too. The forward does 2 matmuls per block (q.k, p.v); the dq
  kernel 3 (q.k again, do.v, ds.k); the dkv kernel 4 (q.k again, p.do, do.v, ds.q), 5 when it also makes dq
  (the fused backward). With the queries split over sequence shards the last shard, which sees every key, is costed."""
  phase, batch, heads, q_len, kv_len, head_dim = attention
  first_row = kv_len - q_len  # the last shard's first query position
  pairs = 0
  for start in range(0, q_len, block_q):
    last_key = first_row + min(start + block_q, q_len)  # the keys this query block sees end here
    pairs += block_q * math.ceil(last_key / block_kv) * block_kv
  matmuls = {"fwd": 2, "dq": 3, "dkv": 5 if fused_backward else 4}[phase]
  return 2.0 * matmuls * batch * heads * pairs * head_dim


def _custom_call_flops(instr: _Instr) -> float:
  """Pallas kernels (splash attention) carry their own cost estimate in the backend config."""
  found = re.search(r'"flops"\s*:\s*"?(\d+)', instr.attrs) or re.search(r"flops[\"']?\s*[:=]\s*(\d+)", instr.attrs)
  return float(found.group(1)) if found else 0.0


def _group_axes(attrs: str, mesh_axes: Sequence[str], mesh_shape: Sequence[int]) -> tuple[tuple[str, ...], int]:
  """(mesh axes a collective's groups span, group size) from its replica_groups, in any of XLA's three spellings."""
  named = re.search(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", attrs
  )
  if named:  # mesh['axis_0'=4,'axis_1'=2][, device_ids=([2,4]T(1,0))] {'axis_0'}: XLA's device mesh, the axes used
    sizes = dict((n, int(s)) for n, s in re.findall(r"'([\w]+)'=(\d+)", named.group(1)))
    chosen = [list(sizes).index(a) for a in re.findall(r"'([\w]+)'", named.group(4))]
    ids = np.arange(math.prod(sizes.values()))
    if named.group(2):  # the mesh's devices in order: an iota reshaped and transposed
      ids = ids.reshape([int(d) for d in named.group(2).split(",")])
      ids = ids.transpose([int(p) for p in named.group(3).split(",")]) if named.group(3) else ids
    ids = ids.reshape(list(sizes.values()))
    rest = [i for i in range(ids.ndim) if i not in chosen]
    groups = ids.transpose(rest + chosen).reshape(-1, math.prod(ids.shape[i] for i in chosen))
  else:
    groups = _replica_groups(attrs)
  if groups is None or groups.size == 0:
    return (), 1
  coords = np.stack(np.unravel_index(groups[0] % math.prod(mesh_shape), tuple(mesh_shape)), axis=-1)
  varying = tuple(a for i, a in enumerate(mesh_axes) if len(set(coords[:, i])) > 1)
  return varying, int(groups.shape[1])


def _replica_groups(attrs: str) -> np.ndarray | None:
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if iota:
    dims = [int(d) for d in iota.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(4):
      ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
    return ids.reshape(int(iota.group(1)), int(iota.group(2)))
  explicit = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", attrs)
  if explicit:
    groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
    if groups and all(len(g) == len(groups[0]) for g in groups):
      return np.asarray(groups)
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if pairs:  # collective-permute: each pair is a group of two
    return np.asarray([[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(0))])
  return None


def _collective_kind(opcode: str) -> str:
  base = opcode.removesuffix("-start")
  return base if base in _COLLECTIVES else ""


def device_ops(text: str, mesh_axes: Sequence[str], mesh_shape: Sequence[int]) -> list[Op]:
  """The device-level instructions of the compiled step, in schedule order, with their costs."""
  computations, shapes, entry = parse_computations(text)
  runs, scheduled = run_counts(computations, entry)
  flops_in: dict[str, float] = {}

  def computation_flops(name: str) -> float:  # matmul FLOPs of a fusion body, nested fusions included
    if name not in flops_in:
      flops_in[name] = 0.0  # guards against recursion
      total = 0.0
      for instr in computations.get(name, []):
        total += _matmul_flops(instr, shapes)
        if instr.opcode == "fusion":
          total += sum(computation_flops(c) for _, c in _called(instr.attrs))
      flops_in[name] = total
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
        inside = tuple(c for role, c in _called(instr.attrs) if role in ("body", "calls", "branch"))
        ops.append(Op(instr.name, instr.opcode, name, runs[name], runs_inside=inside))
        continue
      if instr.opcode in _FREE:
        continue
      op = Op(instr.name, instr.opcode, name, runs[name])
      op.hbm_bytes = _hbm_bytes(instr, computations, shapes)
      op.flops = _matmul_flops(instr, shapes)
      if instr.opcode == "fusion":
        op.flops += sum(computation_flops(c) for _, c in _called(instr.attrs))
      elif instr.opcode == "custom-call":
        op.flops += _custom_call_flops(instr)
        op.grouped_matmul = bool(_GROUPED_MATMUL.search(instr.attrs))
        splash = _SPLASH.match(instr.name)
        dims = _attention_dims(instr, shapes) if splash else ()
        op.attention = (splash.group(1), *dims) if dims else ()
      if instr.opcode in _TRANSFERS:
        op.transfer = "host" if _HOST_MEMORY in instr.shape else "hbm"
        op.moved_bytes, op.hbm_bytes = _transfer_bytes(instr, shapes), 0.0
        pending[instr.name] = op
      kind, carrier = _collective_kind(instr.opcode), instr
      if instr.opcode == "async-start":
        inner = [i for _, c in _called(instr.attrs) for i in computations.get(c, [])]
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
        op.axes, op.group_size = _group_axes(carrier.attrs, mesh_axes, mesh_shape)
        op.moved_bytes = _moved_bytes(kind, carrier, shapes, op.group_size)
        op.hbm_bytes = 0.0  # a collective's time is its link time (below); its HBM traffic overlaps it
        if instr.opcode.endswith("-start"):
          pending[instr.name] = op
        elif fused_async == "start":
          pending.update({ch: op for ch in channels})
      ops.append(op)
    ops[first:] = _permutes_as_transfers(ops[first:], computations[name])
  return ops


def _permutes_as_transfers(ops: list[Op], body: list[_Instr]) -> list[Op]:
  """A computation's ops with each synchronous collective-permute moved to where its input is ready and waited for
  just before its first user (a zero-cost `<name>.wait` op).

  A collective-permute sends one buffer to a neighbour: a DMA over one link, which the core does not run. XLA's
  windowed einsum loops (Wang et al., ASPLOS 2023, "Overlap communication with dependent computation via
  decomposition in large deep learning models") rely on this: each trip sends the next shard while the core
  multiplies the current one, and libtpu leaves these permutes synchronous in the HLO. Compute stays in the
  schedule's order; only the transfer is placed by its data dependencies.
  """
  by_name = {i.name: i for i in body}
  users: dict[str, list[_Instr]] = defaultdict(list)
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


def _body(instr: _Instr, computations: dict[str, list[_Instr]]) -> list[_Instr]:
  return computations.get(next((c for r, c in _called(instr.attrs) if r == "calls"), ""), [])


def _carried(instr: _Instr, computations: dict[str, list[_Instr]]) -> tuple[list[_Instr], set[str]]:
  """(the collectives inside a fusion, their channel ids)."""
  if instr.opcode != "fusion":
    return [], set()
  carried = [i for i in _body(instr, computations) if _collective_kind(i.opcode)]
  channels = {m.group(1) for i in carried if (m := re.search(r"channel_id=(\d+)", i.attrs))}
  return carried, channels


def _in_flight(instr: _Instr, carried: list[_Instr], computations: dict[str, list[_Instr]]) -> bool:
  """True for a fusion that only passes its collectives' results out (an async one continues past it)."""
  body = _body(instr, computations)
  root = body[-1] if body else None
  if root is None or root.opcode != "tuple":
    return False
  users = [i for i in body for c in carried if c.name in i.operands]
  return all(u is root for u in users)


def _fused_async(instr: _Instr, computations: dict[str, list[_Instr]]) -> str:
  """ "start" or "done" for the two ends of a TPU async collective fusion, else ""."""
  if instr.opcode != "fusion":
    return ""
  for inner in _body(instr, computations):
    if inner.opcode == "custom-call":
      if 'custom_call_target="AsyncCollectiveStart"' in inner.attrs:
        return "start"
      if 'custom_call_target="AsyncCollectiveDone"' in inner.attrs:
        return "done"
  return ""


def _hbm_bytes(instr: _Instr, computations: dict[str, list[_Instr]], shapes: dict[str, str]) -> float:
  """Bytes an op reads and writes in HBM: its operands and result, except that a slice of a big buffer reads only
  the slice and an in-place update (the scan's per-layer stacking) writes only the update."""
  inner = _body(instr, computations)
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


def _transfer_bytes(instr: _Instr, shapes: dict[str, str]) -> float:
  """What an async copy moves. Its shape is (its operands, the result, a context scalar): the result is the copied
  buffer or the slice cut from a (host-offloaded) stack; an in-place update moves its update, not the stack."""
  if instr.opcode == "dynamic-update-slice-start":
    return float(array_bytes(shapes.get(instr.operands[1], ""))) if len(instr.operands) > 1 else 0.0
  operands = sum(array_bytes(shapes.get(o, "")) for o in instr.operands)
  context = array_bytes(_ARRAY.findall(instr.shape)[-1][0] + "[]") if _ARRAY.search(instr.shape) else 0
  return float(max(array_bytes(instr.shape) - operands - context, 0))


def _params(body: list[_Instr]) -> dict[int, str]:
  return {int(i.args): i.name for i in body if i.opcode == "parameter" and i.args.isdigit()}


def _value_read(body: list[_Instr], value: str, full: int, computations: dict[str, list[_Instr]]) -> float:
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
    elif use.opcode == "fusion" and (nested := _body(use, computations)):
      inner_params = _params(nested)
      read += sum(
        _value_read(nested, inner_params[k], full, computations)
        for k, o in enumerate(use.operands)
        if o == value and k in inner_params
      )
    else:
      return full
  return read


def _moved_bytes(kind: str, instr: _Instr, shapes: dict[str, str], n: int) -> float:
  """Bytes one device sends in a ring (bandwidth-optimal) implementation of the collective. A combined collective
  (several arrays in one op, a tuple) moves all of them."""
  operand = sum(array_bytes(shapes.get(o, "")) for o in instr.operands)
  if n <= 1:
    return 0.0
  share = (n - 1) / n
  if kind == "all-gather":
    gathered = array_bytes(instr.shape)
    if instr.opcode.endswith("-start"):  # an async start's result holds its operands as well as the gathered arrays
      gathered -= operand
    return gathered * share
  if kind == "all-reduce":
    return 2.0 * operand * share
  if kind in ("reduce-scatter", "all-to-all"):
    return operand * share
  return float(operand)  # collective-permute: each device sends its buffer once


def summary(ops: Sequence[Op]) -> dict[str, float]:
  """Totals per step (for reports and tests)."""
  out = {"flops": 0.0, "hbm_bytes": 0.0, "collective_bytes": 0.0}
  for op in ops:
    out["flops"] += op.flops * op.runs
    out["hbm_bytes"] += op.hbm_bytes * op.runs
    out["collective_bytes"] += op.moved_bytes * op.runs if op.collective else 0.0
  return out

"""XLA's HLO text read into computations of instructions: shapes, called computations, how often each runs per step
(loop trip counts) and which devices each collective groups.

Only what the cost reader (hlo_costs.py) needs, and nothing about costs. Where the text cannot be read (a loop
without a readable bound, replica groups in a spelling not known here), the answer is a conservative stand-in
reported with it (run_counts' assumptions; hlo_costs turns them into `Op.assumed`), never a silent 1.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
BYTES.update({"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16})
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s+\((.*)\)\s+->\s+.*\{\s*$")

Computations = dict[str, list["Instr"]]


@dataclasses.dataclass
class Instr:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  attrs: str
  args: str = ""  # the text between the parentheses (a constant's value)


def arrays(shape: str) -> list[tuple[str, list[int]]]:
  """(element type, dims) of each array in a shape (a tuple has several)."""
  return [(t, [int(d) for d in dims.split(",") if d]) for t, dims in _ARRAY.findall(shape)]


def array_bytes(shape: str) -> int:
  return sum(BYTES.get(t, 4) * math.prod(dims) for t, dims in arrays(shape))


def dims(shape: str) -> list[int]:
  """The dims of the first array in a shape."""
  found = arrays(shape)
  return found[0][1] if found else []


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


def _parse_instruction(line: str) -> Instr | None:
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
  return Instr(match.group(1), shape, opcode_match.group(1), operands, rest[close:], args)


def parse_computations(text: str) -> tuple[Computations, dict[str, str], str]:
  """(computation -> instructions in order, value name -> shape, entry computation name)."""
  computations: Computations = {}
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


def called(attrs: str) -> list[tuple[str, str]]:
  """(role, computation) pairs an instruction calls."""
  out = [(role, name) for role, name in re.findall(r"\b(calls|body|condition|to_apply)=%([\w.-]+)", attrs)]
  branches = re.search(r"branch_computations=\{([^}]*)\}", attrs)
  if branches:
    out += [("branch", n) for n in re.findall(r"%([\w.-]+)", branches.group(1))]
  return out


def fused_body(instr: Instr, computations: Computations) -> list[Instr]:
  """The instructions of the computation a fusion (or call) runs; [] for other ops."""
  return computations.get(next((c for r, c in called(instr.attrs) if r == "calls"), ""), [])


def _trip_count(instr: Instr, computations: Computations, parent: dict[str, Instr]) -> int | None:
  """XLA's known trip count; else (TPU) from the loop itself: `counter < N` in the condition, the counter's
  increment in the body (windowed einsums step by 2) and its start in the while's operand tuple (else 0). None if
  the loop has neither."""
  found = re.search(r'"known_trip_count":\{"n":"(\d+)"', instr.attrs)
  if found:
    return int(found.group(1))
  names = dict(re.findall(r"\b(condition|body)=%([\w.-]+)", instr.attrs))
  condition, body = computations.get(names.get("condition"), []), computations.get(names.get("body"), [])
  bound, index, inclusive = _loop_bound(condition)
  if bound is None:
    return None
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


def _constant(instr: Instr | None) -> int | None:
  if instr is None or instr.opcode != "constant" or not re.fullmatch(r"-?\d+", instr.args):
    return None
  return int(instr.args)


def _loop_bound(condition: list[Instr]) -> tuple[int | None, int, int]:
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


def run_counts(computations: Computations, entry: str) -> tuple[dict[str, float], set[str], dict[str, str]]:
  """(times each computation runs per step, the computations whose instructions are device-level ops: entry, loop
  bodies and conditions, called and branch computations, not fusions or reducers; and for each loop whose trip count
  could not be read, what was assumed instead: the largest trip count read in the program, so that an unread loop
  never makes a plan look cheaper than the loops that could be read)."""
  trips: dict[tuple[str, str], int | None] = {}
  for name, instrs in computations.items():
    by_name = {i.name: i for i in instrs}
    for instr in instrs:
      if instr.opcode == "while":
        trips[(name, instr.name)] = _trip_count(instr, computations, by_name)
  largest = max((t for t in trips.values() if t is not None), default=1)
  assumed = {
    loop: f"trip count unreadable: counted as {largest}, the largest in the program"
    for (_, loop), t in trips.items()
    if t is None
  }
  edges: dict[str, list[tuple[str, float]]] = defaultdict(list)
  indegree: dict[str, int] = defaultdict(int)
  scheduled = {entry}
  for name, instrs in computations.items():
    for instr in instrs:
      count = trips.get((name, instr.name)) if instr.opcode == "while" else 1
      count = largest if count is None else count
      for role, child in called(instr.attrs):
        if child not in computations:
          continue
        edges[name].append((child, count if role in ("body", "condition") else 1))
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
  return dict(runs), scheduled, assumed


def replica_groups(attrs: str, num_devices: int) -> np.ndarray | None:
  """The device groups of a collective ([groups, devices per group]) in any of XLA's spellings, or None if the
  spelling is not one of them. An empty list (`replica_groups={}`) is one group of every device for a collective
  across partitions (it has a channel_id; jit's programs have one replica) and each device alone otherwise."""
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
    return ids.transpose(rest + chosen).reshape(-1, math.prod(ids.shape[i] for i in chosen))
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if iota:
    shape = [int(d) for d in iota.group(3).split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    if iota.group(4):
      ids = ids.transpose([int(p) for p in iota.group(4).split(",")])
    return ids.reshape(int(iota.group(1)), int(iota.group(2)))
  if re.search(r"replica_groups=\{\}", attrs):
    everyone = np.arange(num_devices)
    return everyone[None, :] if "channel_id=" in attrs else everyone[:, None]
  explicit = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", attrs)
  if explicit:
    groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
    if groups and all(len(g) == len(groups[0]) for g in groups):
      return np.asarray(groups)
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if pairs:  # collective-permute: each pair is a group of two
    return np.asarray([[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(0))])
  return None

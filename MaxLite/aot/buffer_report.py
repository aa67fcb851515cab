"""What a compiled train step holds at its memory peak, each buffer named by its role, read from XLA's own dump.

XLA writes, when asked to dump a module, each value's live range over the program's schedule, the buffer assignment
(each value's size, shape and memory space) and the optimized HLO (each instruction's source op_name; the entry
parameters' op_names are the argument paths, `params['decoder']...`, `rest.opt_state[1][0].mu[...]`, `batch[...]`).
Joined, they say which values are live together at the peak and what each one is: weights, optimizer state,
gradients, the scanned layers' saved activations, logits, ...: what a user needs to change when a config does not fit.

The peak is found here from the live ranges rather than read from the dump's own "peak" section, which libtpu
writes from a schedule that leaves out most of the step (6 MiB of a 16 MiB step on v5p); the memory-usage report
is not used either: its rows are offsets in the temporary block, each shared over time by unrelated values.
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import math
import os
import re

_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_ASSIGNED = re.compile(r"^\s*value: <\d+ (\S+?)(?: \(phi\))? @\d+> \(size=(\d+),offset=\d+\): (\S+)")
_RANGE = re.compile(r"^\s+(\S+?)(\{[\d,]*\}):(\d+)-(\d+)$")
_ARRAY = re.compile(r"^(\w+)\[([\d,]*)\]")
_TILES = re.compile(r"devices=\[([\d,]+)\]")
# Transform wrappers in op names (jit(train_step), transpose(jvp(Transformer)), ...) say nothing about which
# layer made the value; the backward pass is marked instead.
_WRAPPER = re.compile(r"^\w+\(.*\)$")
# Scopes every scanned and rematerialised op passes through: they say how the layer ran, not which op it is.
_NOISE = {"while", "body", "cond", "closed_call", "checkpoint", "rematted_computation"}
_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*)$")
# Instructions that only move or re-type a value: what they hold is what their operand is.
_FORWARDING = {"copy", "convert", "bitcast", "copy-start", "copy-done", "all-gather", "all-gather-start"}
_FORWARDING |= {"all-gather-done", "reshape", "transpose", "dynamic-slice", "slice", "get-tuple-element"}

# The roles a buffer is given.
WEIGHTS = "weights"
WEIGHTS_IN_USE = "weights, gathered or cast"
FROZEN = "frozen weights"  # LoRA's base, DPO's reference
OPTIMIZER = "optimizer state"
UPDATE = "optimizer update"
GRADIENTS = "gradients"
SAVED = "saved activations"
LOGITS = "logits"
SCORES = "attention scores"
ACTIVATIONS = "activations"
ACTIVATION_GRADIENTS = "activation gradients"
BATCH = "data batch"
OTHER = "other"


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One buffer live at the peak: its bytes on one device, its role, which one it is (a parameter's path, or the op
  that made it) and its shape on one device."""

  size: int
  role: str
  what: str
  shape: str


@dataclasses.dataclass(frozen=True)
class Model:
  """What the classification needs to know about the model besides the dump: the sequence length and the
  vocabulary widths the logits may have (the whole vocabulary, or one slice of it)."""

  seq: int
  vocab: tuple[int, ...]


@dataclasses.dataclass
class _Instruction:
  opcode: str
  op_name: str
  operands: list[str]
  tiles: list[int] | None  # an entry parameter's sharding: how many shards each dimension has


def dump_flags(dump_dir: str, module: str) -> str:
  """XLA_FLAGS that make the compiler dump `module`'s optimized HLO and buffer reports into dump_dir."""
  return f" --xla_dump_to={dump_dir} --xla_dump_hlo_module_re={module} --xla_dump_hlo_pass_re=NOTHING"


def dump_dir_in(xla_flags: str) -> str | None:
  """The directory an --xla_dump_to flag already in XLA_FLAGS names (XLA keeps the last one), or None."""
  found = re.findall(r"--xla_dump_to=(\S+)", xla_flags)
  return found[-1] if found else None


def _one(dump_dir: str, suffix: str) -> str | None:
  files = sorted(glob.glob(os.path.join(dump_dir, f"*{suffix}")), key=os.path.getsize)
  return files[-1] if files else None  # several modules: the biggest is the train step itself


def allocated_bytes(dump_dir: str) -> int | None:
  """Device memory the compiled program's buffer assignment allocates (the default memory space): arguments,
  outputs that do not reuse a donated argument, and the block of temporaries, packed as the compiler packed them.

  This is what the chip must hold and what the compiler checks against its HBM. memory_analysis()'s
  temp_size_in_bytes is larger on TPU (llama2-7b on v5p-8, 2 x 8192: 10.36 GiB against a 7.40 GiB block), so
  its sum over-counts; None when the dump holds no buffer assignment."""
  path = _one(dump_dir, "after_optimizations-buffer-assignment.txt")
  if path is None:
    return None
  total = 0
  with open(path, encoding="utf-8") as f:
    for line in f:
      m = _ALLOCATION.match(line)
      if m and "color" not in m.group(2):  # other colors: on-chip scratch, host memory
        total += int(m.group(1))
  return total


def _assigned_values(path: str) -> dict[str, tuple[int, str, tuple[int, int]]]:
  """Values of the device's default memory space -> (bytes, shape without layout, (allocation, offset)). Values
  at one place that are live at once are one buffer seen under several names (a while loop's input, its body's
  parameter and its output; a donated argument and the output written over it). Thread-local values (a CPU
  fusion's scalars) and other colors (on-chip scratch, host memory) are not device memory."""
  values: dict[str, tuple[int, str, tuple[int, int]]] = {}
  counted, allocation = False, -1
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.startswith("allocation "):
        counted = "color" not in line and "thread-local" not in line
        allocation += 1
        continue
      m = _ASSIGNED.match(line) if counted else None
      if m:
        name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
        offset = int(re.search(r"offset=(\d+)", line).group(1))
        values[name] = (int(m.group(2)), m.group(3).split("{")[0], (allocation, offset))
  return values


def _live_ranges(path: str) -> dict[str, tuple[int, int]]:
  ranges = {}
  with open(path, encoding="utf-8") as f:
    inside = False
    for line in f:
      if line.strip().startswith("BufferLiveRange"):
        inside = True
      elif inside and not line.startswith("    "):
        break
      elif inside:
        m = _RANGE.match(line.rstrip("\n"))
        if m:
          ranges[m.group(1) + m.group(2)] = (int(m.group(3)), int(m.group(4)))
  return ranges


def _call_arguments(text: str) -> str:
  """`%a, %b` of `opcode(%a, %b), key=...`: the text inside the first balanced parentheses."""
  depth = 0
  for i, ch in enumerate(text):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0 and ch == ")":
      return text[: i + 1]
  return text


def _instructions(path: str) -> dict[str, _Instruction]:
  found = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      head = re.match(r"^\s*(?:ROOT )?%(\S+) = ", line)
      if head is None:
        continue
      rest = line[head.end() :]
      if rest.startswith("("):  # a tuple shape: skip it whole
        rest = rest[len(_call_arguments(rest)) :]
      else:  # an array shape (no spaces in it, TPU layouts included)
        rest = rest.split(" ", 1)[-1]
      m = re.match(r"\s*([\w\-]+)(\(.*)$", rest)
      if m is None:
        continue
      name = _OP_NAME.search(line)
      tiles = _TILES.search(line) if m.group(1) == "parameter" else None
      found[head.group(1)] = _Instruction(
        opcode=m.group(1),
        op_name=name.group(1).replace("\\'", "'") if name else "",
        operands=re.findall(r"%([\w.\-]+)", _call_arguments(m.group(2))),
        tiles=[int(t) for t in tiles.group(1).split(",")] if tiles else None,
      )
  return found


def _dims(shape: str) -> tuple[str, tuple[int, ...]]:
  m = _ARRAY.match(shape)
  if m is None:
    return "", ()
  return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


def _argument(op_name: str) -> tuple[str, str] | None:
  """(role, which) for an entry parameter's op_name (the argument's path), None for other op names."""
  path = "/".join(re.findall(r"\['([^']*)'\]", op_name))
  if op_name.startswith("params"):
    return WEIGHTS, path
  if op_name.startswith(("rest.reference", "rest.frozen")):
    return FROZEN, path
  if op_name.startswith("rest.opt_state"):
    moment = re.search(r"\.(mu|nu|count)\b", op_name)
    return OPTIMIZER, f"{moment.group(1)} of {path}" if moment and path else (moment.group(1) if moment else op_name)
  if op_name.startswith("batch"):
    return BATCH, path
  if op_name.startswith("rest."):
    return OTHER, op_name[len("rest.") :]
  return None


def _short(op_name: str) -> tuple[str, bool]:
  """(the op path without transform wrappers and scan/remat scopes, whether it computes gradients)."""
  parts = op_name.split("/")
  # A rematerialised layer's forward ops run inside the backward pass: what they make are activations again.
  backward = any(p.startswith("transpose(") for p in parts) and "rematted_computation" not in parts
  kept = [p for p in parts if not _WRAPPER.match(p)]
  kept = [p for i, p in enumerate(kept) if p not in _NOISE or i == len(kept) - 1]
  return "/".join(kept), backward


class _Classifier:
  def __init__(self, instructions: dict[str, _Instruction], model: Model):
    self._instructions = instructions
    self._model = model
    self._arguments: dict[str, tuple[str, str]] = {}
    self.local: dict[tuple[int, ...], dict[str, None]] = {}  # a weight's shape on one device -> its paths
    self.gathered: dict[tuple[int, ...], dict[str, None]] = {}  # ... fully or partly gathered, or one layer of a stack
    self.sizes: dict[int, dict[str, None]] = {}  # ... the elements of each of those shapes
    self.stacks: set[int] = set()  # leading dims of the scanned layers' weights
    self.outputs: set[str] = set()
    self._shapes: dict[str, str] = {}

  def learn(self, name: str, shape: str) -> None:
    """Entry parameters and the step's outputs (the ROOT tuple's operands), whose names the others are matched by."""
    instruction = self._instructions.get(name)
    self._shapes[name] = shape
    if instruction is None or instruction.opcode != "parameter":
      return
    argument = _argument(instruction.op_name)
    if argument is None:
      return
    self._arguments[name] = argument
    role, path = argument
    if role not in (WEIGHTS, FROZEN):
      return
    local = _dims(shape)[1]
    tiles = (instruction.tiles or [])[: len(local)]
    tiles += [1] * (len(local) - len(tiles))  # replicated
    self.local.setdefault(local, {})[path] = None
    shapes = {
      tuple(d * t if g else d for d, t, g in zip(local, tiles, gather))
      for gather in itertools.product((False, True), repeat=len(local))
    }
    if "layers" in path.split("/") and len(local) >= 2:
      self.stacks.add(local[0] * tiles[0])
      shapes |= {one[1:] for one in shapes}  # one layer of the stack, as the loop's body uses it
    for one in shapes - {local}:
      self.gathered.setdefault(one, {})[path] = None
    for one in shapes:
      self.sizes.setdefault(math.prod(one), {})[path] = None

  def classify(self, value: str, shape: str, depth: int = 0) -> tuple[str, str]:
    """(role, which one) of a value; (OTHER, ...) when neither its name, its op nor its operand tells."""
    name = value.split("{")[0]
    if name in self._arguments:
      return self._arguments[name]
    instruction = self._instructions.get(name)
    if shape.startswith("("):
      return OTHER, f"{name}'s tuple (its elements' addresses)"
    dtype, dims = _dims(shape)
    if name in self.outputs:
      new = f"new {self._which(self.local[dims])}" if dims in self.local else "the new state or a metric"
      return UPDATE, f"an output of the step: {new}"
    # An op name without a path is XLA's own name for a value it made (a hoisted cast, a copy, a loop's state).
    op, backward = _short(instruction.op_name) if instruction and "/" in instruction.op_name else ("", False)
    if not op:
      return self._by_operand(name, instruction, dtype, shape, depth)
    if dims in self.local:
      paths = self._which(self.local[dims])
      if backward:
        return GRADIENTS, paths
      if "(Transformer)" not in instruction.op_name:
        return UPDATE, paths  # the optimizer's own arithmetic (clipping, Adam), outside the model
      return WEIGHTS_IN_USE, f"{paths}, {dtype} copy"
    if dims in self.gathered:
      paths = self._which(self.gathered[dims])
      return (GRADIENTS, f"{paths}, before the reduce-scatter") if backward else (WEIGHTS_IN_USE, paths)
    count = math.prod(dims)
    # A weight reshaped, by an op of its own module (MaxLite's bfloat16 cast inside the layer loop), or a gradient
    # reshaped (the output head's, a vocabulary slice at a time).
    owned = [p for p in self.sizes.get(count, ()) if f"/{p.split('/')[-2:][0]}/" in f"/{op}/"]
    if owned:
      return (
        (GRADIENTS, f"{self._which(dict.fromkeys(owned))}, reshaped")
        if backward
        else (
          WEIGHTS_IN_USE,
          f"{self._which(dict.fromkeys(owned))}, {dtype} copy",
        )
      )
    if backward and dtype == "f32" and count in self.sizes:
      return GRADIENTS, f"{self._which(self.sizes[count])}, reshaped"
    if dims and dims[0] in self.stacks and not backward and op.startswith("decoder"):
      return SAVED, f"kept by the {dims[0]} scanned layers for the backward pass ({op})"
    if dims and any(v in dims for v in self._model.vocab):
      return LOGITS, f"{'gradient of the logits' if backward else 'logits'} ({op})"
    if len(dims) >= 3 and dims[-1] == dims[-2] == self._model.seq and "attention" in op:
      return SCORES, f"{'mask' if dtype == 'pred' else ('gradient' if backward else 'scores')} ({op})"
    return (ACTIVATION_GRADIENTS if backward else ACTIVATIONS), op

  def _by_operand(
    self, name: str, instruction: _Instruction | None, dtype: str, shape: str, depth: int
  ) -> tuple[str, str]:
    """What an XLA-made copy, cast or gather holds: what its operand is."""
    if instruction is not None and instruction.operands and depth < 4 and instruction.opcode in _FORWARDING:
      source = instruction.operands[0]
      role, what = self.classify(source + "{}", self._shapes.get(source, shape), depth + 1)
      if role in (WEIGHTS, FROZEN):
        return WEIGHTS_IN_USE, f"{what}, {dtype} {instruction.opcode}"
      if role != OTHER:
        return role, f"{what} ({instruction.opcode})"
    return OTHER, f"{name} ({instruction.opcode}, made by XLA)" if instruction else name

  @staticmethod
  def _which(found: dict[str, None]) -> str:
    paths = list(found)
    shown = " or ".join(paths[:2])
    return shown + (f" (or {len(paths) - 2} more of that shape)" if len(paths) > 2 else "")


def live_at_peak(dump_dir: str, model: Model) -> list[Buffer]:
  """Every buffer live at the step's memory peak on one device, largest first; [] when the dump lacks the reports.

  The peak is the point of the schedule where the live buffers' bytes add up to the most, a value being live from
  the instruction that defines it to its last use (or the end, for arguments and outputs)."""
  ranges_path = _one(dump_dir, "after_optimizations-live-range.txt")
  assignment = _one(dump_dir, "after_optimizations-buffer-assignment.txt")
  hlo = _one(dump_dir, "after_optimizations.txt")
  if ranges_path is None or assignment is None or hlo is None:
    return []
  values, ranges = _assigned_values(assignment), _live_ranges(ranges_path)
  groups = _buffers(values, {v: r for v, r in ranges.items() if v in values})
  if not groups:
    return []
  change = [0] * (max(stop for _, stop, _, _ in groups) + 2)
  for start, stop, size, _ in groups:
    change[start] += size
    change[stop + 1] -= size
  live, peak, peak_at = 0, -1, 0
  for t, delta in enumerate(change):
    live += delta
    if live > peak:
      peak, peak_at = live, t
  instructions = _instructions(hlo)
  classifier = _Classifier(instructions, model)
  for value, (_, shape, _) in values.items():
    classifier.learn(value.split("{")[0], shape)
  classifier.outputs = {n for n in _root_operands(hlo) if n in instructions and instructions[n].opcode != "parameter"}
  buffers = []
  for start, stop, size, names in groups:
    if start <= peak_at <= stop:
      # The names live at the peak first, then the buffer's others, the first that says what the buffer is.
      ordered = sorted(names, key=lambda v: not ranges[v][0] <= peak_at <= ranges[v][1])
      named = [(classifier.classify(v, values[v][1]), values[v][1]) for v in ordered]
      (role, what), shape = next((n for n in named if n[0][0] != OTHER), named[0])
      buffers.append(Buffer(size, role, what, shape))
  return sorted(buffers, key=lambda b: (-b.size, b.role, b.what))


def _buffers(
  values: dict[str, tuple[int, str, tuple[int, int]]], ranges: dict[str, tuple[int, int]]
) -> list[tuple[int, int, int, list[str]]]:
  """(first, last time, bytes, its values' names) of each buffer: the values at one place whose live ranges
  overlap, a chain such as a scan's zeros -> the loop's state -> its output."""
  by_place: dict[tuple[int, int], list[str]] = {}
  for value in ranges:
    by_place.setdefault(values[value][2], []).append(value)
  out = []
  for names in by_place.values():
    names.sort(key=lambda v: ranges[v])
    group: list[str] = []
    for name in names:
      if group and ranges[name][0] > max(ranges[v][1] for v in group):
        out.append(_group(group, values, ranges))
        group = []
      group.append(name)
    out.append(_group(group, values, ranges))
  return out


def _group(names: list[str], values: dict, ranges: dict) -> tuple[int, int, int, list[str]]:
  start = min(ranges[v][0] for v in names)
  stop = max(ranges[v][1] for v in names)
  return start, stop, max(values[v][0] for v in names), names


def _root_operands(path: str) -> list[str]:
  """The names the entry computation returns (the step's new state and metrics)."""
  entry = False
  with open(path, encoding="utf-8") as f:
    for line in f:
      entry = entry or line.startswith("ENTRY ")
      if entry and line.lstrip().startswith("ROOT "):
        return re.findall(r"%([\w.\-]+)", _call_arguments(line.split(" tuple", 1)[-1]))
  return []


def by_role(buffers: list[Buffer]) -> list[tuple[str, int, int]]:
  """(role, bytes, how many buffers) for each role present, largest first."""
  totals: dict[str, list[int]] = {}
  for b in buffers:
    entry = totals.setdefault(b.role, [0, 0])
    entry[0] += b.size
    entry[1] += 1
  return sorted(((role, n, count) for role, (n, count) in totals.items()), key=lambda t: -t[1])


def size_text(n: float) -> str:
  """Bytes with a unit small enough to tell a norm's scale from nothing: 1.34 GiB, 2.02 MiB, 561.3 KiB, 512 B."""
  for unit, scale, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 2), ("KiB", 2**10, 1)):
    if n >= scale:
      return f"{n / scale:.{digits}f} {unit}"
  return f"{int(n)} B"


def format_report(buffers: list[Buffer], count: int = 10) -> list[str]:
  """The peak's bytes by role, then its `count` largest buffers, one per line."""
  if not buffers:
    return []
  total = sum(b.size for b in buffers)
  lines = [f"live at the memory peak, per device: {size_text(total)} in {len(buffers)} buffers, by role:"]
  for role, n, how_many in by_role(buffers):
    lines.append(f"  {role:<26} {size_text(n):>10}  ({how_many} buffer{'s' if how_many > 1 else ''})")
  lines.append(f"the {min(count, len(buffers))} largest (size per device, role, shape on one device: which one):")
  for b in buffers[:count]:
    lines.append(f"  {size_text(b.size):>10}  {b.role:<26} {b.shape}: {b.what}")
  return lines


def shrink_hints(buffers: list[Buffer], attention: str) -> list[str]:
  """For a config that does not fit: which keys would shrink each kind of large buffer (largest kind first, one line
  per kind), judged from the buffers' roles."""
  hints: dict[str, str] = {}
  for role, _, _ in by_role(buffers):
    if role == SCORES and attention != "splash":
      hints.setdefault(role, "attention=splash (never holds the [seq, seq] attention scores)")
    elif role == LOGITS:
      hints.setdefault(role, "num_vocab_tiling=N (the float32 logits a chunk of tokens at a time)")
    elif role == SAVED:
      hints.setdefault(
        role,
        "remat_policy=full, or remat_policy=custom decoder_layer_input=offload (the activations each layer keeps for "
        "the backward pass); per_device_batch_size or max_target_length",
      )
    elif role in (GRADIENTS, OPTIMIZER, WEIGHTS, WEIGHTS_IN_USE, UPDATE):
      hints.setdefault(
        "state",
        "more ici_fsdp_parallelism (splits the weights, their gradients and optimizer state further), or "
        "parameter_memory_host_offload / optimizer_memory_host_offload=true",
      )
  return list(hints.values())

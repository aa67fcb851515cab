"""The train step compiled ahead of time for a topology (a TPU slice, or cpu-N), and the report of what it needs.

Compiling needs only the backend's compiler (libtpu for TPU targets, never a TPU): `prepare_backend` points jax at
it, `target_devices` makes the slice's devices, `lower_train_step` lowers the real step with the real shardings,
and `report` reads the compiled program's memory, FLOPs and largest buffers. `run` is train_compile.py's body.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from MaxLite import config as config_lib
from MaxLite import storage
from MaxLite.aot import buffer_report
from MaxLite.cli import ticker
from MaxLite.cli.errors import ConfigError
from MaxLite.config import choices
from MaxLite.parallel import topologies

DOES_NOT_FIT = 3


def prepare_backend(target: topologies.Target, repo: str | None = None, dump_dir: str | None = None) -> None:
  """Environment for the target; must run before jax is imported. dump_dir: where XLA writes the train
  step's buffer reports (for the largest-buffers table)."""
  libtpu = topologies.find_libtpu(repo or storage.bundled_root()) if target.platform == "tpu" else None
  if target.platform == "tpu" and libtpu is None:
    raise ConfigError(
      f"compile_topology={target.name} needs libtpu (compile-only, no TPU required): run "
      "`bash setup.sh` (installs it into .deps/libtpu) or `pip install 'libtpu==0.0.42.*'`, "
      "or set TPU_LIBRARY_PATH to a libtpu.so"
    )
  os.environ["JAX_PLATFORMS"] = "cpu"  # the host backend only: no attempt to open a local TPU
  if dump_dir:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + buffer_report.dump_flags(dump_dir, "train_step")
  if libtpu is not None:
    os.environ["TPU_LIBRARY_PATH"] = libtpu
    os.environ["LIBTPU_INIT_ARGS"], source = topologies.libtpu_init_args(target.chip.family, os.environ)
    os.environ["MAXLITE_LIBTPU_FLAGS_SOURCE"] = source  # for the report
    # Without these, libtpu probes the cloud metadata server for a local TPU and logs errors when it
    # finds none; compiling for a named topology needs no local TPU.
    for key, value in (
      ("TPU_SKIP_MDS_QUERY", "1"),
      ("TPU_ACCELERATOR_TYPE", target.name),
      ("TPU_WORKER_HOSTNAMES", "localhost"),
      ("TPU_WORKER_ID", "0"),
      # Compiling opens no chip, so two compiles on one machine (plan workers, parallel tests) may load libtpu at once.
      ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
    ):
      os.environ.setdefault(key, value)
  else:
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={target.num_devices}"
    )


def target_devices(target: topologies.Target, num_slices: int) -> list[Any]:
  import jax

  if target.platform == "cpu":
    if num_slices != 1:
      raise ConfigError("compile_topology_num_slices must be 1 for cpu-N")
    return jax.devices()[: target.num_devices]
  from jax.experimental import topologies as jax_topologies

  kwargs = {"chip_config_name": target.chip.chip_config_name} if target.chip.chip_config_name else {}
  if num_slices > 1:
    kwargs["num_slices"] = num_slices
  return list(jax_topologies.get_topology_desc(platform="tpu", topology_name=target.topology_name, **kwargs).devices)


def lower_train_step(config: Any, devices: Sequence[Any]) -> tuple[Any, dict]:
  """(lowered train step, {per-device bytes of params and optimizer state, parameter count}) for `config`."""
  import jax
  import jax.numpy as jnp
  from flax.linen import partitioning as nn_partitioning

  from MaxLite.config import objectives
  from MaxLite.data import BATCH_KEYS
  from MaxLite.parallel import sharding
  from MaxLite.parallel.mesh import create_mesh
  from MaxLite.training import builder

  mesh = create_mesh(config, devices)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding.axis_rules(config)):
    pieces = builder.training(config, mesh)
    abstract, shardings = pieces.abstract, pieces.shardings
    ids = jax.ShapeDtypeStruct((config.global_batch_size_to_load, config.max_target_length), jnp.int32)
    batch = {k: ids for k in BATCH_KEYS}
    # The objective's own arrays (GRPO's advantages: the update step; its sampler is a program of its own).
    batch |= {k: jax.ShapeDtypeStruct(ids.shape, jnp.float32) for k in objectives.of(config).batch_keys(config)}
    lowered = pieces.step.lower(abstract, batch)
  state_bytes = {
    "params": sharding.sharded_bytes(abstract.params, shardings.params),
    # LoRA: the frozen base (QLoRA: as Qwix stores it); `params` are then the adapters
    "frozen": sharding.sharded_bytes(abstract.frozen, shardings.frozen) if abstract.frozen is not None else 0,
    "optimizer": sharding.sharded_bytes(abstract.opt_state, shardings.opt_state),
    "parameters": sum(leaf.size for leaf in jax.tree.leaves(abstract.params)),  # counted from the model itself
  }
  return lowered, state_bytes


LOW_PRECISION = ("s8", "u8", "f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz")
_INSTRUCTION = re.compile(r"(?:ROOT )?%([\w.\-]+) = (\w+)\[")
_DOT = re.compile(r"\b(?:dot|convolution)\(%([\w.\-]+), %([\w.\-]+)\)")


def dot_operand_types(hlo_text: str) -> dict[tuple[str, str], int]:
  """How many dot (and convolution) instructions of a compiled module's text take each pair of operand types
  (s8 x s8 for int8 matmuls, f8e4m3fn x ... for fp8), fused computations included. The text names operands without
  their types, so each computation's instructions are read first."""
  counts: dict[tuple[str, str], int] = {}
  types: dict[str, str] = {}
  for line in hlo_text.splitlines():
    text = line.strip()
    if text.endswith("{") and "=" not in text.split("(")[0]:  # a computation's header: its own names follow
      types = {}
      continue
    instruction = _INSTRUCTION.match(text)
    if instruction is None:
      continue
    types[instruction.group(1)] = instruction.group(2)
    dot = _DOT.search(text)
    if dot:
      key = (types.get(dot.group(1), "?"), types.get(dot.group(2), "?"))
      counts[key] = counts.get(key, 0) + 1
  return counts


def shrink_hint(oom: str, state_bytes: int, hbm_bytes: int | None) -> str:
  """The keys that would make a program that does not fit smaller, by what ran out."""
  if "smem" in oom.lower():  # the splash kernel's block map lives in the core's scalar memory (1 MiB on v5p)
    return (
      "larger splash blocks (sa_block_q / sa_block_kv, and the backward's sa_block_q_dkv / sa_block_kv_dkv and "
      "sa_block_q_dq / sa_block_kv_dq): each kernel keeps a map of its query x key blocks in the core's scalar memory "
      "(SMEM), which a long sequence fills"
    )
  if hbm_bytes is not None and state_bytes > hbm_bytes / 2:
    return "more ici_fsdp_parallelism, parameter_memory_host_offload / optimizer_memory_host_offload=true"
  return "remat_policy (full, or custom with decoder_layer_input=offload), per_device_batch_size, num_vocab_tiling"


def out_of_memory(message: str) -> str | None:
  """The compiler's out-of-HBM error as one line with the shortfall, or None for other errors."""
  if "RESOURCE_EXHAUSTED" not in message:
    return None
  first = next((line for line in message.splitlines() if "RESOURCE_EXHAUSTED" in line), message)
  first = first[first.index("RESOURCE_EXHAUSTED") :]
  sizes = [float(v) * 1024 ** "KMGT".index(u) * 1024 for v, u in re.findall(r"\(([\d.]+)([KMGT])\)", first)]
  if len(sizes) >= 2 and sizes[0] > sizes[1]:
    needed, available = sizes[0], sizes[1]
    return (
      f"DOES NOT FIT: needs {_gib(needed)} per device, {_gib(available)} available; "
      f"short by {_gib(needed - available)} ({first})"
    )
  return f"DOES NOT FIT: {first}"


def memory_total(mem: Any, space: str) -> int:
  """memory_analysis()'s sum for one memory space ("" = device, "host_"): arguments + outputs - the outputs that
  reuse donated arguments + temporaries. MaxText's train_compile prints this figure for the device; on TPU it
  over-counts the temporaries (see device_bytes)."""
  size = lambda kind: getattr(mem, f"{space}{kind}_size_in_bytes")
  return size("argument") + size("output") - size("alias") + size("temp")


def device_bytes(mem: Any, allocated: int | None = None) -> tuple[int, str]:
  """(bytes of device memory the program needs, where the figure comes from).

  The compiler's buffer assignment (`allocated`, read from its dump) when there is one: libtpu's
  temp_size_in_bytes exceeds the temporaries it allocates, and the compiler builds programs that memory_analysis()'s
  sum says do not fit (llama2-7b on v5p-8 at 21 x 8192: the sum 113.65 GiB, the allocation 91.82, on a 95.74 GiB
  chip; at 24 x 8192 its out-of-memory error names 101.26 GiB, where the allocation grows to). Without a dump, the
  sum (an upper bound; memory_analysis()'s peak_memory_in_bytes leaves out the temporaries on CPU)."""
  if allocated:
    return allocated, "the compiler's buffer assignment"
  return memory_total(mem, ""), "memory_analysis() sum"


def model_dims(config: Any) -> buffer_report.Model:
  """The sequence length and the widths the logits may have on one device: the vocabulary, a slice of it
  (num_vocab_slices), either split over the tensor axis."""
  tensor = dict(zip(choices.MESH_AXES, config.mesh_shape)).get("tensor", 1)
  slices = max(config.num_vocab_slices, 1)
  widths = {config.vocab_size // k for k in (1, slices, tensor, slices * tensor)}
  return buffer_report.Model(seq=config.max_target_length, vocab=tuple(sorted(widths)))


def _where(offloaded: bool) -> str:
  return " in host memory (offloaded)" if offloaded else ""


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _tflop(n: float) -> str:
  return f"{n / 1e12:.2f} TFLOP" if n >= 1e12 else f"{n / 1e9:.2f} GFLOP"


# A while loop in HLO text: `%while.12 = (...) while(%tuple.3), condition=..., body=...`.
_WHILE = re.compile(r"\swhile\(")


def flops_line(compiled_flops: float, model_flops: float, loops: int, scan_layers: bool) -> str:
  """The report's FLOPs line. XLA's cost_analysis() counts a while loop's body once, whatever its trip count (a
  scanned 32-layer stack as one layer, on CPU and TPU alike), so with a loop in the program its figure is not the
  step's work and is left out rather than printed beside the model's."""
  if not loops:
    return (
      f"FLOPs per device per step: compiled {_tflop(compiled_flops)}, model {_tflop(model_flops)} "
      "(compiled includes rematerialisation and non-matmul work)"
    )
  what = "the scanned layers among them" if scan_layers else "gradient accumulation, chunked logits or MLPs"
  return (
    f"FLOPs per device per step: model {_tflop(model_flops)} (XLA's compiled count is left out: it counts a loop's "
    f"body once, and this step runs {loops} loop{'s' if loops > 1 else ''}, {what}; scan_layers=false without "
    "loops gives the full count)"
  )


def report(
  config: Any,
  target: topologies.Target,
  compiled: Any,
  state_bytes: dict,
  seconds: float,
  buffers: Sequence[buffer_report.Buffer] = (),  # every buffer live at the memory peak
  allocated: int | None = None,
) -> tuple[str, bool]:
  """The printed summary and whether the step fits in the chip's HBM."""
  from MaxLite.models import flops

  mem = compiled.memory_analysis()
  (needed, source), host = device_bytes(mem, allocated), memory_total(mem, "host_")
  summed = memory_total(mem, "")
  temporaries = needed - (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  compiled_flops = float(cost.get("flops", 0.0)) if cost else 0.0
  model_flops = flops.tflops_per_device_per_step(config) * 1e12  # every ensemble member's

  mesh = " x ".join(f"{a}={n}" for a, n in zip(choices.MESH_AXES, config.mesh_shape) if n > 1) or "1"
  tokens = config.global_batch_size_to_train_on * config.ensemble_size * config.max_target_length
  members = f" x {config.ensemble_size} ensemble members" if config.ensemble_size > 1 else ""
  lines = [
    f"compiled train step for {target.name} x {config.num_slices} slice(s) ({config.num_devices} devices, "
    f"mesh {mesh}) in {seconds:.1f} s",
    f"model {config.model_name}: {state_bytes['parameters'] // config.ensemble_size:,} parameters{members}, global "
    f"batch {config.global_batch_size_to_train_on} x {config.max_target_length} tokens{' each' if members else ''}, "
    f"dtype {config.dtype}, "
    f"weights {config.weight_dtype}, remat {config.remat_policy}, attention {config.attention_kernel}",
    *([_context_line(config)] if config.sequence_shards > 1 else []),
    "per device:",
    f"  params          {_gib(state_bytes['params'])}{_where(config.parameter_memory_host_offload)}"
    + (" (the LoRA adapters, which train)" if config.enable_lora else ""),
    *([f"  frozen base     {_gib(state_bytes['frozen'])}{_quantized_as(config)}"] if config.enable_lora else []),
    f"  optimizer state {_gib(state_bytes['optimizer'])}{_where(config.optimizer_memory_host_offload)}",
    f"  arguments       {_gib(mem.argument_size_in_bytes)} (state + batch, donated: "
    f"{_gib(mem.alias_size_in_bytes)} reused for outputs)",
    f"  outputs         {_gib(mem.output_size_in_bytes)}",
    f"  temporaries     {_gib(temporaries)} (activations, gradients, collectives)",
    f"  total needed    {_gib(needed)} of device memory ({source})",
    f"  memory_analysis() sum {_gib(summed)} (MaxText's 'total estimated memory'; counts temporaries as "
    f"{_gib(mem.temp_size_in_bytes)})",
    f"  host memory     {_gib(host)} (arguments {_gib(mem.host_argument_size_in_bytes)}, temporaries "
    f"{_gib(mem.host_temp_size_in_bytes)}: host-offloaded state and activations)",
  ]
  if target.platform == "tpu":
    flags = os.environ.get("LIBTPU_INIT_ARGS", "")
    source = os.environ.get("MAXLITE_LIBTPU_FLAGS_SOURCE", "LIBTPU_INIT_ARGS from the environment")
    lines += [f"XLA flags ({source}): {flags or '(none)'}"]
  lines += buffer_report.format_report(list(buffers))
  if buffers and target.chip is not None and needed > target.chip.hbm_bytes:
    hints = buffer_report.shrink_hints(list(buffers), config.attention_kernel)
    lines += ["keys that would shrink the largest buffers:", *[f"  {h}" for h in hints]]
  if config.quantization and target.chip is not None:
    from MaxLite.layers.quantization import native_path_note

    chip = target.chip
    note = native_path_note(config.quantization, chip.family, chip.peak_int8_tops, chip.peak_fp8_tflops)
    lines += [note] if note else []
  if config.quantization:
    counts = dot_operand_types(compiled.as_text())
    low = sum(n for types, n in counts.items() if all(t in LOW_PRECISION for t in types))
    kinds = ", ".join(f"{n} {' x '.join(types)}" for types, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    lines += [
      f"dots in the compiled program (a scanned layer's once): {low} of {sum(counts.values())} in "
      f"{config.quantization} ({kinds})"
    ]
  loops = len(_WHILE.findall(compiled.as_text()))
  lines += [flops_line(compiled_flops, model_flops, loops, config.scan_layers)]
  fits = True
  if target.chip is not None:
    hbm = target.chip.hbm_bytes
    fits = needed <= hbm
    verdict = (
      f"fits: {_gib(needed)} of {_gib(hbm)} HBM ({100 * needed / hbm:.0f}%)"
      if fits
      else f"DOES NOT FIT: needs {_gib(needed)} but a {target.chip.family} chip has {_gib(hbm)} HBM; "
      f"short by {_gib(needed - hbm)} per device"
    )
    peak = target.chip.peak_bf16_tflops * 1e12
    lines += [
      f"HBM per device: {_gib(hbm)} -> {verdict}",
      f"roofline step time at the {target.chip.family} bf16 peak ({target.chip.peak_bf16_tflops:.0f} TFLOP/s): "
      f"{model_flops / peak:.4g} s for model FLOPs"
      + (f", {compiled_flops / peak:.4g} s for compiled FLOPs" if not loops else "")
      + f" -> at most {tokens / (model_flops / peak) / config.num_devices:,.0f} tokens/s/device",
    ]
  return "\n".join(lines), fits


# Called with (config, num_slices, compiled step, bytes allocated or None, compile seconds) after a compile that fits
# or not: train_compile.py hands the result to the planner's cache.
AfterCompile = Callable[[Any, int, Any, int | None, float], object]


def run(argv: Sequence[str], after_compile: AfterCompile | None = None) -> int:
  raw = config_lib.load_raw(argv)
  if not raw["compile_topology"]:
    raise ConfigError("compile_topology is empty; name a target such as compile_topology=v5p-128 or cpu-8")
  target = topologies.parse(raw["compile_topology"])
  num_slices = raw["compile_topology_num_slices"]
  if num_slices == -1:
    num_slices = 1
  if num_slices < 1:
    raise ConfigError(f"compile_topology_num_slices must be >= 1 or -1, got {num_slices}")
  users_dump = buffer_report.dump_dir_in(os.environ.get("XLA_FLAGS", ""))
  if users_dump:  # the user's own XLA dump: read the reports from it, change nothing there
    return _compile_and_report(raw, target, num_slices, users_dump, after_compile, add_dump_flags=False)
  dump_dir = tempfile.mkdtemp(prefix="maxlite_compile_")
  try:
    return _compile_and_report(raw, target, num_slices, dump_dir, after_compile)
  finally:
    shutil.rmtree(dump_dir, ignore_errors=True)


def _compile_and_report(
  raw: dict,
  target: topologies.Target,
  num_slices: int,
  dump_dir: str,
  after_compile: AfterCompile | None,
  add_dump_flags: bool = True,
) -> int:
  prepare_backend(target, dump_dir=dump_dir if add_dump_flags else None)
  devices = target_devices(target, num_slices)
  processes = len({d.process_index for d in devices})
  config = config_lib.build(
    raw, num_devices=len(devices), num_slices=num_slices, process_count=processes, platform=target.platform
  )
  start = time.perf_counter()
  try:
    with ticker.ticking(f"compiling the train step for {target.name}"):
      lowered, state_bytes = lower_train_step(config, devices)
      compiled = lowered.compile()
  except Exception as e:
    oom = out_of_memory(str(e))
    if oom is None:
      raise
    state = state_bytes["params"] + state_bytes["optimizer"]
    hint = shrink_hint(oom, state, target.chip.hbm_bytes if target.chip is not None else None)
    frozen = f" + frozen base {_gib(state_bytes['frozen'])}" if config.enable_lora else ""
    print(
      f"{config.model_name} on {target.name}: params {_gib(state_bytes['params'])}{frozen} + optimizer state "
      f"{_gib(state_bytes['optimizer'])} per device\n{oom}\nkeys that would shrink it: {hint}",
      flush=True,
    )
    return DOES_NOT_FIT
  seconds = time.perf_counter() - start
  buffers = buffer_report.live_at_peak(dump_dir, model_dims(config))
  allocated = buffer_report.allocated_bytes(dump_dir)
  text, fits = report(config, target, compiled, state_bytes, seconds, buffers, allocated)
  print(text, flush=True)
  if after_compile is not None:
    after_compile(config, num_slices, compiled, allocated, seconds)
  if config.compiled_trainstep_file:
    from jax.experimental import serialize_executable

    # Only the executable's bytes: its argument trees hold the model's apply function, which does
    # not pickle; serialize_executable.deserialize_and_load takes them from the same config again.
    payload, _, _ = serialize_executable.serialize(compiled)
    storage.write_bytes(config.compiled_trainstep_file, payload)
    print(f"saved the serialized executable ({len(payload):,} bytes) to {config.compiled_trainstep_file}")
  return 0 if fits else DOES_NOT_FIT


def _quantized_as(config: Any) -> str:
  if not config.lora_weight_qtype:
    return f" ({config.weight_dtype})"
  tile = f", tiles of {config.lora_tile_size}" if config.lora_tile_size else ", per channel"
  return f" ({config.lora_weight_qtype}{tile}: QLoRA)"


def _context_line(config) -> str:
  """How a sequence split over devices runs (parallel/context.py, layers/ring_attention.py, context_attention.py)."""
  balance = f"load-balanced ({config.context_parallel_reorder})" if config.context_parallel_reorder else "in order"
  return (
    f"context parallelism: each sequence over {config.sequence_shards} devices, "
    f"{config.context_parallel_strategy}, {balance}"
  )

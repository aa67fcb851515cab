"""Compile the surviving plans for the real target in worker processes, predict each one, remember the results.

A result is cached on disk under a key made of everything that decides the compiled program: the plan's full
validated config, the jax and libtpu versions and MaxLite's own source; a second run of the same search compiles
nothing. Plans are compiled fastest-optimistic first; the search stops when the time budget is spent or when no
plan left could beat the best compiled one even at its optimistic time (the frontier is clear).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from MaxLite import storage
from MaxLite.cli.errors import first_line
from MaxLite.parallel import topologies
from MaxLite.planning.candidates import Candidate

PROGRESS_EVERY_S = 15.0  # a progress line at least this often while compiles run
_IGNORED = {"run_name", "run_dir", "tensorboard_dir", "checkpoint_dir", "metrics_file", "base_output_directory"}
_IGNORED |= {"plan_time_budget_s", "plan_top_n", "plan_workers", "plan_cache_dir"}
# Neither decides the compiled step: how many hosts feed the devices (a plan is validated as one process,
# train_compile.py with the topology's hosts) and which keys came from the command line rather than a file.
_IGNORED |= {"process_count", "explicit_keys"}
_SPELLING = re.compile(r"(ici|dcn)_\w+_parallelism$")


@dataclasses.dataclass
class Result:
  plan: Candidate
  fits: bool
  device_bytes: float = 0.0
  host_bytes: float = 0.0
  prediction: dict[str, float] = dataclasses.field(default_factory=dict)
  bottleneck: str = ""
  collectives: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # the largest, for --explain
  matmul_flops_ratio: float = 0.0  # the compiled step's matmul FLOPs over the model's (recomputation shows above 1)
  assumed: list[str] = dataclasses.field(default_factory=list)  # what the HLO reader could not read and assumed
  error: str = ""
  compile_s: float = 0.0
  cached: bool = False


def _source_digest() -> str:
  digest = hashlib.sha256()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for folder, _, files in sorted(os.walk(root)):
    for name in sorted(f for f in files if f.endswith(".py")):
      with open(os.path.join(folder, name), "rb") as f:
        digest.update(f.read())
  return digest.hexdigest()


def _toolchain(target: topologies.Target) -> str:
  import importlib.metadata

  parts = [importlib.metadata.version("jax"), importlib.metadata.version("jaxlib")]
  libtpu = topologies.find_libtpu(storage.bundled_root()) if target.platform == "tpu" else None
  if libtpu:
    stat = os.stat(libtpu)
    parts.append(f"libtpu:{stat.st_size}:{int(stat.st_mtime)}")
  return "|".join(parts)


def cache_key(config: dict[str, Any], target: topologies.Target, num_slices: int, source: str) -> str:
  """The same program gets the same key however its config was spelled: the mesh is keyed by its resolved shape, not
  by the ici_*/dcn_* keys (-1 or the number it stands for) nor by which keys were set explicitly."""
  relevant = {k: v for k, v in sorted(config.items()) if k not in _IGNORED and not _SPELLING.match(k)}
  machine = [target.name, target.chip.hbm_bytes if target.chip else 0, num_slices, _toolchain(target), source]
  payload = json.dumps([relevant, *machine], sort_keys=True, default=str)
  return hashlib.sha256(payload.encode()).hexdigest()[:32]


def cache_dir(config_value: str) -> str:
  return config_value or os.path.join(os.path.expanduser("~"), ".cache", "maxlite", "plans")


def remember_compile(config: Any, num_slices: int, compiled: Any, allocated: int | None, compile_s: float) -> str:
  """train_compile.py's compiled step, kept in the plan cache under the key plan.py gives the same config: plan.py
  compiles the config as given first, so a search after train_compile.py on those keys starts from the cache instead
  (a 70B train step on v5p-128 is 35 s of libtpu on a 2-core VM). Returns the entry's path; "" for an ensemble
  (plan.py plans one model) or when the entry could not be kept, which costs only that compile later (one warning)."""
  if config.ensemble_size != 1:
    return ""
  from MaxLite.planning import perf_model

  target = perf_model.planning_target(config.compile_topology, config.plan_hbm_gib)
  cache = cache_dir(config.plan_cache_dir)
  try:
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, f"{cache_key(config.to_dict(), target, num_slices, _source_digest())}.json")
    _store(path, assess(config, target, compiled, allocated, compile_s))
  except Exception as e:  # the report above is the command's answer; the cache only saves plan.py a compile
    print(f"warning: plan.py's cache ({cache}) did not keep this compile: {first_line(e, with_type=True)}", flush=True)
    return ""
  return path


def _store(path: str, payload: dict[str, Any]) -> None:
  """Written whole or not at all: a search reading the cache never sees half an entry."""
  with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), suffix=".tmp", delete=False) as f:
    json.dump(payload, f)
  os.replace(f.name, path)


# A worker's XLA dump directory: each compile's buffer assignment says how much device memory it allocates.
_dump_dir: str | None = None


def _init_worker(target_name: str, parent_dir: str | None = None) -> None:
  from MaxLite.aot.compile_step import prepare_backend

  global _dump_dir
  # Inside the search's own folder, which it removes: a worker stopped at the time budget runs no atexit.
  _dump_dir = tempfile.mkdtemp(prefix="maxlite_plan_", dir=parent_dir)
  atexit.register(shutil.rmtree, _dump_dir, ignore_errors=True)
  prepare_backend(topologies.parse(target_name), dump_dir=_dump_dir)


def _allocated_bytes(compile_fn: Callable[[], Any]) -> tuple[Any, int | None]:
  """(compiled, its device allocation from the dump) with the worker's dump directory emptied first."""
  from MaxLite.aot import buffer_report

  if _dump_dir is None:
    return compile_fn(), None
  shutil.rmtree(_dump_dir, ignore_errors=True)  # the last plan's files: XLA writes into the directory again
  compiled = compile_fn()
  return compiled, buffer_report.allocated_bytes(_dump_dir)


def evaluate(config: dict[str, Any], target_name: str, num_slices: int, hbm_gib: float = -1) -> dict[str, Any]:
  """In a worker: compile the plan's train step for the target; memory, prediction and largest collectives."""
  import jax  # noqa: F401  (after prepare_backend)

  from MaxLite.aot.compile_step import lower_train_step, out_of_memory, target_devices
  from MaxLite.config import Config
  from MaxLite.planning import perf_model

  target = perf_model.planning_target(target_name, hbm_gib)
  c = Config(config)
  started = time.perf_counter()
  try:
    lowered, _ = lower_train_step(c, target_devices(target, num_slices))
    compiled, allocated = _allocated_bytes(lowered.compile)
  except Exception as e:  # an out-of-memory compile is an answer, anything else is reported per plan
    oom = out_of_memory(str(e))
    return {"fits": False, "error": oom or first_line(e, with_type=True), "compile_s": time.perf_counter() - started}
  return assess(c, target, compiled, allocated, time.perf_counter() - started)


def assess(c: Any, target: topologies.Target, compiled: Any, allocated: int | None, compile_s: float) -> dict[str, Any]:
  """A compiled plan's cache entry: its memory (`allocated`: the compiler's buffer assignment, when read), its
  predicted step and largest collectives."""
  from MaxLite.aot.compile_step import device_bytes, memory_total
  from MaxLite.config import choices, splash_blocks
  from MaxLite.models import flops
  from MaxLite.planning import hlo_costs, perf_model

  mem = compiled.memory_analysis()
  needed, host_bytes = device_bytes(mem, allocated)[0], memory_total(mem, "host_")
  out: dict[str, Any] = {"device_bytes": needed, "host_bytes": host_bytes}
  out["fits"] = needed <= target.chip.hbm_bytes
  out["compile_s"] = compile_s

  ops = hlo_costs.device_ops(compiled.as_text(), choices.MESH_AXES, c.mesh_shape, c.dcn_mesh_shape)
  net = perf_model.Interconnect(
    target.chip,
    perf_model.torus(target),
    dict(zip(choices.MESH_AXES, c.ici_mesh_shape)),
    dict(zip(choices.MESH_AXES, c.dcn_mesh_shape)),
  )
  step_flops = flops.training_flops_per_step(c)
  model_flops = step_flops["total"] / c.num_devices
  kernels = [o for o in ops if o.attention]
  if kernels:  # Pallas kernels carry no cost of their own: count each run's blocks
    blocks = splash_blocks.capped_blocks(c.to_dict(), kernels[0].attention[3], kernels[0].attention[4])
    for o in kernels:
      suffix = {"fwd": "", "dq": "_dq", "dkv": "_dkv"}[o.attention[0]]
      q_block, kv_block = blocks[f"sa_block_q{suffix}"], blocks[f"sa_block_kv{suffix}"]
      balanced = c.context_parallel_reorder
      o.flops = hlo_costs.splash_kernel_flops(o.attention, q_block, kv_block, c.sa_use_fused_bwd_kernel, balanced)
  elif c.attention_kernel == "splash":  # interpreted off TPU: the kernels are not in the HLO; count the model's
    ops.append(
      hlo_costs.Op("splash_attention", "custom-call", "splash", 1.0, flops=step_flops["attention"] / c.num_devices)
    )
  if any(o.grouped_matmul for o in ops):
    # Grouped-matmul kernels carry a cost for every row of their buffer (with expert parallelism, room for all of
    # a shard's rows on every peer); they skip the empty part. Count the rows routed: the model's expert FLOPs.
    for o in ops:
      if o.grouped_matmul:
        o.flops = 0.0
    ops.append(
      hlo_costs.Op("grouped_matmuls", "custom-call", "experts", 1.0, flops=step_flops["experts"] / c.num_devices)
    )
  tokens = c.global_batch_size_to_train_on * c.max_target_length / c.num_devices
  prediction = perf_model.predict(ops, net, model_flops, tokens)
  out["prediction"] = dataclasses.asdict(prediction)
  out["matmul_flops_ratio"] = sum(o.flops * o.runs for o in ops) / model_flops
  out["bottleneck"] = prediction.bottleneck
  out["assumed"] = hlo_costs.assumptions(ops)
  largest = sorted((o for o in ops if o.collective), key=lambda o: -net.seconds(o) * o.runs)[:8]
  out["collectives"] = [
    {"kind": o.collective, "axes": list(o.axes), "bytes": o.moved_bytes, "runs": o.runs, "seconds": net.seconds(o)}
    for o in largest
  ]
  return out


def run_search(
  plans: list[Candidate],
  target: topologies.Target,
  num_slices: int,
  *,
  budget_s: float,
  workers: int,
  cache: str,
  hbm_gib: float = -1,
  progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> tuple[list[Result], str]:
  """(results of the plans compiled or found in the cache, why the search stopped and after how long).

  The budget bounds the search's time, compiles in flight included: no compile starts when less of the budget is
  left than the slowest compile so far took, and compiles still running when it is spent are stopped (their plans
  count as not compiled), unless nothing has been answered yet (then the first answers are awaited: a search
  with no compiled plan has nothing to rank)."""
  source = _source_digest()
  os.makedirs(cache, exist_ok=True)
  results: list[Result] = []
  todo: list[tuple[Candidate, str]] = []
  for plan in plans:
    key = cache_key(plan.config, target, num_slices, source)
    path = os.path.join(cache, f"{key}.json")
    if os.path.isfile(path):
      with open(path) as f:
        results.append(_result(plan, json.load(f), cached=True))
    else:
      todo.append((plan, path))
  start = time.monotonic()
  stopped = "every plan was compiled" if todo else "every plan was in the cache"
  context = multiprocessing.get_context("spawn")
  dumps = tempfile.mkdtemp(prefix="maxlite_plan_search_")
  pool = concurrent.futures.ProcessPoolExecutor(
    max_workers=max(1, workers), mp_context=context, initializer=_init_worker, initargs=(target.name, dumps)
  )
  running: dict[concurrent.futures.Future, tuple[Candidate, str]] = {}
  submitted: dict[concurrent.futures.Future, float] = {}
  slowest = 0.0  # the longest a compile has taken, from its submission (worker start-up included) to its answer
  failures = 0
  if todo and budget_s <= 0:
    progress(f"plan: {len(results)} plans found in the cache; plan_time_budget_s={budget_s:g} compiles no more")
  elif todo:  # the first answers take a while (workers start, then a whole compile each): say what is going on
    progress(
      f"plan: compiling {len(todo)} plans ({len(results)} found in the cache) in {max(1, workers)} processes, "
      f"within plan_time_budget_s={budget_s:g}"
    )
  try:
    while todo or running:
      best = _best_seconds_per_token(results)
      while todo and len(running) < max(1, workers):
        plan, path = todo[0]
        if best is not None and plan.optimistic_s / _tokens(plan) >= best:
          stopped = f"the frontier is clear: {len(todo)} plans left cannot beat the best even at their optimistic time"
          todo.clear()
          break
        left = budget_s - (time.monotonic() - start)
        if left <= 0 or (slowest and left < slowest):
          why = "ran out" if left <= 0 else f"had {left:.0f} s left, less than the slowest compile ({slowest:.0f} s)"
          stopped = f"the time budget plan_time_budget_s={budget_s:g} {why}, with {len(todo)} plans not compiled"
          todo.clear()
          break
        todo.pop(0)
        future = pool.submit(evaluate, plan.config, target.name, num_slices, hbm_gib)
        running[future], submitted[future] = (plan, path), time.monotonic()
      if not running:
        break
      left = budget_s - (time.monotonic() - start)
      if left <= 0 and results:  # compiles still running when the budget is spent: stopped, not awaited
        stopped = (
          f"the time budget plan_time_budget_s={budget_s:g} ran out: {len(running)} "
          f"{'compile in flight was' if len(running) == 1 else 'compiles in flight were'} stopped"
          + (f" and {len(todo)} plans not compiled" if todo else "")
        )
        todo.clear()
        _stop_workers(pool)
        break
      done, _ = concurrent.futures.wait(
        running,
        timeout=min(PROGRESS_EVERY_S, left) if left > 0 else PROGRESS_EVERY_S,
        return_when=concurrent.futures.FIRST_COMPLETED,
      )
      if not done:  # still compiling: the bar moves with the time spent too
        progress(_progress_line(results, len(todo) + len(running), time.monotonic() - start, budget_s))
      for future in done:
        plan, path = running.pop(future)
        slowest = max(slowest, time.monotonic() - submitted.pop(future))
        try:
          payload = future.result()
        except Exception as e:  # a worker that died (e.g. out of host memory) fails its plan only
          payload = {"fits": False, "error": first_line(e, with_type=True)}
        answered = "device_bytes" in payload or "DOES NOT FIT" in payload.get("error", "")
        if answered:  # answers (fits, or by how much not) are kept; accidents are tried again next time
          _store(path, payload)
        results.append(_result(plan, payload))
        failures = 0 if answered else failures + 1
        if failures >= 3 and todo:  # the same accident every time is the toolchain, not the plans
          stopped = f"3 compiles in a row failed ({payload.get('error', '')}); {len(todo)} plans not compiled"
          todo.clear()
        progress(_progress_line(results, len(todo) + len(running), time.monotonic() - start, budget_s))
  finally:
    pool.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(dumps, ignore_errors=True)
  return results, f"{stopped}; {time.monotonic() - start:.0f} s spent"


def _stop_workers(pool: concurrent.futures.ProcessPoolExecutor) -> None:
  """End the compiles in flight (a compile cannot be interrupted otherwise): the workers are ended, the pool's
  futures fail and shutdown() returns at once."""
  stop = getattr(pool, "terminate_workers", None)  # Python 3.14
  if stop is not None:
    stop()
    return
  for process in list((getattr(pool, "_processes", None) or {}).values()):
    process.terminate()


def _result(plan: Candidate, payload: dict[str, Any], cached: bool = False) -> Result:
  return Result(
    plan,
    bool(payload.get("fits")),
    device_bytes=payload.get("device_bytes") or 0.0,
    host_bytes=payload.get("host_bytes") or 0.0,
    prediction=payload.get("prediction") or {},
    bottleneck=payload.get("bottleneck") or "",
    collectives=payload.get("collectives") or [],
    matmul_flops_ratio=payload.get("matmul_flops_ratio") or 0.0,
    assumed=payload.get("assumed") or [],
    error=payload.get("error") or "",
    compile_s=payload.get("compile_s") or 0.0,
    cached=cached,
  )


def _tokens(plan: Candidate) -> float:
  return plan.config["global_batch_size_to_train_on"] * plan.config["max_target_length"]


def _best_seconds_per_token(results: list[Result]) -> float | None:
  times = [r.prediction["step_s"] / _tokens(r.plan) for r in results if r.fits and r.prediction]
  return min(times) if times else None


def _progress_line(results: list[Result], left: int, elapsed: float, budget: float) -> str:
  """The search ends when the plans run out or the budget does, whichever is first: the bar shows the larger share
  done of the two (hundreds of queued plans against a budget that allows dozens left it empty to the end)."""
  done = len(results)
  share = max(done / max(done + left, 1), min(elapsed / budget, 1.0) if budget > 0 else 0.0)
  bar = "#" * int(20 * share)
  fitting = [r for r in results if r.fits and r.prediction]
  best = max((r.prediction["mfu"] for r in fitting), default=None)
  best_text = f", best predicted MFU {100 * best:.1f}%" if best is not None else ""
  return f"plan: [{bar:<20}] {done} compiled, {left} queued, {elapsed:.0f}/{budget:g} s{best_text}"

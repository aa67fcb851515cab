"""The planner's run: search the layouts of a config on a topology, rank them, explain one, write the best as a
config file. plan.py is its command line."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from MaxLite import config as config_lib
from MaxLite import storage
from MaxLite.cli.errors import ConfigError
from MaxLite.config import choices
from MaxLite.parallel import topologies
from MaxLite.planning import candidates, perf_model, search

_NOT_PINNED = {"model_name", "compile_topology", "compile_topology_num_slices", "base_output_directory", "run_name"}
GiB = 2**30


def pinned_keys(argv: Sequence[str]) -> set[str]:
  keys = {a.split("=", 1)[0] for a in argv if "=" in a and not a.startswith("-")}
  return {k for k in keys if k not in _NOT_PINNED and not k.startswith("plan_")}


def run(argv: Sequence[str], explain_plan: int = 0, plan_output: str = "") -> int:
  raw = config_lib.load_raw(argv)
  if not raw["compile_topology"]:
    raise ConfigError("compile_topology is empty; name the slice to plan for, e.g. compile_topology=v5p-128")
  if raw["ensemble_size"] != 1:
    raise ConfigError(
      f"ensemble_size={raw['ensemble_size']}: plan.py plans one model's layout; plan it without an ensemble "
      "(train_compile.py compiles an ensemble as given)"
    )
  target = perf_model.planning_target(raw["compile_topology"], raw["plan_hbm_gib"])
  num_slices = max(1, raw["compile_topology_num_slices"])
  pinned = pinned_keys(argv)
  plans = candidates.enumerate_plans(raw, target, num_slices, pinned)
  kept, rejected = candidates.prune(plans, raw, target, num_slices)
  baseline = candidates.Candidate({})  # the config exactly as given: compiled first, marked in the table
  searched = len(plans)
  if candidates.validate(baseline, raw, target, num_slices) is None:
    # A searched plan that sets every key to the config's own value is the baseline again: compiled once, as it.
    rejected["the config as given"] = [(plan, None) for plan in kept if plan.config == baseline.config]
    kept = [baseline] + [plan for plan in kept if plan.config != baseline.config]
    searched += 1
  if not kept:
    raise ConfigError(_nothing_fits(raw, target, num_slices, rejected))
  print(
    f"plan: {len(plans)} plans, {len(kept)} left after validation and the memory bound; compiling for "
    f"{target.name} x {num_slices}",
    file=sys.stderr,
    flush=True,
  )
  results, stopped = search.run_search(
    kept,
    target,
    num_slices,
    budget_s=raw["plan_time_budget_s"],
    workers=raw["plan_workers"],
    cache=search.cache_dir(raw["plan_cache_dir"]),
    hbm_gib=raw["plan_hbm_gib"],
  )
  if not results and raw["plan_time_budget_s"] <= 0:
    raise ConfigError(
      f"plan_time_budget_s={raw['plan_time_budget_s']:g} compiles nothing and the plan cache "
      f"({search.cache_dir(raw['plan_cache_dir'])}) holds none of these {len(kept)} plans: give the search a budget, "
      "or compile the config first with train_compile.py (it keeps its result there)"
    )
  ranked = rank(results)
  # the top N, and the config as given wherever it ranks
  shown = [(i, r) for i, r in enumerate(ranked, 1) if i <= raw["plan_top_n"] or not r.plan.overrides]
  print(table(shown, target))
  configured = next((r for r in results if not r.plan.overrides), None)
  if configured is not None and (configured.fits and configured.prediction):
    print("* = the config as given")
  elif configured is not None:
    print(f"the config as given does not fit: {configured.error or f'{configured.device_bytes / GiB:.1f} GiB'}")
  print(rejections(rejected, results, stopped, searched=searched, not_compiled=len(kept) - len(results)))
  if not ranked:
    raise ConfigError(f"no compiled plan fits {target.name}; " + _nothing_fits(raw, target, num_slices, rejected))
  if explain_plan:
    print(explain(ranked[explain_plan - 1], target) if explain_plan <= len(ranked) else "no such plan")
  path = plan_output or os.path.join("plans", f"{raw['model_name']}-{target.name}.yml")
  write_plan(path, argv, ranked[0])
  print(
    f"best plan written to {path}\n  check: python MaxLite/train_compile.py {path}\n"
    f"  train: python MaxLite/train.py {path}"
  )
  return 0


def rank(results: list[search.Result]) -> list[search.Result]:
  """Fitting, predicted plans, most tokens/s/chip first (for one model and sequence length: highest MFU first)."""
  fitting = [r for r in results if r.fits and r.prediction]
  return sorted(fitting, key=lambda r: -r.prediction["tokens_per_s_per_chip"])


def describe(plan: candidates.Candidate) -> str:
  c = plan.config
  names = {"sequence": "seq"}
  mesh = " ".join(f"{names.get(a, a)}{n}" for a, n in zip(choices.MESH_AXES, c["mesh_shape"]) if n > 1)
  accumulate = f" x{c['gradient_accumulation_steps']}acc" if c["gradient_accumulation_steps"] > 1 else ""
  micro = f" mb{c['num_pipeline_microbatches']}" if c["num_pipeline_stages"] > 1 else ""
  batch = f"b{c['per_device_batch_size']:g}{accumulate}{micro}"
  quantized = f" | {c['quantization']}" if c["quantization"] else ""
  return f"{mesh or 'single'} | {remat_label(c)} | {c['attention_kernel']} | {batch}{quantized}"


def remat_label(c: dict) -> str:
  """remat_policy, and for `custom` what it keeps where: custom(device: query_proj; offload: decoder_layer_input)."""
  if c["remat_policy"] != "custom":
    return c["remat_policy"]
  kept = choices.placement(c)
  parts = [f"{where}: {', '.join(names)}" for where, names in (("device", kept.on_device), ("offload", kept.offloaded))]
  return f"custom({'; '.join(p for p, names in zip(parts, kept) if names)})"


def table(ranked: list[tuple[int, search.Result]], target: topologies.Target) -> str:
  head = f"{'#':>2}  {'plan (mesh | remat | attention | batch/device)':<62} {'MFU':>6} {'tok/s/chip':>10} "
  head += f"{'step s':>7} {'HBM GiB':>8} {'free':>5}  bottleneck"
  lines = [head, "-" * len(head)]
  hbm = target.chip.hbm_bytes if target.chip else float("inf")
  for i, r in ranked:
    p = r.prediction
    label = describe(r.plan) + (" *" if not r.plan.overrides else "")
    lines.append(
      f"{i:>2}  {label:<62} {100 * p['mfu']:>5.1f}% {p['tokens_per_s_per_chip']:>10,.0f} "
      f"{p['step_s']:>7.3f} {r.device_bytes / GiB:>8.1f} {100 * (1 - r.device_bytes / hbm):>4.0f}%  {r.bottleneck}"
    )
  return "\n".join(lines)


def rejections(
  rejected: dict[str, list], results: list[search.Result], stopped: str, searched: int = 0, not_compiled: int = 0
) -> str:
  """Why each plan searched is not in the table, by kind; the kinds and the table's plans add up to `searched` (every
  plan enumerated, and the config as given), which the last line shows."""
  lines = ["rejected:"]
  invalid = rejected["invalid"]
  if invalid:
    reasons: dict[str, int] = {}
    for _, reason in invalid:
      key = reason.split(" (")[0]
      reasons[key] = reasons.get(key, 0) + 1
    top = sorted(reasons.items(), key=lambda kv: -kv[1])[:3]
    lines.append(f"  {len(invalid)} invalid, e.g. " + "; ".join(f"{r} ({n}x)" for r, n in top))
  short = rejected["does not fit"]
  if short:
    plan, needed = min(short, key=lambda item: item[1])
    lines.append(
      f"  {len(short)} cannot fit by the memory lower bound; the closest, {describe(plan)}, needs at least "
      f"{needed / GiB:.1f} GiB per device"
    )
  smaller = rejected.get("smaller batch", [])
  if smaller:
    lines.append(
      f"  {len(smaller)} smaller batches of a layout, remat policy and kernel whose two largest batches within the "
      "memory bound are compiled instead (a smaller batch moves the same weights for fewer tokens)"
    )
  again = rejected.get("the config as given", [])
  if again:
    lines.append(f"  {len(again)} the config as given again (compiled once, as it)")
  ranked = [r for r in results if r.fits and r.prediction]
  too_big = [r for r in results if not r.fits and ("DOES NOT FIT" in r.error or r.device_bytes)]
  if too_big:
    worst = min(too_big, key=lambda r: r.device_bytes or float("inf"))
    lines.append(
      f"  {len(too_big)} compiled but did not fit, e.g. {describe(worst.plan)}: "
      + (worst.error or f"needs {worst.device_bytes / GiB:.1f} GiB per device")
    )
  answered = {id(r) for r in ranked + too_big}
  failed = [r for r in results if id(r) not in answered]  # every other answer: a compile that failed
  if failed:
    error = next((r.error for r in failed if r.error), "no prediction")
    lines.append(f"  {len(failed)} failed to compile, e.g. {describe(failed[0].plan)}: {error}")
  if not_compiled:
    lines.append(f"  {not_compiled} not compiled (the search stopped first; see below)")
  cached = sum(r.cached for r in results)
  lines.append(f"search: {len(results)} plans evaluated ({cached} from the cache); stopped because {stopped}")
  if searched:
    kinds = [
      (len(ranked), "ranked"),
      (len(too_big), "did not fit"),
      (len(failed), "failed"),
      (not_compiled, "not compiled"),
      (len(rejected["invalid"]), "invalid"),
      (len(short), "below the memory bound"),
      (len(smaller), "smaller batches"),
      (len(again), "the config as given again"),
    ]
    given = " (those enumerated and the config as given)" if "the config as given" in rejected else ""
    lines.append(f"plans searched{given}: {searched} = " + " + ".join(f"{n} {what}" for n, what in kinds if n))
  return "\n".join(lines)


def explain(r: search.Result, target: topologies.Target) -> str:
  p = r.prediction
  lines = [
    f"plan: {r.plan.label}",
    f"  predicted step {p['step_s']:.4f} s = compute {p['compute_s']:.4f} + memory-bound ops {p['memory_s']:.4f} "
    f"+ exposed ICI {p['exposed_ici_s']:.4f} (of {p['ici_s']:.4f}) + exposed DCN {p['exposed_dcn_s']:.4f} "
    f"(of {p['dcn_s']:.4f}) + waits for async copies {p['exposed_copy_s']:.4f} (of {p['copy_s']:.4f})",
    f"  MFU {100 * p['mfu']:.1f}%, {p['tokens_per_s_per_chip']:,.0f} tokens/s/chip, bottleneck {r.bottleneck}",
    f"  device memory {r.device_bytes / GiB:.2f} GiB of {target.chip.hbm_bytes / GiB:.4g}, "
    f"host {r.host_bytes / GiB:.2f} GiB",
    f"  matmul FLOPs as compiled: {r.matmul_flops_ratio:.2f}x the model's (above 1: recomputed, by the remat policy "
    "or by XLA to fit the memory)",
    "  largest collectives (per step):",
  ]
  rows = [
    f"    {c['kind']:<18} over {'x'.join(c['axes']) or '?':<14} {c['bytes'] / 2**20:>9.1f} MiB x {c['runs']:g} "
    f"= {c['seconds'] * c['runs']:.4f} s"
    for c in r.collectives
  ]
  lines += _alike(rows, "collectives")
  if r.assumed:  # the reader costed these on a conservative guess (the program's text did not say)
    lines.append(f"  costed on an assumption ({len(r.assumed)}):")
    lines += _alike([f"    {line}" for line in r.assumed], "ops")[:8]
  return "\n".join(lines)


def _alike(rows: list[str], what: str) -> list[str]:
  """Each distinct row once, in first-seen order, with how many rows it stands for: `--explain` listed the gradient
  all-reduces of same-shaped weights line after identical line."""
  counts: dict[str, int] = {}
  for row in rows:
    counts[row] = counts.get(row, 0) + 1
  return [row + (f"  ({n} {what} alike, each)" if n > 1 else "") for row, n in counts.items()]


def base_config_for(yml: str, plan_path: str) -> str:
  """The `base_config:` a plan written to `plan_path` names for the config `yml` it was searched from: never this
  machine's absolute path (a TPU worker's checkout lies elsewhere). A config of the checkout (configs/...) by its
  path in the checkout, which the loader finds in any checkout or install; another file relative to the plan."""
  source = os.path.abspath(storage.resolve(yml))  # the file load_raw read, wherever plan ran
  root = os.path.abspath(storage.bundled_root())
  if os.path.commonpath([source, root]) == root:
    return os.path.relpath(source, root)
  return os.path.relpath(source, os.path.dirname(os.path.abspath(plan_path)))


def write_plan(path: str, argv: Sequence[str], best: search.Result) -> None:
  yml = next((a for a in argv if a.endswith((".yml", ".yaml"))), config_lib.BASE_CONFIG_PATH)
  user = [a for a in argv if "=" in a and not a.startswith("-") and not a.split("=", 1)[0].startswith("plan_")]
  p = best.prediction
  lines = [
    f"# Written by plan.py: predicted MFU {100 * p['mfu']:.1f}%, {p['tokens_per_s_per_chip']:,.0f} tokens/s/chip, "
    f"{best.device_bytes / GiB:.1f} GiB per device, bottleneck {best.bottleneck}.",
    f"base_config: {base_config_for(yml, path)}",
  ]
  values: dict[str, Any] = dict(a.split("=", 1) for a in user)
  values.update(best.plan.overrides)
  lines += [f"{k}: {_yaml_value(v)}" for k, v in values.items()]
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def _yaml_value(v: Any) -> str:
  if isinstance(v, bool):
    return "true" if v else "false"
  if isinstance(v, (int, float)):
    return f"{v:g}" if isinstance(v, float) else str(v)
  return str(v) if str(v).lstrip("-").replace(".", "").isdigit() else f'"{v}"'


def _nothing_fits(raw: dict[str, Any], target: topologies.Target, num_slices: int, rejected: dict) -> str:
  """One line: the smallest memory any plan needs, and how many chips that would take."""
  needs = [needed for _, needed in rejected["does not fit"]]
  if not needs or target.chip is None:
    reason = rejected["invalid"][0][1] if rejected["invalid"] else "no layout is valid"
    return f"model {raw['model_name']} has no valid plan on {target.name}: {reason}"
  smallest = min(needs)
  chips = target.num_devices * num_slices * 2 ** math.ceil(math.log2(smallest / target.chip.hbm_bytes))
  return (
    f"model {raw['model_name']} cannot fit on {target.name}: every plan needs at least {smallest / GiB:.1f} GiB per "
    f"device (train state and the activations its remat policy keeps), a {target.chip.family} chip has "
    f"{target.chip.hbm_bytes / GiB:.4g} GiB; it needs at least {chips} chips ({target.chip.family}-"
    f"{chips * target.chip.cores_per_chip})"
  )

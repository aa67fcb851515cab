"""The registry of training objectives (pretraining, SFT, DPO, ORPO, GRPO) and what one declares, as config/families.py
is for decoder families.

An objective is one module of `MaxLite/objectives/`: its keys (a pydantic group in its KEY_GROUPS), which flags select
it (MaxText's `use_sft`, `use_dpo` + `dpo_algo`, `use_grpo`), the records it reads, its config checks and their
one-line errors, whether it holds a frozen reference, its loss as sums that add up over microbatches and shards, and
its logged metrics. The registry sits here, below everything that asks it (validation for the checks, the input
pipeline for the records, the train step for the loss); the modules fill it from above when `MaxLite.objectives` is
imported (the package root registers the loader). Nothing outside the objectives branches on which one runs: it asks
the objective the config selects (`of(config)`). The modules import without jax (config validation and `--help` read
them); their loss code imports it when first called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from MaxLite.cli.errors import ConfigError


def _nothing(c: Mapping[str, Any]) -> dict[str, Any]:
  del c
  return {}


def _no_mesh_checks(c: Mapping[str, Any], mesh: Mapping[str, int], global_batch: int) -> None:
  del c, mesh, global_batch


def _never(c: Any) -> bool:
  del c
  return False


def _one(c: Mapping[str, Any]) -> int:
  del c
  return 1


def _no_keys(config: Any) -> tuple[str, ...]:
  del config
  return ()


@dataclasses.dataclass(frozen=True)
class Objective:
  """One training objective.

  name: as logs and errors say it. flag: the boolean key that turns it on ("" for pretraining, the default).
  selects(c): true when the raw config asks for this objective (its flag, and e.g. dpo_algo for ORPO). derive(c): the
  keys it fills in (its data columns and files), ConfigError for a combination it cannot run. check_mesh(c, mesh,
  global batch): the checks that need the mesh. record_kind(c): what a training record is ("text", "chat",
  "prompt_completion", "preference", "prompts"). reads_records: records are rendered from columns (chat or
  prompt/completion or preference), not plain text. min_segments: the fewest documents a packed row must hold (a
  preference pair is two). whole_logits: the loss reads whole responses' log-probabilities, so the logits are never
  tiled or sliced over the vocabulary. reference(config): the state holds a frozen copy of the starting parameters.
  reads_reference: the loss reads the frozen reference's parameters (DPO), passed to the eval step too.
  updates_per_batch(c): optimizer updates per training step. ensembles: K members in one program can run it.
  rollouts: its batches are sampled by the policy (training/grpo_run.py) instead of read from the data.

  The jax parts (each called under jit): loss_sums(params, reference, apply_fn, batch, rng, config) -> (total, sums),
  sums adding up over microbatches, with "loss_sum" (= total) and "count" (what the step divides by) and "tokens".
  train_metrics(sums, count) and eval_metrics(totals, config) -> the logged values. prepare(batch, config) -> the
  batch with whole-batch quantities a microbatch cannot see (ORPO's normalisers). keeps_update(batch): whether the
  step's update is applied (GRPO skips a batch that carries no signal). batch_keys(config): the extra float arrays of
  its batch.
  logged: the prefixes of its step metrics that go to metrics.jsonl (beside loss, learning rate, ...)."""

  name: str
  flag: str
  selects: Callable[[Mapping[str, Any]], bool]
  loss_sums: Callable[..., tuple]
  train_metrics: Callable[[dict[str, Any], Any], dict[str, Any]]
  eval_metrics: Callable[[dict[str, Any], Any], dict[str, float]]
  record_kind: Callable[[Mapping[str, Any]], str]
  derive: Callable[[dict[str, Any]], dict[str, Any]] = _nothing
  check_mesh: Callable[[Mapping[str, Any], Mapping[str, int], int], None] = _no_mesh_checks
  reads_records: bool = False
  min_segments: int = 1
  whole_logits: bool = False
  reference: Callable[[Any], bool] = _never
  reads_reference: bool = False
  updates_per_batch: Callable[[Mapping[str, Any]], int] = _one
  ensembles: bool = True
  rollouts: bool = False
  prepare: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None
  keeps_update: Callable[[dict[str, Any]], Any] | None = None
  batch_keys: Callable[[Any], tuple[str, ...]] = _no_keys
  logged: tuple[str, ...] = ()


_OBJECTIVES: dict[str, Objective] = {}
_LOADERS: list[Callable[[], object]] = []


def register_loader(loader: Callable[[], object]) -> None:
  """`loader()` registers the objectives; it runs at the first lookup (the package root passes one)."""
  _LOADERS.append(loader)


def register(objective: Objective) -> Objective:
  if objective.name in _OBJECTIVES:
    raise ValueError(f"objective {objective.name!r} is registered twice")
  _OBJECTIVES[objective.name] = objective
  return objective


def registered() -> dict[str, Objective]:
  while _LOADERS:
    _LOADERS.pop(0)()
  if not _OBJECTIVES:
    raise RuntimeError(
      "no objective is registered: import MaxLite.objectives first (each of its modules registers one)"
    )
  return _OBJECTIVES


def select(c: Mapping[str, Any]) -> Objective:
  """The objective a raw config asks for; pretraining when no flag is set. Two flags at once are one ConfigError."""
  chosen = [o for o in registered().values() if o.flag and o.selects(c)]
  flags = list(dict.fromkeys(o.flag for o in chosen))
  if len(flags) > 1:
    first, second = flags[:2]
    raise ConfigError(f"{first}=true and {second}=true: choose one (SFT first, then the next from its checkpoint)")
  if chosen:
    return chosen[0]
  if c.get("use_dpo"):  # the flag is set but no preference objective answers to its dpo_algo
    algos = ", ".join(o.name for o in registered().values() if o.flag == "use_dpo")
    raise ConfigError(f"dpo_algo={c['dpo_algo']!r} is not one of: {algos}")
  return next(o for o in registered().values() if not o.flag)


def of(config: Any) -> Objective:
  """The objective a built Config runs (its derived `objective` key)."""
  return registered()[config.objective]


def names() -> tuple[str, ...]:
  return tuple(registered())

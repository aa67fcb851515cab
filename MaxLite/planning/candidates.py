"""The plans worth compiling: every layout, remat policy, attention kernel and batch split MaxLite offers on a
target, minus those the config validator or a memory lower bound rules out, ordered by an optimistic step time.

Both analytic numbers are bounds, not estimates: the memory bound counts only the train state and the activations
a remat policy must keep, and the optimistic time only the matmul FLOPs (with the policy's recomputation) and the
FSDP / tensor traffic no schedule can avoid. A plan that fails the memory bound cannot fit; a plan whose optimistic
time is slower than a compiled plan's predicted time cannot win (search.py stops there).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from MaxLite.cli.errors import ConfigError
from MaxLite.config import Config, choices, validation
from MaxLite.models import flops
from MaxLite.parallel import sharding
from MaxLite.parallel.topologies import Target
from MaxLite.planning.perf_model import MATMUL_EFFICIENCY

GiB = 2**30
REMAT_SEARCHED = ("full", "save_qkv_proj", "save_dot_except_mlp", "minimal", "qkv_proj_offloaded", "minimal_offloaded")
# remat_policy=custom choices worth a compile: full rematerialisation with the layer inputs (what `full` keeps) in host
# memory instead of HBM, alone or with q/k/v kept on the device.
CUSTOM_SEARCHED = (
  {"decoder_layer_input": "offload"},
  {"decoder_layer_input": "offload", "query_proj": "device", "key_proj": "device", "value_proj": "device"},
)
BATCHES = (0.5, 1, 2, 4, 8, 16, 32)
MESH_KEYS = {axis: f"ici_{choices.AXIS_KEY[axis]}_parallelism" for axis in choices.MESH_AXES}


@dataclasses.dataclass
class Candidate:
  overrides: dict[str, Any]  # the keys this plan sets (on top of the user's config)
  config: dict[str, Any] | None = None  # validated and derived
  memory_bound: float = 0.0  # bytes per device, a lower bound
  optimistic_s: float = 0.0  # step time, a lower bound

  @property
  def label(self) -> str:
    return " ".join(f"{k}={v}" for k, v in self.overrides.items()) or "(the config as given)"


def _powers_of_two(n: int) -> list[int]:
  return [2**i for i in range(int(math.log2(n)) + 1) if n % 2**i == 0]


# From this many tokens a row, the search splits the sequence over up to 16 devices (else up to 4).
LONG_CONTEXT = 32768


def mesh_keys(raw: dict[str, Any], pinned: set[str]) -> dict[str, str]:
  """{mesh axis: the ici_* key a plan sets}: the sequence axis by MaxText's ici_context_parallelism unless the
  config sets it by its other name, ici_sequence_parallelism (a config sets one of the two)."""
  keys = dict(MESH_KEYS)
  if "ici_sequence_parallelism" not in pinned and raw["ici_sequence_parallelism"] == 1:
    keys["sequence"] = "ici_context_parallelism"
  return keys


def layouts(raw: dict[str, Any], devices: int, pinned: set[str]) -> list[dict[str, int]]:
  """ICI splits of `devices` over the mesh axes: powers of two, fsdp takes the rest; pinned axes stay as given."""
  experts = raw["num_experts"]
  long_context = raw["max_target_length"] >= LONG_CONTEXT
  options = {
    "tensor": _powers_of_two(min(devices, 16)),
    "sequence": _powers_of_two(min(devices, 16)) if long_context else [1, 2, 4],
    "stage": [1, 2, 4],
    "expert": _powers_of_two(min(devices, experts)) if experts > 1 else [1],
    "data": [1, 2, 4, 8],
  }
  for axis, key in mesh_keys(raw, pinned).items():
    if axis in options and key in pinned and raw[key] != -1:
      options[axis] = [raw[key]]
  out = []
  for tensor, sequence, stage, expert, data in itertools.product(*options.values()):
    rest, remainder = divmod(devices, tensor * sequence * stage * expert * data)
    if remainder or rest < 1:
      continue
    if MESH_KEYS["fsdp"] in pinned and raw[MESH_KEYS["fsdp"]] not in (-1, rest):
      continue
    out.append({"tensor": tensor, "sequence": sequence, "stage": stage, "expert": expert, "data": data, "fsdp": rest})
  return out


def enumerate_plans(raw: dict[str, Any], target: Target, num_slices: int, pinned: set[str]) -> list[Candidate]:
  devices = target.num_devices
  remats = [{"remat_policy": r} for r in REMAT_SEARCHED] + [{"remat_policy": "custom", **c} for c in CUSTOM_SEARCHED]
  if "remat_policy" in pinned:
    remats = [{"remat_policy": raw["remat_policy"]}]
  elif target.platform != "tpu":  # host offload is a TPU (and GPU) memory space
    remats = [r for r in remats if "offload" not in str(r.values())]
  attentions = [raw["attention"]] if "attention" in pinned or target.platform != "tpu" else ["splash", "dot_product"]
  global_batch = raw["plan_global_batch_size"]
  if "per_device_batch_size" in pinned:
    batches = [(raw["per_device_batch_size"], raw["gradient_accumulation_steps"])]
  elif global_batch > 0:  # a fixed number of sequences per optimizer step, split into accumulation steps
    total = devices * num_slices
    batches = [(global_batch / total / ga, ga) for ga in (1, 2, 4, 8, 16) if (global_batch / total / ga) * total >= 1]
  else:
    batches = [(b, 1) for b in BATCHES]
  # plan_quantizations: quantized training as a dimension (bf16 and int8 side by side); else the config's own.
  quantizations = list(raw["plan_quantizations"]) if "quantization" not in pinned else []
  quantizations = quantizations or [raw["quantization"]]
  plans = []
  for mesh, remat, attention, (batch, accumulation), quantization in itertools.product(
    layouts(raw, devices, pinned), remats, attentions, batches, quantizations
  ):
    overrides = {mesh_keys(raw, pinned)[a]: n for a, n in mesh.items()}
    overrides.update(remat, attention=attention, per_device_batch_size=batch)
    if quantization != raw["quantization"]:
      overrides.update(quantization=quantization, use_qwix_quantization=bool(quantization))
    overrides["gradient_accumulation_steps"] = accumulation
    for strategy in context_strategies(raw, mesh, pinned):
      with_strategy = {**overrides, "context_parallel_strategy": strategy} if strategy else overrides
      if mesh["stage"] > 1:
        for microbatches in (mesh["stage"], 2 * mesh["stage"]):
          plans.append(Candidate({**with_strategy, "num_pipeline_microbatches": microbatches}))
      else:
        plans.append(Candidate(with_strategy))
  return plans


def context_strategies(raw: dict[str, Any], mesh: dict[str, int], pinned: set[str]) -> list[str]:
  """The context_parallel_strategy values worth a compile on this layout ("" = the config's own): with the
  sequence split, all_gather and, where the query heads split over tensor x context, ulysses."""
  if mesh["sequence"] == 1 or "context_parallel_strategy" in pinned:
    return [""]
  out = ["all_gather"]
  if raw["base_num_query_heads"] % (mesh["tensor"] * mesh["sequence"]) == 0:
    out.append("ulysses")
  return out


def validate(plan: Candidate, raw: dict[str, Any], target: Target, num_slices: int) -> str | None:
  """None if the config validator accepts the plan (plan.config is then set), else its one-line reason."""
  try:
    plan.config = validation.validate_and_derive(
      {**raw, **plan.overrides, "run_name": "plan"},
      num_devices=target.num_devices * num_slices,
      num_slices=num_slices,
      process_count=1,
      platform=target.platform,
    )
  except ConfigError as e:
    return str(e)
  return None


def memory_lower_bound(c: dict[str, Any]) -> float:
  """Bytes per device the plan needs at least: the train state (params + AdamW moments + gradients) over the axes
  that shard it, and the activations its remat policy keeps on the device."""
  weight = 2 if c["weight_dtype"] == "bfloat16" else 4
  act = 2 if c["dtype"] == "bfloat16" else 4
  mesh = dict(zip(choices.MESH_AXES, c["mesh_shape"]))
  # params, two AdamW moments and the gradients; what host offload keeps off the device between steps is left out,
  # so the bound stays below what the compiler can achieve
  copies = 4 - c["parameter_memory_host_offload"] - 2 * c["optimizer_memory_host_offload"]
  state = c["num_params"] * weight * copies / (c["num_devices"] / mesh["data"])
  # tokens on one device: the batch splits over data x fsdp x expert, the sequence over sequence
  tokens = c["micro_batch_size"] * c["max_target_length"] / math.prod(mesh[a] for a in ("data", "fsdp", "expert"))
  emb, q, kv, hd = c["base_emb_dim"], c["base_num_query_heads"], c["base_num_kv_heads"], c["head_dim"]
  tp = mesh["tensor"]  # heads and the MLP's hidden units are split over tensor
  # The residual stream (activation_embed) is split over tensor too, except where the partitioner bug keeps it whole.
  emb_tp = 1 if sharding.swaps_batch_shards(c["logical_axis_rules"], mesh) else tp
  qkv = (q + 2 * kv) * hd / tp
  per_token = {  # values a layer keeps per token on the device under each policy (the layer input always)
    "full": emb / emb_tp,
    "save_qkv_proj": emb / emb_tp + qkv,
    "save_dot_except_mlp": 2 * emb / emb_tp + qkv,
    "minimal": 2 * emb / emb_tp + qkv + 2 * c["base_mlp_dim"] / tp,
  }.get(c["remat_policy"], emb / emb_tp)
  if c["remat_policy"] == "custom" and c["decoder_layer_input"] == "offload":
    per_token = 0.0
  layers = c["base_num_decoder_layers"] / mesh["stage"]
  return state + layers * tokens / mesh["sequence"] * per_token * act


def recomputed_flops(c: dict[str, Any]) -> float:
  """Forward matmul FLOPs per step that the remat policy runs again in the backward pass, at least: each of a
  layer's matmuls whose output the backward needs (q, k, v and the attention for the attention's gradients, the
  output projection for the second norm's input, the MLP's input projections for its gate) and that the policy
  neither keeps nor offloads. The MLP's output projection is never needed, so never recomputed."""
  if c["remat_policy"] == "none":
    return 0.0
  kept = set(sum(choices.placement(c), ()))
  tokens = c["global_batch_size_to_train_on"] * c["max_target_length"]
  emb, d, q, kv = c["base_emb_dim"], c["head_dim"], c["base_num_query_heads"], c["base_num_kv_heads"]
  qkv_names = {"query_proj": q, "key_proj": kv, "value_proj": kv}
  if c["fused_qkv"]:
    per_token = 0 if "qkv_proj" in kept else 2 * emb * d * (q + 2 * kv)
  else:
    per_token = sum(2 * emb * d * heads for name, heads in qkv_names.items() if name not in kept)
  if "context" not in kept:
    per_token += 2 * 2 * c["max_target_length"] * q * d / 2  # q.k and p.v under the causal mask
  if "out_proj" not in kept:
    per_token += 2 * q * d * emb
  if c["num_experts"] > 1:
    gate_up = {"moe_mlpwi_0", "moe_mlpwi_1"} - kept
    per_token += len(gate_up) * 2 * emb * c["moe_mlp_dim"] * c["num_experts_per_tok"]
  else:
    gate_up = ({"mlpwi"} if c["fused_mlp"] else {"mlpwi_0", "mlpwi_1"}) - kept
    per_token += len(gate_up) * 2 * emb * c["base_mlp_dim"] * (2 if c["fused_mlp"] else 1)
  return float(c["base_num_decoder_layers"] * tokens * per_token)


def optimistic_seconds(c: dict[str, Any], target: Target) -> float:
  """A lower bound on the step time: matmul FLOPs (with recomputation) at the matmul rate the model uses, or the
  FSDP weight gathers and gradient reductions, the data-parallel gradient all-reduce and the tensor-parallel
  activation traffic at the chip's full ICI send bandwidth, whichever is longer (all of it hidden under compute at
  best: windowed einsums overlap even the tensor-parallel transfers)."""
  chip = target.chip
  mesh = dict(zip(choices.MESH_AXES, c["mesh_shape"]))
  per_device = (flops.training_flops_per_step(Config(c))["total"] + recomputed_flops(c)) / c["num_devices"]
  compute = per_device / (chip.peak_bf16_tflops * 1e12 * MATMUL_EFFICIENCY)
  send = chip.ici_send_bytes_per_s
  weight = 2 if c["weight_dtype"] == "bfloat16" else 4
  shard = c["num_params"] / (c["num_devices"] / mesh["data"])
  fsdp = mesh["fsdp"] * mesh["sequence"]
  gathers = 3 * shard * 2 * (fsdp - 1) * c["gradient_accumulation_steps"] + shard * weight * (fsdp - 1)
  tokens = c["micro_batch_size"] * c["max_target_length"] / c["num_devices"] * mesh["tensor"]
  tensor = 4 * 2 * c["base_num_decoder_layers"] * tokens * c["base_emb_dim"] * 2 * (mesh["tensor"] - 1) / mesh["tensor"]
  tensor *= c["gradient_accumulation_steps"]
  data = 2 * shard * 4 * (mesh["data"] - 1) / mesh["data"]  # the float32 gradient all-reduce over data
  return max(compute, (gathers + data + tensor) / send)


def prune(
  plans: list[Candidate], raw: dict[str, Any], target: Target, num_slices: int
) -> tuple[list[Candidate], dict[str, list[tuple[Candidate, Any]]]]:
  """(plans that may fit, fastest optimistic first; the others by kind: "invalid" with the validator's reason,
  "does not fit" with the bytes per device they need at least, "smaller batch" with the batch of its family that is
  compiled instead). Every plan is in exactly one of them."""
  rejected: dict[str, list[tuple[Candidate, Any]]] = {"invalid": [], "does not fit": [], "smaller batch": []}
  kept = []
  hbm = target.chip.hbm_bytes if target.chip else float("inf")
  for plan in plans:
    reason = validate(plan, raw, target, num_slices)
    if reason:
      rejected["invalid"].append((plan, reason))
      continue
    plan.memory_bound = memory_lower_bound(plan.config)
    if plan.memory_bound > hbm:
      rejected["does not fit"].append((plan, plan.memory_bound))
      continue
    plan.optimistic_s = optimistic_seconds(plan.config, target) if target.chip else 0.0
    kept.append(plan)
  largest = _largest_batches(kept)
  chosen = {id(plan) for plan in largest}
  rejected["smaller batch"] = [(plan, None) for plan in kept if id(plan) not in chosen]
  kept = sorted(largest, key=_order)
  return kept, rejected


def _largest_batches(plans: list[Candidate], keep: int = 2) -> list[Candidate]:
  """Per layout / remat / attention / accumulation, only the `keep` largest batches that pass the memory bound:
  a smaller batch of the same family moves the same weights for fewer tokens, so it is never faster per token."""
  families: dict[str, list[Candidate]] = {}
  for plan in plans:
    family = {k: v for k, v in plan.overrides.items() if k != "per_device_batch_size"}
    families.setdefault(repr(sorted(family.items())), []).append(plan)
  out = []
  for members in families.values():
    out += sorted(members, key=lambda p: -p.overrides["per_device_batch_size"])[:keep]
  return out


def _order(plan: Candidate) -> tuple:
  """Fastest optimistic time per token first; among equals the plans with fewer moving parts (no host offload, no
  pipeline, the flash kernel), then the larger batch."""
  c = plan.config
  return (
    round(plan.optimistic_s / _tokens(c), 12),
    "offloaded" in c["remat_policy"],
    c["num_pipeline_stages"] > 1,
    c["attention_kernel"] != "splash",
    -c["per_device_batch_size"],
  )


def _tokens(c: dict[str, Any]) -> float:
  return c["global_batch_size_to_train_on"] * c["max_target_length"]

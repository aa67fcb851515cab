"""Every closed set of values a config key takes, as plain data: the one list each, read by the validator, the
layers, the planner and the data tools alike. Nothing here imports jax, so a config is checked before any runtime
starts.

Remat: the layer code tags activations with `checkpoint_name` under the names in REMAT_NAMES. A `remat_policy` is
either a preset (a fixed choice of names kept in device memory or offloaded to pinned host memory), `full` (keep
nothing but the layer's input, recompute the rest), `none` (no rematerialisation), or `custom`: each name's own
config key (`query_proj: offload`, `mlpwi_0: device`, ...) says `remat`, `device` or `offload`. The presets are
MaxText's, by the same names, so a MaxText command line keeps its meaning.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

# The mesh axes, in mesh order. Config keys use MaxText's "pipeline" where the mesh axis is called "stage". The
# ensemble's members never talk to each other, so their axis is the outermost (slowest links, DCN included).
MESH_AXES = ("ensemble", "data", "stage", "fsdp", "sequence", "tensor", "expert")
AXIS_KEY = {
  "ensemble": "ensemble",
  "data": "data",
  "stage": "pipeline",
  "fsdp": "fsdp",
  "sequence": "sequence",
  "tensor": "tensor",
  "expert": "expert",
}
# context_parallel_strategy / _reorder_strategy: MaxText's values (parallel/context.py: what MaxLite computes).
CONTEXT_PARALLEL_STRATEGIES = ("all_gather", "ring", "ulysses", "usp")
CONTEXT_REORDER_STRATEGIES = ("auto", "dual_chunk_swap", "striped")
DTYPES = ("float32", "bfloat16")
DATASET_TYPES = ("synthetic", "grain")
SYNTHETIC_TOKENS = ("patterns", "uniform")
TOKENIZER_TYPES = ("sentencepiece", "huggingface", "tiktoken")  # MaxText's names
FILE_TYPES = ("arrayrecord", "parquet", "jsonl")  # grain_file_type
ENSEMBLE_DATA = ("same", "distinct")
FILE_SUFFIXES = {"arrayrecord": ".array_record", "parquet": ".parquet", "jsonl": ".jsonl"}
# The attention key's values; MaxText's spellings map onto MaxLite's (flash is its TPU splash kernel).
ATTENTION = ("autoselected", "dot_product", "splash", "cudnn", "flash", "cudnn_flash_jax")
ROPE_TYPES = ("default", "llama3.1", "yarn")
PROFILERS = ("", "xplane")
DECODE_SAMPLING_STRATEGIES = ("greedy", "weighted", "topk", "nucleus")
# lora_module_path's default: every attention projection (q/k/v/out, the fused qkv, MLA's) and MLP projection (gate,
# up, down; DeepSeek's shared experts) of every layer. A pipelined run applies each layer as a module of its own, so
# the prefix is optional. Here, not in layers/lora.py, so config validation can match it without importing layers.
LORA_DEFAULT_MODULES = r"(decoder/\w*layers(_\d+)?/)?(self_attention/\w+|mlp/\w+|shared_experts/\w+)"
LORA_WEIGHT_QTYPES = ("", "nf4", "int8", "int4")  # QLoRA: how Qwix stores the frozen base (layers/lora.py)
QUANTIZATIONS = ("", "int8", "fp8", "fp8_full")  # quantized training through Qwix (layers/quantization.py)
# Qwix's calibration methods (qwix/_src/core/qarray.py calibrate): absmax or minmax with an optional scale, rms with
# a scale, fixed with a range.
_NUMBER = r"-?\d+(\.\d*)?(e-?\d+)?"
CALIBRATION_METHOD = re.compile(rf"(absmax|minmax)(,{_NUMBER})?|rms,{_NUMBER}|fixed,({_NUMBER},)?{_NUMBER}")
CALIBRATION_KEYS = (
  "weight_quantization_calibration_method",
  "act_quantization_calibration_method",
  "bwd_quantization_calibration_method",
)
# train_data_columns (MaxText's key) of each post-training record kind; the first of a kind is its default.
SFT_COLUMNS = (("messages",), ("prompt", "completion"))
DPO_COLUMNS = (("prompt", "chosen", "rejected"), ("chosen", "rejected"))
GRPO_LOSS_ALGOS = ("grpo", "gspo-token")  # MaxText's rl.loss_algo
GRPO_LOSS_AGG_MODES = ("sequence-mean-token-mean", "token-mean", "sequence-mean")  # MaxText's rl.loss_agg_mode
# use_grpo with no data named: the shipped arithmetic problems (MaxLite/data/arithmetic.py) and their answers.
GRPO_SHIPPED_TRAIN = "assets/grpo/arithmetic-train.jsonl"
GRPO_SHIPPED_EVAL = "assets/grpo/arithmetic-eval.jsonl"

# Every name a layer tags, in the order base.yml lists their `custom` keys.
REMAT_NAMES = (
  "decoder_layer_input",  # the layer's input (the scan saves it anyway; offload moves that copy to the host)
  "query_proj",  # q, k, v after projection, q/k norm and RoPE: what attention reads
  "key_proj",
  "value_proj",
  "qkv_proj",  # the fused q/k/v projection before it is split (fused_qkv=true)
  "context",  # attention's output, before the output projection
  "out_proj",  # the output projection (the attention block's result)
  "mlpwi_0",  # the gate projection
  "mlpwi_1",  # the up projection
  "mlpwi",  # the fused gate+up projection (fused_mlp=true)
  "mlpwo",  # the MLP (or MoE) block's result
  "moe_mlpwi_0",  # per-expert gate, up and down projections of the dispatched tokens
  "moe_mlpwi_1",
  "moe_mlpwo",
)
PLACEMENTS = ("remat", "device", "offload")

_QKV = ("query_proj", "key_proj", "value_proj", "qkv_proj")
_MLP = ("mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo")
_MINIMAL = (*_QKV, "out_proj", *_MLP)


class Placement(NamedTuple):
  on_device: tuple[str, ...]
  offloaded: tuple[str, ...]


# MaxText HEAD's presets (layers/decoders.py get_remat_policy and maxtext_utils.get_save_and_offload_names), plus
# MaxLite's save_dot_except_mlp_offloaded.
PRESETS: dict[str, Placement] = {
  "minimal": Placement(_MINIMAL, ()),
  "minimal_with_context": Placement((*_MINIMAL, "context"), ()),
  "save_dot_with_context_except_mlp": Placement((*_QKV, "context", "out_proj"), ()),
  "save_dot_except_mlpwi": Placement((*_QKV, "out_proj", "mlpwo"), ()),
  "save_dot_except_mlp": Placement((*_QKV, "out_proj"), ()),
  "save_qkv_proj": Placement(_QKV, ()),
  "save_out_proj": Placement(("out_proj",), ()),
  "qkv_proj_offloaded": Placement((), ("query_proj", "key_proj", "value_proj")),
  "minimal_offloaded": Placement((), _MINIMAL),
  "save_dot_except_mlp_offloaded": Placement((), (*_QKV, "out_proj")),
}
REMAT_POLICIES = ("none", "full", *PRESETS, "custom")


def placement(config: Mapping[str, Any] | Any) -> Placement:
  """The names `config`'s remat_policy keeps on the device and offloads; `custom` reads each name's key."""
  get = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key)
  policy = get("remat_policy")
  if policy in PRESETS:
    return PRESETS[policy]
  if policy == "custom":
    choice = {name: get(name) for name in REMAT_NAMES}
    return Placement(
      tuple(n for n in REMAT_NAMES if choice[n] == "device"), tuple(n for n in REMAT_NAMES if choice[n] == "offload")
    )
  return Placement((), ())

"""Each memory and layer option on 8 devices, as one declarative table (feature x layout, as torchtitan's integration
table): an option that computes the same thing another way (MLP token chunks, vocabulary tiles and slices, host
offload of the state, remat_policy=custom's offloaded activations) trains exactly like the same layout without it;
int8 (Qwix), which rounds, runs one device's int8 matmuls and trains like one device with it. Each option is checked
on one three-axis layout (fsdp x sequence x tensor), and on another only where it has code for that one (the MoE
block's under experts; int8's module paths in the pipeline and in DeepSeek's MLA and shared experts).

The layouts themselves (each against one device) are tests/parallel/test_parallelism.py's; each option's math, its
one-line errors and its memory and HLO checks stay in its own file (tests/training/test_memory_options.py,
tests/layers/test_layer_options.py, tests/layers/test_quantization.py). The references (the layout without the
option; one device) are support.layouts.cached_rows: each runs once per test process, for every row and file that
asks for it."""

import dataclasses
import re
from collections.abc import Callable

import numpy as np
import pytest
from support.config import first_devices, make_config
from support.layouts import DENSE, RUN, cached_rows, loss_curves, train_layout

from MaxLite.config import choices

LAYOUTS = {
  "fsdp2_sequence2_tensor2": ("ici_fsdp_parallelism=2", "ici_sequence_parallelism=2", "ici_tensor_parallelism=2"),
  "expert2_fsdp2_tensor2": ("ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
  "stage2_fsdp2_tensor2": ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
}
# The model a row's run and its reference share. z-loss on, so that a split loss's z term is compared too; the fused
# kernels and the tied head are a model of their own (they change the parameters a run starts from).
MODELS = {
  "dense": (*DENSE, "z_loss_multiplier=1e-3"),
  "fused_tied": (*DENSE, "z_loss_multiplier=1e-3", "fused_qkv=true", "fused_mlp=true", "logits_via_embedding=true"),
  "moe": ("model_name=tiny-moe",),  # sparse_matmul: the grouped matmuls with experts split over devices
  "deepseek": ("model_name=tiny-deepseek", "sparse_matmul=false"),
}
INT8 = ("quantization=int8", "use_qwix_quantization=true")
# Every activation name somewhere: the layer input, a separate and the fused projections and the MoE block's, kept on
# the device or offloaded to host memory (the rest remat).
CUSTOM_REMAT = (
  *("remat_policy=custom", "decoder_layer_input=offload", "query_proj=device", "key_proj=offload"),
  *("value_proj=device", "qkv_proj=offload", "out_proj=offload", "mlpwi_0=device", "mlpwi=device"),
  *("mlpwo=offload", "moe_mlpwi_0=offload", "moe_mlpwo=device", "context=device"),
)

# What a row's run is compared with.
SAME_LAYOUT = "the same layout without the option: losses and gradient norms within rtol"
ONE_DEVICE = (
  "one device with the option: the same int8 matmuls, and a first loss at least twice as close to one device's int8 "
  "run as to its unquantized one"
)
INT8_MATMULS = "one device with the option: the same int8 matmuls"


@dataclasses.dataclass(frozen=True)
class Row:
  feature: str
  overrides: tuple[str, ...]
  on: tuple[tuple[str, str], ...]  # (model, layout) pairs
  against: str
  rtol: float | None = 1e-5
  takes_effect: Callable | None = None  # config on 8 devices -> bool: the option is really on (equal is no proof)


THREE_AXES = ("dense", "fsdp2_sequence2_tensor2")
FUSED_THREE_AXES = ("fused_tied", "fsdp2_sequence2_tensor2")
MOE_EXPERTS = ("moe", "expert2_fsdp2_tensor2")
TABLE = (
  # The MLP's parts see each device's own tokens: sequence shards and batch shards both split them.
  Row("mlp_chunks", ("num_mlp_chunks=4",), (THREE_AXES,), SAME_LAYOUT, takes_effect=lambda c: c.mlp_chunks == 4),
  Row(  # the fused gate+up kernel's copies, and a remat policy that saves the parts' named activations
    "mlp_chunks_minimal_remat",
    ("num_mlp_chunks=4", "remat_policy=minimal"),
    (FUSED_THREE_AXES,),
    SAME_LAYOUT,
    takes_effect=lambda c: c.mlp_chunks == 4,
  ),
  Row("vocab_tiles", ("num_vocab_tiling=4",), (THREE_AXES,), SAME_LAYOUT),
  # The head split over tensor, the untied kernel and the tied embedding's transpose.
  Row(
    "vocab_slices",
    ("num_vocab_slices=4",),
    (THREE_AXES, FUSED_THREE_AXES),
    SAME_LAYOUT,
    takes_effect=lambda c: c.vocab_slices == 4,
  ),
  Row(
    "state_host_offload",
    ("parameter_memory_host_offload=true", "optimizer_memory_host_offload=true"),
    (THREE_AXES,),
    SAME_LAYOUT,
    rtol=1e-6,
    takes_effect=lambda c: _state_in_host_memory(c),
  ),
  # Offloaded activations: the fused projections' names on the dense model, the MoE block's with experts split.
  Row(
    "custom_remat",
    CUSTOM_REMAT,
    (FUSED_THREE_AXES, MOE_EXPERTS),
    SAME_LAYOUT,
    takes_effect=lambda c: bool(choices.placement(c).offloaded) and _offloads_activations(c),
  ),
  Row("int8", INT8, (THREE_AXES,), ONE_DEVICE, rtol=None),
  # Where the projections sit elsewhere: the pipeline applies each layer by itself (module paths without decoder/
  # layers/), DeepSeek has MLA and shared experts, its routed experts split. DeepSeek's first loss is no measure: on a
  # 2-core Intel Xeon VM (2026-12-06) it sat 1.48e-2 from one device's int8 run and 1.40e-2 from the unquantized one
  # (router top-k flips amplify the layout's last-bit differences more than int8 moves the loss).
  Row(
    "int8", INT8, (("dense", "stage2_fsdp2_tensor2"), ("deepseek", "expert2_fsdp2_tensor2")), INT8_MATMULS, rtol=None
  ),
)
CASES = [
  pytest.param(row, model, layout, id=f"{row.feature}-{model}-{layout}") for row in TABLE for model, layout in row.on
]


def _eight_devices(model, layout, *option):
  return (*MODELS[model], *option, "per_device_batch_size=1", *LAYOUTS[layout])


def _one_device(model, *option):
  return (*MODELS[model], *option, "per_device_batch_size=8")


@pytest.mark.slow
@pytest.mark.parametrize("row, model, layout", CASES)
def test_an_option_on_8_devices_trains_like_its_reference(tmp_path, row, model, layout):
  on_8 = _eight_devices(model, layout, *row.overrides)
  if row.takes_effect is not None:
    assert row.takes_effect(make_config(*RUN, *on_8, num_devices=8))
  if row.against == SAME_LAYOUT:
    got = loss_curves(train_layout(tmp_path, 8, *on_8))
    want = loss_curves(cached_rows(8, *_eight_devices(model, layout)))
    np.testing.assert_allclose(got, want, rtol=row.rtol, err_msg=f"{row.feature}: [losses, grad norms]")
    return
  int8_dots = {8: _int8_dots(tmp_path, on_8, 8), 1: _int8_dots(tmp_path, _one_device(model, *row.overrides), 1)}
  assert int8_dots[8] == int8_dots[1] > 0, int8_dots
  if row.against == INT8_MATMULS:
    return
  # Not equal to 1e-5 as unquantized layouts are: a projection rounds as one device does on the same inputs
  # (test_quantization's test_a_sharded_projection_rounds_as_one_device), but its inputs differ from one device's in
  # the last float bits (sums in another order), a few values then round to the next int8 step, and each layer after
  # amplifies that. So the first loss, the forward pass at the same initial parameters, must be at least twice as
  # close to the one-device int8 run's as to the unquantized run's (a layout that skipped quantization would sit on
  # the latter).
  first = loss_curves(train_layout(tmp_path, 8, *on_8))[0][0]
  with_it = loss_curves(cached_rows(1, *_one_device(model, *row.overrides)))[0][0]
  without = loss_curves(cached_rows(1, *_one_device(model)))[0][0]
  from_int8, from_plain = abs(first - with_it), abs(first - without)
  print(f"first loss {first:.6f}: {from_int8:.2e} from one-device int8, {from_plain:.2e} from unquantized")
  assert from_int8 < from_plain / 2


def _int8_dots(tmp_path, overrides, n):
  """The int8 x int8 matmuls of the lowered train step (before XLA: each written matmul once)."""
  config = make_config(*RUN, f"base_output_directory={tmp_path}", "run_name=run", *overrides, num_devices=n)
  return len(re.findall(r"dot_general.*: \(tensor<[0-9x]*xi8>, tensor<[0-9x]*xi8>\)", _lowered_step(config, n)))


def _lowered_step(config, n=8):
  """The train step of `config` on n devices, lowered (traced, not compiled), as text."""
  from MaxLite.aot.compile_step import lower_train_step

  return lower_train_step(config, first_devices(n))[0].as_text()


def _state_in_host_memory(config):
  """Each parameter and optimizer state the lowered step returns is in pinned host memory (an offload skipped would
  train exactly the same)."""
  kinds = re.findall(
    r'result_info = "result\[0\]\.(params|opt_state)\[[^"]*", mhlo.memory_kind = "(\w+)"', _lowered_step(config)
  )
  return {part for part, _ in kinds} == {"params", "opt_state"} and {kind for _, kind in kinds} == {"pinned_host"}


def _offloads_activations(config):
  """The lowered step annotates where offloaded activations are placed (none without an offloading remat policy)."""
  return "_xla_buffer_placement" in _lowered_step(config)

"""Gemma 3 (decoder_block=gemma3), what only it does: the published configs' parameter counts equal transformers';
the sliding window is what the local layers see; the layouts that split what only it has (the local window over
sequence shards, the local/global layer pattern over pipeline stages) train like one device. Its conversion from
transformers (logits, greedy tokens, the exact export) is tests/checkpoint/test_hf_models.py's table, rows gemma3_*."""

import re

import numpy as np
import pytest
from support.config import make_config
from support.hf import hf_gemma3, maxlite_config, maxlite_logits, maxlite_params, token_ids
from support.layouts import cached_rows, loss_curves, train_layout

from MaxLite.checkpoint import hf as convert_hf
from MaxLite.cli.errors import ConfigError
from MaxLite.models.flops import training_flops_per_step

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_the_window_decides_local_layers_only(tmp_path):
  """Without the window (a window as long as the sequence) the logits change; the global layer alone does not
  see the window: a model whose every layer were global would differ too."""
  model, path = hf_gemma3(tmp_path)
  step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])
  config = maxlite_config(step_dir)
  params = maxlite_params(config, step_dir)
  ids = token_ids(model.config.vocab_size)
  windowed = maxlite_logits(config, params, ids)
  unwindowed = maxlite_logits(maxlite_config(step_dir, "sliding_window_size=64"), params, ids)
  # The first 5 positions see the same keys either way; later ones do not.
  np.testing.assert_allclose(windowed[:, :5], unwindowed[:, :5], rtol=1e-5, atol=1e-5)
  assert np.abs(windowed[:, 5:] - unwindowed[:, 5:]).max() > 1e-3


PUBLISHED = {  # transformers' count of the text model (tied embedding once), Gemma3TextConfig of each checkpoint
  "gemma3-4b": 3_880_263_168,
  "gemma3-12b": 11_766_034_176,
  "gemma3-27b": 27_009_346_304,
}


@pytest.mark.parametrize("model_name", list(PUBLISHED))
def test_gemma3_configs_have_transformers_parameter_count(model_name):
  config = make_config(f"model_name={model_name}")
  assert config.num_params == PUBLISHED[model_name]
  hf = models_hf_config(config)
  hf_config = transformers.AutoConfig.for_model(**hf)
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
  assert type(model).__name__ == "Gemma3ForCausalLM"
  assert sum(p.numel() for p in model.parameters()) == config.num_params


def models_hf_config(config):
  from MaxLite import models

  return models.family(config.decoder_block).hf.config(config)


def test_local_layers_cost_only_their_window():
  long = make_config("model_name=tiny-gemma3", "max_target_length=256")
  full = make_config("model_name=tiny-gemma3", "max_target_length=256", "sliding_window_size=256")
  attention, full_attention = training_flops_per_step(long)["attention"], training_flops_per_step(full)["attention"]
  # 5 local layers at 16 - 16^2/512 = 15.5 keys a query, 1 global at 128: (5 * 15.5 + 128) / 6 of 128.
  assert attention / full_attention == pytest.approx((5 * 15.5 + 128) / 6 / 128)
  assert training_flops_per_step(long)["weights"] == training_flops_per_step(full)["weights"]


@pytest.mark.parametrize(
  "overrides, fragment",
  [
    (("mlp_activations=[silu,linear]",), "decoder_block=gemma3 needs mlp_activations"),
    (("sliding_window_size=0",), "sliding_window_size >= 1"),
    (("num_experts=4",), "dense MLP"),
    (("final_logits_soft_cap=30", "num_vocab_tiling=2"), "final_logits_soft_cap > 0 needs num_vocab_tiling=1"),
    (
      ("decoder_block=gemma4",),
      "decoder_block='gemma4' is not one of: 'deepseek', 'gemma3', 'gpt_oss', 'llama2', 'mistral'",
    ),
  ],
)
def test_bad_gemma3_settings_fail_with_one_line(overrides, fragment):
  with pytest.raises(ConfigError, match=re.escape(fragment)) as caught:
    make_config("model_name=tiny-gemma3", *overrides)
  assert "\n" not in str(caught.value)


# The tiny Gemma 3 with 8 query and 8 kv heads, so that tensor=8 can split them; test_parallelism's short run.
GEMMA = ("model_name=tiny-gemma3", "base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=8")


@pytest.fixture(scope="module")
def gemma_reference():
  return loss_curves(cached_rows(1, *GEMMA, "per_device_batch_size=8"))


# What only Gemma 3 has under a layout: the local layers' window over sequence shards (with heads split over tensor),
# and the local/global layer pattern split into pipeline stages. Heads split over data x fsdp x tensor with one- and
# two-row batch shards are tests/parallel/test_batch_shard_layouts.py's (tiny-gemma3); the plain model's layouts are
# tests/parallel/test_parallelism.py's.
@pytest.mark.slow
@pytest.mark.parametrize(
  "mesh",
  [
    ("ici_sequence_parallelism=4", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=1"),
    ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"),
  ],
  ids=["sequence4_tensor2", "stage2_fsdp4"],
)
def test_gemma3_layouts_match_single_device(tmp_path, gemma_reference, mesh):
  losses, grad_norms = loss_curves(train_layout(tmp_path, 8, *GEMMA, "per_device_batch_size=1", *mesh))
  np.testing.assert_allclose(losses, gemma_reference[0], rtol=1e-5)
  np.testing.assert_allclose(grad_norms, gemma_reference[1], rtol=1e-5)


@pytest.mark.slow
def test_splash_runs_the_local_kernel_in_local_layers_and_the_global_one_in_global_layers():
  """The whole model with attention=splash (lax.cond between the windowed and the causal kernel per scanned layer)
  gives the dot-product path's logits."""
  import jax

  from MaxLite.models import build

  common = ("model_name=tiny-gemma3", "max_target_length=128", "per_device_batch_size=1")
  logits = {}
  for kernel in ("dot_product", "splash"):
    config = make_config(*common, f"attention={kernel}")
    model = build.model(config)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, 128))
    pos, seg = np.arange(128)[None], np.ones((1, 128), np.int32)
    params = model.init(jax.random.key(0), ids, pos, seg)
    logits[kernel] = np.asarray(jax.jit(model.apply)(params, ids, pos, seg))
  np.testing.assert_allclose(logits["splash"], logits["dot_product"], atol=2e-5)


@pytest.mark.parametrize(
  "overrides",
  [(), ("rope_linear_scaling_factor=8", "rope_max_timescale=1000000", "local_rope_max_timescale=10000")],
  ids=["1b_like", "4b_like"],
)
def test_exported_gemma3_rope_reads_the_same_in_transformers_4_and_5(overrides):
  """transformers 4.x and vLLM read rope_theta, rope_local_base_freq and rope_scaling: without them the x8 linear
  scaling of the global layers would be dropped."""
  from support.hf import check_both_rope_forms

  from MaxLite import models

  config = make_config("model_name=tiny-gemma3", *overrides)
  check_both_rope_forms(models.family("gemma3").hf.config(config), config)

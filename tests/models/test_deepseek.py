"""DeepSeek-V3 (decoder_block=deepseek), what only it does: the published configs' parameter counts equal
transformers'; the routing bias moves towards balance and only by its update; every parallelism layout trains like one
device; YaRN's mscales import and export as transformers computes them. Its conversion from transformers (logits on both
MoE paths, greedy tokens, the exact export) is tests/checkpoint/test_hf_models.py's table, rows deepseek_*."""

import re

import numpy as np
import pytest
from support.config import first_devices, make_config
from support.hf import (
  DEEPSEEK_YARN,
  check_both_rope_forms,
  hf_deepseek,
  maxlite_config,
  maxlite_logits,
  maxlite_params,
  token_ids,
)
from support.layouts import cached_rows, loss_curves, train_layout

from MaxLite.checkpoint import hf as convert_hf
from MaxLite.cli.errors import ConfigError
from MaxLite.data import BATCH_KEYS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_deepseek_configs_have_transformers_parameter_count():
  """deepseek3-671b against DeepseekV3ForCausalLM (whose routing bias is a buffer, counted here as a parameter) and
  deepseek2-16b against DeepSeek-V2-Lite's DeepseekV2ForCausalLM, built on the meta device."""
  from MaxLite import models

  v3 = make_config("model_name=deepseek3-671b")
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.for_model(**models.family("deepseek").hf.config(v3))
    )
  biases = sum(b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
  assert sum(p.numel() for p in model.parameters()) == 671_026_404_352
  assert v3.num_params == 671_026_404_352 + biases

  v2 = make_config("model_name=deepseek2-16b")
  lite = transformers.DeepseekV2Config(
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
  )
  with torch.device("meta"):
    model = transformers.DeepseekV2ForCausalLM(lite)
  assert v2.num_params == sum(p.numel() for p in model.parameters()) == 15_706_484_224


def _bias(params):
  return np.asarray(params["decoder"]["moe_layers"]["moe"]["score_correction_bias"])


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.0, 0.01])
def test_routing_bias_moves_only_by_its_update_towards_balance(tmp_path, rate):
  """One step: each MoE layer's bias entry moves by exactly +-rate or 0 (never by AdamW's decay, whatever
  adam_weight_decay), up for the experts chosen least; rate 0 leaves it at 0."""
  import jax

  from MaxLite.parallel.mesh import create_mesh
  from MaxLite.training import builder
  from MaxLite.training.train_state import create_train_state

  config = make_config(
    "model_name=tiny-deepseek",
    f"routed_bias_update_rate={rate}",
    "adam_weight_decay=0.5",
    "max_target_length=32",
    "per_device_batch_size=4",
    "dataset_type=synthetic",
    "eval_interval=-1",  # the last step's eval: not what these tests compare
    num_devices=1,
  )

  mesh = create_mesh(config, first_devices(1))
  with jax.set_mesh(mesh):
    pieces = builder.training(config, mesh)
    state = create_train_state(pieces.model, pieces.tx, config, pieces.shardings)
    batch = {k: np.random.default_rng(0).integers(1, 100, (4, 32)).astype(np.int32) for k in BATCH_KEYS}
    batch.update(inputs_segmentation=np.ones((4, 32), np.int32), targets_segmentation=np.ones((4, 32), np.int32))
    batch.update(inputs_position=np.broadcast_to(np.arange(32), (4, 32)).astype(np.int32))
    before = _bias(state.params)  # the step donates the state
    _, extra = pieces.model.apply(
      {"params": state.params},
      batch["inputs"],
      batch["inputs_position"],
      batch["inputs_segmentation"],
      mutable="intermediates",
    )
    counts = np.asarray(extra["intermediates"]["moe"][0]["expert_counts"])  # [MoE layers, experts] of this batch
    new_state, _ = pieces.step(state, batch)
  moved = _bias(new_state.params) - before
  assert before.shape == counts.shape == (3, 8) and not before.any()
  assert counts.sum() == 3 * 4 * 32 * 2  # every token's two choices in every MoE layer
  expected = np.float32(rate) * np.sign(counts.mean(axis=-1, keepdims=True) - counts)
  np.testing.assert_array_equal(moved, expected)
  assert (moved > 0).any() == (moved < 0).any() == (rate > 0)


@pytest.mark.parametrize(
  "overrides, fragment",
  [
    (("n_routing_groups=3",), "n_routing_groups=3 must divide num_experts=8"),
    (("topk_routing_group=5",), "topk_routing_group=5 <= n_routing_groups"),
    (("num_experts=1",), "decoder_block=deepseek is a mixture of experts"),
    (("first_num_dense_layers=4",), "first_num_dense_layers=4 must be in [0, base_num_decoder_layers=4)"),
    (("routed_score_func=relu",), "routed_score_func='relu' is not one of"),
    (("ici_pipeline_parallelism=2",), "pipeline parallelism needs one kind of layer"),
  ],
)
def test_bad_deepseek_settings_fail_with_one_line(overrides, fragment):
  with pytest.raises(ConfigError, match=re.escape(fragment)) as caught:
    make_config("model_name=tiny-deepseek", *overrides, num_devices=2)
  assert "\n" not in str(caught.value)


DEEPSEEK = ("model_name=tiny-deepseek", "sparse_matmul=false")
RAGGED_DOT = ("sparse_matmul=true", "megablox=false")


@pytest.fixture(scope="module")
def deepseek_reference():
  return loss_curves(cached_rows(1, *DEEPSEEK, "per_device_batch_size=8"))


# What only DeepSeek has under a layout: its routed experts split (the one-hot dispatch, and ragged_dot's grouped
# matmuls with each sequence shard's tokens), MLA's and the shared experts' weights sharded. Heads split over tensor
# with one- and two-row batch shards are tests/parallel/test_batch_shard_layouts.py's (tiny-deepseek); the plain
# model's layouts are tests/parallel/test_parallelism.py's.
@pytest.mark.slow
@pytest.mark.parametrize(
  "mesh",
  [
    ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2"),
    ("ici_sequence_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2", *RAGGED_DOT),
  ],
  ids=["expert4_fsdp2", "sequence2_expert2_fsdp2_ragged_dot"],
)
def test_deepseek_layouts_match_single_device(tmp_path, deepseek_reference, mesh):
  losses, grad_norms = loss_curves(train_layout(tmp_path, 8, *DEEPSEEK, "per_device_batch_size=1", *mesh))
  np.testing.assert_allclose(losses, deepseek_reference[0], rtol=1e-5)
  np.testing.assert_allclose(grad_norms, deepseek_reference[1], rtol=1e-5)


# Every way transformers 5.23 accepts YaRN's scales (modeling_rope_utils._compute_yarn_parameters for cos/sin,
# DeepseekV3Attention's yarn_apply_mscale for the softmax): mscale alone changes nothing there, mscale_all_dim alone
# scales only the softmax, the two together scale cos/sin by their ratio, attention_factor overrides that ratio.
MSCALES = {
  "none": {},
  "only_mscale": dict(mscale=0.707),
  "only_mscale_all_dim": dict(mscale_all_dim=0.707),
  "both_equal": dict(mscale=0.707, mscale_all_dim=0.707),
  "both_different": dict(mscale=1.0, mscale_all_dim=0.4),
  "attention_factor": dict(attention_factor=1.3, mscale=1.0, mscale_all_dim=0.707),
}


# Every mscale case at factor 4, and one at DeepSeek-V3's 40: the factor changes the numbers, not the code path (the
# formulas at 40 are test_maxlite_yarn_exports_the_scales_it_computes's).
@pytest.mark.slow
@pytest.mark.parametrize(
  "mscales,factor", [*((name, 4.0) for name in MSCALES), ("both_different", 40.0)], ids=lambda v: str(v)
)
def test_yarn_mscales_import_and_export_as_transformers_computes_them(tmp_path, mscales, factor):
  """The logits of transformers' model, of MaxLite's import of it, and of transformers' reload of MaxLite's export."""
  rope = dict(DEEPSEEK_YARN, factor=factor, **MSCALES[mscales])
  for key in ("mscale", "mscale_all_dim"):
    if key not in MSCALES[mscales]:
      del rope[key]
  context = int(factor * rope["original_max_position_embeddings"])
  model, path = hf_deepseek(
    tmp_path, q_lora_rank=None, num_hidden_layers=2, rope_parameters=rope, max_position_embeddings=context
  )
  step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])
  config = maxlite_config(step_dir, "sparse_matmul=false")
  ids = token_ids(model.config.vocab_size)
  with torch.no_grad():
    expected = model(torch.tensor(ids)).logits.numpy()
  diff = np.abs(maxlite_logits(config, maxlite_params(config, step_dir), ids) - expected).max()
  print(f"yarn {mscales} factor {factor}: max abs logit difference {diff:.2e}")
  assert diff <= 2e-5

  convert_hf.to_hf(step_dir, str(tmp_path / "back"), [])
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), attn_implementation="eager")
  with torch.no_grad():
    again = reloaded(torch.tensor(ids)).logits.numpy()
  assert np.abs(again - expected).max() <= 1e-6


@pytest.mark.parametrize("factor", [4, 40])
@pytest.mark.parametrize(
  "mscale, attention_factor", [(0.0, -1.0), (0.707, -1.0), (0.0, 1.0), (0.707, 1.3), (1.0, 0.9), (0.0, 1.2)]
)
def test_maxlite_yarn_exports_the_scales_it_computes(factor, mscale, attention_factor):
  """A MaxLite config (mscale 0 included, which exported as 'no mscale' before) written out by to_hf: transformers 5
  computes MaxLite's frequencies, cos/sin factor and softmax scale from it, and 4.x reads the same."""
  from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding, yarn_apply_mscale

  from MaxLite import models
  from MaxLite.layers.mla import mla_query_scale
  from MaxLite.layers.rope import rope_frequencies

  config = make_config(
    "model_name=tiny-deepseek",
    "rope_type=yarn",
    f"rope_factor={factor}",
    "original_max_position_embeddings=16",
    f"mscale={mscale}",
    *([f"rope_attention_factor={attention_factor}"] if attention_factor != -1 else []),
  )
  hf = models.family("deepseek").hf.config(config)
  check_both_rope_forms(hf, config)
  hf_config = transformers.DeepseekV3Config(**hf)
  rotary = DeepseekV3RotaryEmbedding(hf_config)
  frequencies, cos_sin = rope_frequencies(config, config.qk_rope_head_dim)
  np.testing.assert_allclose(frequencies, rotary.inv_freq.numpy(), rtol=2.5e-7, atol=0)
  assert cos_sin == pytest.approx(rotary.attention_scaling, rel=1e-12)
  head = config.qk_nope_head_dim + config.qk_rope_head_dim
  assert mla_query_scale(config) == pytest.approx(yarn_apply_mscale(hf_config.rope_parameters, head**-0.5), rel=1e-12)


@pytest.mark.slow
def test_a_model_run_with_mscale_0_exports_what_it_computes(tmp_path):
  """mscale=0 (no softmax factor) on a converted YaRN model: transformers' reload of the export gives MaxLite's
  logits (the export said 'no mscale', which transformers reads as cos/sin times 0.1 ln(factor) + 1)."""
  model, path = hf_deepseek(
    tmp_path, q_lora_rank=None, num_hidden_layers=2, rope_parameters=dict(DEEPSEEK_YARN), max_position_embeddings=64
  )
  step_dir = convert_hf.to_maxlite(path, str(tmp_path / "ml"), [])
  config = maxlite_config(step_dir, "sparse_matmul=false", "mscale=0")
  ids = token_ids(model.config.vocab_size)
  ours = maxlite_logits(config, maxlite_params(config, step_dir), ids)
  convert_hf.to_hf(step_dir, str(tmp_path / "back"), ["mscale=0"])
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), attn_implementation="eager")
  with torch.no_grad():
    theirs = reloaded(torch.tensor(ids)).logits.numpy()
  with torch.no_grad():
    original = model(torch.tensor(ids)).logits.numpy()
  assert np.abs(ours - original).max() > 2e-4  # mscale=0 is another model, visibly
  assert np.abs(ours - theirs).max() <= 2e-5

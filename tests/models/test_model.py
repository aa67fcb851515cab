"""Model math: scan == unrolled, remat policies change nothing, GQA, RoPE, segment masking, param count."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.config import make_config

from MaxLite.layers.attention import attention_mask, dot_product_attention
from MaxLite.layers.rope import apply_rope, default_frequencies
from MaxLite.models.transformer import Transformer, stack_layers, unstack_layers
from MaxLite.training.train_step import batch_loss_sums

SEQ = 32


def _batch(batch=2, seq=SEQ, seed=0, vocab=8192):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, vocab, size=(batch, seq + 1)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  ones = jnp.ones((batch, seq), jnp.int32)
  return {
    "inputs": tokens[:, :-1],
    "targets": tokens[:, 1:],
    "inputs_position": pos,
    "inputs_segmentation": ones,
    "targets_segmentation": ones,
  }


def _init_fn(config):
  return lambda rng, b: Transformer(config).init(rng, b["inputs"], b["inputs_position"], b["inputs_segmentation"])


def _init(config, batch):
  return nn.unbox(jax.jit(_init_fn(config))(jax.random.key(0), batch)["params"])


def _param_shapes(config, batch):
  """The parameter shapes init makes, without compiling or running it."""
  return nn.unbox(jax.eval_shape(_init_fn(config), jax.random.key(0), batch)["params"])


def _loss_and_grads(config, params, batch):
  fn = jax.value_and_grad(lambda p: batch_loss_sums(p, Transformer(config).apply, batch, jax.random.key(0), config)[0])
  return jax.jit(fn)(params)


def test_parameter_count_formula_matches_model():
  for overrides in (
    ["model_name=tiny"],
    ["model_name=tiny", "logits_via_embedding=true"],
    ["model_name=tiny", "attention_bias=true", "use_qk_norm=true"],
    ["model_name=tiny-moe"],
    ["model_name=tiny-moe", "base_moe_mlp_dim=48", "use_qk_norm=true"],
  ):
    config = make_config(*overrides, f"max_target_length={SEQ}")
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(_param_shapes(config, _batch()))) == config.num_params


@pytest.mark.slow
def test_scan_and_unrolled_layers_give_the_same_loss_and_grads():
  scanned = make_config("model_name=tiny", "scan_layers=true")
  unrolled = make_config("model_name=tiny", "scan_layers=false")
  batch = _batch()
  params = _init(scanned, batch)
  loss_s, grads_s = _loss_and_grads(scanned, params, batch)
  loss_u, grads_u = _loss_and_grads(unrolled, unstack_layers(params), batch)
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(stack_layers(grads_u))):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  # The unrolled model initialises the same parameter shapes under its own layout.
  assert jax.tree.structure(_init(unrolled, batch)) == jax.tree.structure(unstack_layers(params))


@pytest.fixture(scope="module")
def no_remat_reference():
  batch = _batch()
  reference = make_config("model_name=tiny", "remat_policy=none")
  params = _init(reference, batch)
  return batch, params, _loss_and_grads(reference, params, batch)


@pytest.mark.slow
@pytest.mark.parametrize(
  "policy", ["full", "minimal", "save_dot_except_mlp", "save_qkv_proj", "save_out_proj", "save_dot_except_mlpwi"]
)
def test_remat_policies_do_not_change_numbers(policy, no_remat_reference):
  batch, params, (loss_ref, grads_ref) = no_remat_reference
  loss, grads = _loss_and_grads(make_config("model_name=tiny", f"remat_policy={policy}"), params, batch)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  # Recomputed activations are rounded as XLA fuses them, so a gradient near zero may differ by a few float32 ulps of
  # its tensor's scale (measured: up to 1.3e-6 where the entries reach 2.6); a wrong recomputation is off by O(1).
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))


def _reference_attention(q, k, v, segment_ids):
  """Plain multi-head attention with kv heads repeated: what GQA must equal."""
  groups = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
  mask = attention_mask(segment_ids)[:, 0]
  scores = jnp.where(mask, scores, -1e30)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def test_grouped_query_attention_equals_repeated_kv_heads():
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(2, 8, 6, 4)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, 8, 2, 4)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, 8, 2, 4)), jnp.float32)
  seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0], [1] * 8], jnp.int32)
  mask = attention_mask(seg)
  np.testing.assert_allclose(
    dot_product_attention(q, k, v, mask), _reference_attention(q, k, v, seg), rtol=1e-5, atol=1e-6
  )


def test_rope_scores_depend_only_on_relative_position():
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

  def score(pq, pk):
    rq = apply_rope(q, jnp.asarray([[pq]]), default_frequencies(16, 10000.0))
    rk = apply_rope(k, jnp.asarray([[pk]]), default_frequencies(16, 10000.0))
    return float(jnp.sum(rq * rk))

  assert score(3, 1) == pytest.approx(score(10, 8), rel=1e-4)
  assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)
  # Position 0 is the identity rotation.
  np.testing.assert_allclose(apply_rope(q, jnp.asarray([[0]]), default_frequencies(16, 10000.0)), q)


def test_rope_rotates_halves_and_its_gradient_has_no_pad():
  """The rotate-half layout, element by element; and a backward pass with no pad (a slice's gradient), which on a
  GPU is a pad and an add fusion per rotated tensor per layer."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(2, 5, 3, 8)), jnp.float32)
  positions = jnp.asarray(rng.integers(0, 100, size=(2, 5)))
  frequencies = default_frequencies(8, 10000.0)
  angle = np.asarray(positions)[..., None, None] * frequencies  # [b, s, 1, half]
  x1, x2 = np.asarray(x)[..., :4], np.asarray(x)[..., 4:]
  expected = np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1)
  np.testing.assert_allclose(apply_rope(x, positions, frequencies), expected, rtol=1e-5, atol=1e-5)
  backward = jax.make_jaxpr(jax.grad(lambda x: apply_rope(x, positions, frequencies).sum()))(x)
  assert "pad" not in {eqn.primitive.name for eqn in backward.eqns}, backward


def test_packed_segments_do_not_see_each_other():
  config = make_config("model_name=tiny")
  batch = _batch(batch=1, seq=16)
  segments = jnp.asarray([[1] * 6 + [2] * 7 + [3] * 3], jnp.int32)
  positions = jnp.asarray([list(range(6)) + list(range(7)) + list(range(3))], jnp.int32)
  params = _init(config, batch)
  apply = jax.jit(lambda ids: Transformer(config).apply({"params": params}, ids, positions, segments))
  logits = apply(batch["inputs"])
  changed = batch["inputs"].at[0, :6].set(7).at[0, 13:].set(9)  # rewrite documents 1 and 3
  logits_changed = apply(changed)
  np.testing.assert_allclose(logits[0, 6:13], logits_changed[0, 6:13], rtol=1e-5, atol=1e-5)
  assert not np.allclose(logits[0, :6], logits_changed[0, :6])
  # Within a document the model is causal: changing a later token leaves earlier logits alone.
  later = batch["inputs"].at[0, 10].set(5)
  np.testing.assert_allclose(apply(later)[0, :10], logits[0, :10], rtol=1e-5, atol=1e-5)


def test_bfloat16_activations_keep_float32_weights():
  config = make_config("model_name=tiny", "dtype=bfloat16", "weight_dtype=float32")
  batch = _batch()
  params = _init(config, batch)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  logits = Transformer(config).apply(
    {"params": params}, batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"]
  )
  assert logits.dtype == jnp.float32  # the head accumulates bfloat16 matmul inputs into float32 logits
  in_dtype = make_config("model_name=tiny", "dtype=bfloat16", "weight_dtype=float32", "logits_dot_in_fp32=false")
  rounded = Transformer(in_dtype).apply(
    {"params": params}, batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"]
  )
  assert rounded.dtype == jnp.bfloat16  # MaxText's default: logits in the activation dtype, the loss casts them
  np.testing.assert_allclose(rounded.astype(jnp.float32), logits, rtol=2e-2, atol=2e-2)  # the same up to rounding

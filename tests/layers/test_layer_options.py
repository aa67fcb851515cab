"""Named remat (MaxText's presets and remat_policy=custom), fused_qkv / fused_mlp and the iota embedding: each equals
the plain one-device model. remat_policy=custom and the fused kernels on 8 devices (fsdp x sequence x tensor, and over
experts) are rows of tests/parallel/test_feature_layouts.py."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning
from support.config import first_devices, make_config

from MaxLite.cli.errors import ConfigError
from MaxLite.config import choices
from MaxLite.models.transformer import Transformer
from MaxLite.objectives import cross_entropy as loss
from MaxLite.parallel import sharding
from MaxLite.parallel.mesh import create_mesh

SEQ = 32
MHA = ("base_num_query_heads=4", "base_num_kv_heads=4", "max_target_length=32")
DENSE = ("model_name=tiny", *MHA)
MOE = ("model_name=tiny-moe", *MHA)
MODELS = {"dense": DENSE, "moe": MOE}


def _batch(batch=8):
  ids = jax.random.randint(jax.random.key(7), (batch, SEQ), 1, 8192)
  segments = jnp.ones_like(ids).at[1, 20:].set(2).at[3, 25:].set(0)  # two documents in row 1, padding in row 3
  positions = jnp.broadcast_to(jnp.arange(SEQ), ids.shape)
  positions = jnp.where(segments == 2, positions - 20, positions)
  return ids, positions, segments


def _loss_and_grads(config, params, devices):
  """Mean token loss and its gradients, with the parameters placed by the config's logical axis rules."""
  ids, positions, segments = _batch()
  mesh = create_mesh(config, devices)
  model = Transformer(config, deterministic=True)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding.axis_rules(config)):
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, positions, segments))
    specs = nn.get_partition_spec(boxed)["params"]
    params = jax.device_put(params, sharding.logical_to_sharding(specs, mesh, config))
    batch = jax.device_put((ids, positions, segments), sharding.batch_sharding(mesh, config))

    def mean_loss(p, ids, positions, segments):
      logits = model.apply({"params": p}, ids, positions, segments)
      mask = (segments != 0).astype(jnp.float32)
      targets = jnp.roll(ids, -1, axis=1)
      return loss.loss_sums(logits, targets, mask, 0.0)[0] / jnp.sum(mask)

    value, grads = jax.jit(jax.value_and_grad(mean_loss))(params, *batch)
  return float(value), jax.tree.map(np.asarray, grads)


def _init(config):
  ids, positions, segments = _batch()
  return Transformer(config).init(jax.random.key(0), ids, positions, segments)["params"]


def _fuse(params):
  """Unfused scanned layer weights -> fused_qkv / fused_mlp ones (the [3] and [2] axes after the embed axis)."""
  params = jax.tree.map(lambda x: x, nn.unbox(params))
  layers = params["decoder"]["layers"]
  attention = layers["self_attention"]
  parts = [attention.pop(name)["kernel"] for name in ("query", "key", "value")]
  attention["qkv_proj"] = {"kernel": jnp.stack(parts, axis=2)}
  if "mlp" in layers:
    mlp = layers["mlp"]
    mlp["wi"] = {"kernel": jnp.stack([mlp.pop("wi_0")["kernel"], mlp.pop("wi_1")["kernel"]], axis=2)}
  return params


def _unfuse(grads):
  grads = jax.tree.map(lambda x: x, grads)
  layers = grads["decoder"]["layers"]
  qkv = layers["self_attention"].pop("qkv_proj")["kernel"]
  for i, name in enumerate(("query", "key", "value")):
    layers["self_attention"][name] = {"kernel": qkv[:, :, i]}
  if "wi" in layers.get("mlp", {}):
    wi = layers["mlp"].pop("wi")["kernel"]
    layers["mlp"]["wi_0"], layers["mlp"]["wi_1"] = {"kernel": wi[:, :, 0]}, {"kernel": wi[:, :, 1]}
  return grads


def _assert_same(got, want):
  loss_got, grads_got = got
  loss_want, grads_want = want
  np.testing.assert_allclose(loss_got, loss_want, rtol=1e-5)
  assert jax.tree.structure(grads_got) == jax.tree.structure(grads_want)
  for g, w in zip(jax.tree.leaves(grads_got), jax.tree.leaves(grads_want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


@functools.cache
def reference(kind):
  """The plain model (separate kernels, no remat) on one device: (params, (loss, grads))."""
  config = make_config(*MODELS[kind], "remat_policy=none")
  params = nn.unbox(_init(config))
  return params, _loss_and_grads(config, params, first_devices(1))


LAYOUTS = {"tensor2_fsdp4": ("dense", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=4")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fused_kernels_equal_the_separate_ones(kind):
  """fused_qkv (and fused_mlp, the dense MLP's) holding the separate kernels stacked give the plain model's loss and
  gradients. On 8 devices, with remat_policy=custom offloading their activations, they are a row of
  tests/parallel/test_feature_layouts.py."""
  params, want = reference(kind)
  options = ("fused_qkv=true", "fused_mlp=true" if kind == "dense" else "fused_mlp=false")
  config = make_config(*MODELS[kind], *options, "remat_policy=none")
  got_loss, got_grads = _loss_and_grads(config, _fuse(params), first_devices(1))
  _assert_same((got_loss, _unfuse(got_grads)), want)


PRESETS = [p for p in choices.REMAT_POLICIES if p not in ("none", "custom")]


# The presets differ only in which dense names they keep; MoE checks the two that name its block.
@pytest.mark.slow
@pytest.mark.parametrize("kind, policy", [("dense", p) for p in PRESETS] + [("moe", "minimal"), ("moe", "full")])
def test_every_preset_equals_no_remat(kind, policy):
  params, want = reference(kind)
  config = make_config(*MODELS[kind], f"remat_policy={policy}")
  _assert_same(_loss_and_grads(config, params, first_devices(1)), want)


@pytest.mark.slow
@pytest.mark.parametrize(
  "policy, names",
  [
    ("save_qkv_proj", ["key_proj", "query_proj", "value_proj"]),
    # mlpwo is named too, but the backward pass never needs it: the layer's output (x + mlpwo) is kept instead
    ("minimal", ["key_proj", "mlpwi_0", "mlpwi_1", "out_proj", "query_proj", "value_proj"]),
    ("minimal_with_context", ["context", "key_proj", "mlpwi_0", "mlpwi_1", "out_proj", "query_proj", "value_proj"]),
    ("full", []),
  ],
)
def test_a_policy_saves_exactly_its_named_activations(capsys, policy, names):
  config = make_config(*DENSE, f"remat_policy={policy}", "scan_layers=false")
  params = _init(config)
  ids, positions, segments = _batch()
  forward = lambda p: jnp.sum(Transformer(config).apply({"params": p}, ids, positions, segments))
  jax.ad_checkpoint.print_saved_residuals(forward, params)
  saved = re.findall(r"named '(\w+)'", capsys.readouterr().out)
  assert sorted(saved) == sorted(names * config.base_num_decoder_layers)


@pytest.mark.parametrize(
  "overrides, message",
  [
    (("remat_policy=custom", "query_proj=sometimes"), "query_proj='sometimes' is not one of: 'remat', 'device'"),
    (("fused_qkv=true",), "fused_qkv=true needs base_num_kv_heads == base_num_query_heads"),
    (("model_name=tiny-moe", "fused_mlp=true"), "fused_mlp=true fuses the dense MLP's kernels"),
  ],
)
def test_bad_layer_options_are_one_line(overrides, message):
  with pytest.raises(ConfigError, match=message):
    make_config("model_name=tiny", *overrides)


@pytest.mark.parametrize("layout", [None, "tensor2_fsdp4"])
def test_the_iota_embedding_equals_the_table_lookup(layout):
  """use_iota_embed (MaxText's key): the lookup as a one-hot matmul gives the same loss and gradients, the embedding
  table's included (there from a matmul instead of a scatter-add), on one device and split over tensor x fsdp."""
  from MaxLite.layers.embeddings import Embed

  params, want = reference("dense")
  mesh, devices = (LAYOUTS[layout][1:], 8) if layout else ((), 1)
  options = ("remat_policy=none", "use_iota_embed=true", f"per_device_batch_size={8 // devices}")
  config = make_config(*DENSE, *options, *mesh, num_devices=devices)
  _assert_same(_loss_and_grads(config, params, first_devices(devices)), want)
  ids = jnp.zeros((2, SEQ), jnp.int32)
  for iota, scatters in ((True, False), (False, True)):
    embed = Embed(64, 8, iota=iota)
    table = embed.init(jax.random.key(0), ids)
    grad = jax.jit(jax.grad(lambda t, e=embed: jnp.sum(e.apply(t, ids)))).lower(table).as_text()
    assert ("scatter" in grad) == scatters

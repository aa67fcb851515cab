"""MoE details against independent computations: MaxText's load-balancing penalty (same loss at the same
load_balance_loss_weight, adding up over microbatches and shards), and the grouped-matmul path's capacity drops
(dropped rows take no row of the grouped matmuls nor slot of the expert-parallel send buffer; counted once)."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning
from support.config import first_devices, make_config

from MaxLite.layers.moe_sparse import GroupedMatmul, sparse_experts
from MaxLite.models.transformer import Transformer, stack_layers
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.parallel.mesh import create_mesh
from MaxLite.training.train_step import batch_loss_sums

SEQ = 16
WEIGHT = 0.5  # far from the default so that a wrong scale cannot hide in the cross-entropy
MOE = ("model_name=tiny-moe", f"max_target_length={SEQ}", f"load_balance_loss_weight={WEIGHT}")


def _batch(rows: int, padding: tuple[int, ...] = (), seed: int = 0) -> dict:
  """`rows` sequences of random tokens; row i ends in padding[i] padding tokens (segment 0)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 8192, size=(rows, SEQ + 1)).astype(np.int32)
  seg = np.ones((rows, SEQ), np.int32)
  for row, pad in enumerate(padding):
    seg[row, SEQ - pad :] = 0
  return {
    "inputs": jnp.asarray(tokens[:, :-1] * seg),
    "targets": jnp.asarray(tokens[:, 1:] * seg),
    "inputs_position": jnp.broadcast_to(jnp.arange(SEQ, dtype=jnp.int32), (rows, SEQ)),
    "inputs_segmentation": jnp.asarray(seg),
    "targets_segmentation": jnp.asarray(seg),
  }


def _init(config, batch) -> dict:
  init = lambda rng, b: Transformer(config).init(rng, b["inputs"], b["inputs_position"], b["inputs_segmentation"])
  return nn.unbox(jax.jit(init)(jax.random.key(0), batch)["params"])


def _sums(config, params, batch) -> dict:
  fn = lambda p, b: batch_loss_sums(p, Transformer(config).apply, b, jax.random.key(0), config)[1]
  return jax.jit(fn)(params, batch)


def _router_logits(config, params, batch) -> list[np.ndarray]:
  """Each layer's router logits [batch, seq, experts], read from the unrolled model's `gate` projections."""
  _, state = Transformer(config).apply(
    {"params": params},
    batch["inputs"],
    batch["inputs_position"],
    batch["inputs_segmentation"],
    capture_intermediates=lambda module, _: module.name == "gate",
    mutable="intermediates",
  )
  decoder = state["intermediates"]["decoder"]
  # Unrolled layers are decoder/<stack>_<i> (layers_i; DeepSeek's moe_layers_i): every one with a router, in order.
  with_router = [name for name, layer in decoder.items() if "moe" in layer]
  with_router.sort(key=lambda name: int(name.rsplit("_", 1)[1]))
  return [np.asarray(decoder[name]["moe"]["gate"]["__call__"][0]) for name in with_router]


def maxtext_load_balance_loss(logits: np.ndarray, top_k: int, weight: float) -> float:
  """MaxText's RoutedMoE.load_balance_loss of one layer, in numpy (src/maxtext/layers/moe.py):
  density [b, e] = per-sequence mean over positions of the top-k one-hots summed over k (sums to top_k),
  density_prob [b, e] = per-sequence mean router softmax probability, loss = mean(density * density_prob) *
  num_experts**2 * load_balance_loss_weight."""
  e = logits.shape[-1]
  z = logits.astype(np.float64)
  probs = np.exp(z - z.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1, kind="stable")[..., :top_k]
  density = np.eye(e)[top].sum(axis=2).mean(axis=1)
  density_prob = probs.mean(axis=1)
  return float(np.mean(density * density_prob) * e**2 * weight)


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["sparse_matmul=true", "sparse_matmul=false"])
def test_load_balance_penalty_is_maxtexts_at_the_same_weight(dispatch):
  # Router logits from the unrolled model; the penalty from the default scanned (and rematerialised) one.
  unrolled = make_config(*MOE, dispatch, "scan_layers=false", "remat_policy=none")
  scanned = make_config(*MOE, dispatch)
  batch = _batch(4)
  params = _init(unrolled, batch)
  layers = [
    maxtext_load_balance_loss(z, scanned.num_experts_per_tok, WEIGHT) for z in _router_logits(unrolled, params, batch)
  ]
  # MaxText's train step adds jnp.mean over the scanned layers' sown moe_lb_loss to the token-mean cross-entropy.
  expected = float(np.mean(layers))
  sums = _sums(scanned, stack_layers(params), batch)
  added = (sums["loss_sum"] - sums["xent_sum"] - sums["z_sum"]) / sums["count"]
  np.testing.assert_allclose(added, expected, rtol=1e-5)
  np.testing.assert_allclose(WEIGHT * sums["moe_lb_sum"] / sums["count"], expected, rtol=1e-5)


@pytest.mark.slow
def test_load_balance_sums_add_up_over_microbatches():
  # Gradient accumulation adds the microbatches' sums: two halves of a batch (with padding in both) must give
  # the whole batch's penalty, not a mixture of two per-half statistics.
  config = make_config(*MOE)
  batch = _batch(4, padding=(0, 5, 0, 11), seed=1)
  params = _init(config, batch)
  whole = _sums(config, params, batch)
  halves = [_sums(config, params, {k: v[i : i + 2] for k, v in batch.items()}) for i in (0, 2)]
  for key in ("moe_lb_sum", "moe_routed", "moe_dropped", "loss_sum"):
    np.testing.assert_allclose(halves[0][key] + halves[1][key], whole[key], rtol=1e-5, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize(
  "layout",
  [
    ("ici_expert_parallelism=2", "ici_sequence_parallelism=2", "ici_data_parallelism=2"),
    ("ici_pipeline_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2"),
  ],
  ids=["expert2_sequence2_data2", "stage2_expert2_fsdp2"],
)
def test_load_balance_sums_are_the_same_on_every_layout(layout):
  one = make_config(*MOE)
  batch = _batch(8, padding=(0, 3, 0, 0, 9, 0, 0, 1), seed=2)
  params = _init(one, batch)
  reference = _sums(one, params, batch)
  config = make_config(*MOE, *layout, "per_device_batch_size=1", num_devices=8)
  mesh = create_mesh(config, first_devices(8))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    sums = _sums(config, params, batch)
  for key in ("moe_lb_sum", "moe_routed", "loss_sum"):
    np.testing.assert_allclose(sums[key], reference[key], rtol=1e-5, err_msg=key)


# ---------------------------------------------------------------- grouped matmuls with capacity_factor > 0

E, K, D, M = 4, 2, 8, 16


def _routing(rows: int, seq: int, seed: int, skew: tuple[float, ...]) -> tuple:
  """x, router weights and K distinct experts per token (drawn with probabilities `skew`), padding mask."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, seq, D)).astype(np.float32)
  experts = np.stack([[rng.choice(E, size=K, replace=False, p=skew) for _ in range(seq)] for _ in range(rows)]).astype(
    np.int32
  )
  weights = rng.uniform(0.1, 1.0, size=(rows, seq, K)).astype(np.float32)
  mask = np.ones((rows, seq), np.float32)
  mask[0, -3:] = 0
  w = [rng.normal(size=s).astype(np.float32) / np.sqrt(s[1]) for s in ((E, D, M), (E, D, M), (E, M, D))]
  return x, weights, experts, mask, w


def _expected(x, weights, experts, mask, w, capacity: int, peers: int = 1, slots: int | None = None) -> tuple:
  """Per batch shard (here: per row): (token, choice) pairs in token order, the first `capacity` of each expert
  kept; with expert parallelism the kept pairs bound for a peer (in expert, then token order) take its `slots` send
  slots and the rest are lost. -> (y, dropped pairs, kept pairs per expert [rows, E])."""
  wi_0, wi_1, wo = (np.asarray(a, np.float64) for a in w)
  rows, seq, _ = x.shape
  y = np.zeros(x.shape)
  dropped, kept_sizes = 0, np.zeros((rows, E), np.int64)
  for r in range(rows):
    pairs = [(t, j, int(experts[r, t, j])) for t in range(seq) if mask[r, t] for j in range(K)]
    kept = []
    for e in range(E):
      of_e = [p for p in pairs if p[2] == e]
      kept += of_e[:capacity]
      kept_sizes[r, e] = min(len(of_e), capacity)
      dropped += max(len(of_e) - capacity, 0)
    if slots is not None:
      per_peer = [[p for p in kept if p[2] // (E // peers) == peer] for peer in range(peers)]
      dropped += sum(max(len(q) - slots, 0) for q in per_peer)
      kept = [p for q in per_peer for p in q[:slots]]
    for t, j, e in kept:
      h = x[r, t].astype(np.float64)
      gate, up = h @ wi_0[e], h @ wi_1[e]
      y[r, t] += weights[r, t, j] * ((gate / (1 + np.exp(-gate)) * up) @ wo[e])
  return y, dropped, kept_sizes


class RecordingMatmul(GroupedMatmul):
  """ragged_dot that keeps each call's row count and group sizes (eager calls: concrete values)."""

  def __call__(self, lhs, rhs, sizes, out_dtype=None):
    self.calls.append((lhs.shape[0], np.asarray(sizes)))
    return super().__call__(lhs, rhs, sizes, out_dtype)


def test_rows_over_capacity_are_in_no_group_and_counted_once():
  x, weights, experts, mask, w = _routing(1, 16, seed=3, skew=(0.4, 0.3, 0.2, 0.1))
  capacity_factor = 0.5
  capacity = math.ceil(16 * K * capacity_factor / E)  # 4 rows per expert of this (only) batch shard
  want_y, want_dropped, want_sizes = _expected(x, weights, experts, mask, w, capacity)
  assert want_dropped > 0
  matmul = RecordingMatmul()
  matmul.calls = []
  y, dropped = sparse_experts(*map(jnp.asarray, (x, weights, experts, mask, *w)), capacity_factor, matmul=matmul)
  np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
  assert float(dropped) == want_dropped
  # All three projections run on the kept rows only: E * capacity of them, not tokens * top_k.
  assert [rows for rows, _ in matmul.calls] == [E * capacity] * 3
  for _, sizes in matmul.calls:
    np.testing.assert_array_equal(sizes, want_sizes[0])


@pytest.mark.parametrize("megablox", [False, True])
def test_rows_over_capacity_take_no_send_slot_and_are_counted_once(megablox):
  # 8 batch shards of one row each (fsdp=4 x expert=2); experts 0, 1 live on peer 0, experts 2, 3 on peer 1.
  config = make_config("model_name=tiny-moe", "ici_expert_parallelism=2", "ici_fsdp_parallelism=4", num_devices=8)
  seq, capacity_factor, buffer_factor = 8, 0.75, 0.5
  capacity = math.ceil(seq * K * capacity_factor / E)  # 3
  slots = math.ceil(seq * K * buffer_factor / 2)  # 4 rows per peer, fewer than the 2 * 3 kept rows it could get
  x, weights, experts, mask, w = _routing(8, seq, seed=4, skew=(0.45, 0.35, 0.1, 0.1))
  want_y, want_dropped, _ = _expected(x, weights, experts, mask, w, capacity, peers=2, slots=slots)
  over_capacity = _expected(x, weights, experts, mask, w, capacity)[1]
  assert 0 < over_capacity < want_dropped  # both kinds of drop happen
  mesh = create_mesh(config, first_devices(8))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    run = jax.jit(
      lambda *a: sparse_experts(*a, capacity_factor, buffer_factor, GroupedMatmul(megablox, interpret=True))
    )
    y, dropped = run(*map(jnp.asarray, (x, weights, experts, mask, *w)))
  np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
  assert float(dropped) == want_dropped


# ---------------------------------------------------------------- router precision


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["sparse_matmul=true", "sparse_matmul=false"])
def test_bfloat16_router_chooses_as_float32_does(dispatch):
  # transformers' DeepSeek-V3 router computes its logits in float32 whatever the model's dtype. Expert 1's logit is
  # 1 + 2^-9 and expert 0's 1 (inputs and weights exact in bfloat16): rounded to bfloat16 (spacing 2^-7 at 1) they tie
  # and top_k takes expert 0; in float32 expert 1 wins. The bfloat16 model must route this token as float32 does.
  from MaxLite.layers.moe import MoeBlock

  common = ("model_name=tiny-moe", "num_experts_per_tok=1", "megablox=false", dispatch)
  x = jnp.ones((1, 2, 64), jnp.float32)
  mask = jnp.ones((1, 2), bool)
  f32, bf16 = make_config(*common, "dtype=float32"), make_config(*common, "dtype=bfloat16")
  params = nn.unbox(MoeBlock(f32).init(jax.random.key(3), x, mask)["params"])
  gate = np.zeros((64, 4), np.float32)
  gate[:, 0] = gate[:, 1] = 2.0**-6
  gate[0, 1] += 2.0**-9
  params["gate"]["kernel"] = jnp.asarray(gate)
  rounded = np.asarray((x.astype(jnp.bfloat16) @ jnp.asarray(gate, jnp.bfloat16))[0, 0].astype(jnp.float32))
  assert rounded[0] == rounded[1] and (x[0, 0] @ gate)[1] > (x[0, 0] @ gate)[0]  # the case: a tie only in bfloat16

  want = np.asarray(MoeBlock(f32).apply({"params": params}, x, mask)[0])
  got = np.asarray(MoeBlock(bf16).apply({"params": params}, x, mask)[0].astype(jnp.float32))
  expert0 = {**params, "gate": {"kernel": jnp.asarray(gate[:, [1, 0, 2, 3]])}}  # what the tie would choose
  wrong = np.asarray(MoeBlock(f32).apply({"params": expert0}, x, mask)[0])
  gap = np.abs(wrong - want).max()
  assert gap > 0.05, gap  # the two experts give clearly different outputs
  assert np.abs(got - want).max() < 0.1 * gap, (np.abs(got - want).max(), gap)


# ---------------------------------------------------------------- load balance with sigmoid routing (DeepSeek)


def sigmoid_balance_loss(logits: np.ndarray, mask: np.ndarray, top_k: int, groups: int = 1, top_groups: int = 1):
  """The token-weighted mean over sequences of num_experts^2 * mean_e(density_e * prob_e) for sigmoid routing, in
  numpy: prob_e = the mean of DeepSeek-V3's normalised affinity s_e / sum_j s_j (s = sigmoid(logit); its
  sequence-wise balance loss), density_e = chosen (top_k of the best `top_groups` groups) per real token."""
  b, s, e = logits.shape
  scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
  grouped = scores.reshape(b, s, groups, e // groups)
  worth = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
  best = np.argsort(-worth, axis=-1, kind="stable")[..., :top_groups]
  keep = np.zeros((b, s, groups), bool)
  np.put_along_axis(keep, best, True, axis=-1)
  chooser = np.where(np.repeat(keep, e // groups, axis=-1), scores, -np.inf)
  top = np.argsort(-chooser, axis=-1, kind="stable")[..., :top_k]
  chosen = np.eye(e)[top].sum(axis=2)  # [b, s, e]
  affinity = scores / scores.sum(-1, keepdims=True)
  total, tokens = 0.0, 0.0
  for row in range(b):
    real = mask[row].astype(bool)
    if real.any():
      density, prob = chosen[row][real].mean(0), affinity[row][real].mean(0)
      total += real.sum() * e**2 * np.mean(density * prob)
      tokens += real.sum()
  return total / tokens


def test_sigmoid_balance_loss_is_top_k_when_balanced():
  # DeepSeek's sigmoid scores do not sum to 1 over the experts: without normalising them the logged moe_lb_loss read
  # num_experts * top_k * mean score (9-12 on tiny-deepseek) where the README promises top_k for balanced routing.
  from MaxLite.layers.moe import Routing, choose_experts, load_balance_loss

  e, k = 4, 2
  # Each token picks a pair ((0, 1) or (2, 3)) with scores near 1 for every expert: perfectly balanced.
  logits = np.full((2, 8, e), 4.0, np.float32)
  logits[:, 0::2, :2] = logits[:, 1::2, 2:] = 5.0
  mask = np.ones((2, 8), np.float32)
  sigmoid = Routing(score_func="sigmoid")
  stats = choose_experts(jnp.asarray(logits), jnp.asarray(mask), k, routing=sigmoid)[3]
  np.testing.assert_allclose(load_balance_loss(stats), k, rtol=1e-6)

  rng = np.random.default_rng(0)
  logits = (rng.normal(size=(3, 16, 8)) * 2 + 1).astype(np.float32)
  mask = np.ones((3, 16), np.float32)
  mask[1, 11:] = 0
  mask[2] = 0
  stats = choose_experts(jnp.asarray(logits), jnp.asarray(mask), 3, routing=sigmoid)[3]
  np.testing.assert_allclose(load_balance_loss(stats), sigmoid_balance_loss(logits, mask, 3), rtol=1e-5)


@pytest.mark.slow
def test_deepseek_logged_balance_loss_is_the_normalised_one():
  # The logged value of a whole tiny DeepSeek (grouped sigmoid routing, zero bias at init), mean over its MoE layers.
  unrolled = make_config("model_name=tiny-deepseek", f"max_target_length={SEQ}", "scan_layers=false")
  batch = _batch(3, padding=(0, 6, 0))
  params = _init(unrolled, batch)
  mask = np.asarray(batch["inputs_segmentation"] != 0)
  logits = _router_logits(unrolled, params, batch)
  assert len(logits) == unrolled.base_num_decoder_layers - unrolled.first_num_dense_layers
  expected = np.mean(
    [
      sigmoid_balance_loss(
        z, mask, unrolled.num_experts_per_tok, unrolled.n_routing_groups, unrolled.topk_routing_group
      )
      for z in logits
    ]
  )
  sums = _sums(unrolled, params, batch)
  np.testing.assert_allclose(sums["moe_lb_sum"] / sums["count"], expected, rtol=1e-5)


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-gemma3"])
def test_shared_experts_are_refused_by_a_family_that_builds_none(model):
  """Only DeepSeek's layer builds shared experts: elsewhere the key was ignored while LoRA's module list (config
  validation) still named them."""
  from MaxLite.cli.errors import ConfigError

  with pytest.raises(ConfigError, match=r"^shared_experts=2: decoder_block=\w+ has no shared experts"):
    make_config(f"model_name={model}", "shared_experts=2")
  assert make_config("model_name=tiny-deepseek", "shared_experts=1").shared_experts == 1

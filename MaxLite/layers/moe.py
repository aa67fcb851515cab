"""Mixtral-style sparse mixture of SwiGLU experts with top-k routing and a per-sequence capacity.

Routing is done with dense one-hot dispatch/combine tensors (GShard style) so that the whole block
is einsums that GSPMD can shard: experts on the `expert` mesh axis, the dispatched tokens follow.
Capacity is counted per sequence (one group = one batch row), so the result never depends on how
the batch is sharded. Padding tokens (segment id 0) are not routed at all.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxLite.config import Config
from MaxLite.layers.linears import DenseGeneral, cast_weight
from MaxLite.layers.moe_sparse import GroupedMatmul, silu_gated, sparse_experts
from MaxLite.layers.quantities import dtype_of
from MaxLite.parallel.sharding import EMBED_ACTIVATION

# Dispatched activations: [experts, batch, capacity, features]. Their batch must not use the expert
# mesh axis, which the experts dimension already occupies.
EXPERT_ACTIVATION = ("activation_exp", "activation_batch_no_exp", None, "activation_embed")
EXPERT_HIDDEN = ("activation_exp", "activation_batch_no_exp", None, "activation_mlp")


def expert_capacity(seq_len: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
  """Slots per expert per sequence; capacity_factor <= 0 means no token is ever dropped."""
  if capacity_factor <= 0:
    return seq_len  # top-k choices of one token are distinct experts, so an expert sees <= seq_len tokens
  return max(1, min(seq_len, math.ceil(seq_len * top_k * capacity_factor / num_experts)))


def load_balance_loss(stats: dict) -> jax.Array:
  """MaxText's load-balancing loss (RoutedMoE.load_balance_loss) from routing sums, before its weight.

  Per sequence b: density_be = top-k assignments to expert e per token (summing to top_k over e; assignments later
  dropped for capacity count too), density_prob_be = mean router probability of e (with sigmoid routing, the score
  normalised over the experts, as in DeepSeek-V3's sequence-wise balance loss); the sequence's loss is
  num_experts**2 * mean_e(density_be * density_prob_be), top_k when routing is balanced. MaxText averages it over
  the batch's sequences; here each sequence is weighted by its real tokens (padding is not routed), the same on a
  batch without padding, and a sum over sequences, so it adds up however the batch is split (data shards,
  gradient accumulation's and the pipeline's microbatches).
  """
  return stats["lb_sum"] / jnp.maximum(stats["tokens"], 1.0)


def choose_experts(
  router_logits: jax.Array,
  token_mask: jax.Array,
  top_k: int,
  normalize_top_k: bool = True,
  routing: Routing | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, dict]:
  """Top-k routing -> (weights [b,s,k], experts [b,s,k], choice [b,s,k,e] 0/1 of real tokens, routing sums without
  the dropped count; see load_balance_loss). Softmax scores by default; `routing` (DeepSeek) may make them sigmoids,
  add a bias for the choice only, limit the choice to the best groups and scale the weights."""
  e = router_logits.shape[-1]
  routing = routing or Routing()
  logits = router_logits.astype(jnp.float32)
  probs = jax.nn.sigmoid(logits) if routing.score_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
  chooser = probs if routing.bias is None else probs + routing.bias.astype(jnp.float32)
  if routing.groups > 1:
    chooser = _best_groups_only(chooser, routing.groups, routing.top_groups)
  _, experts = jax.lax.top_k(chooser, top_k)  # [b, s, k]
  weights = jnp.take_along_axis(probs, experts, axis=-1)  # the scores without the bias
  if normalize_top_k:  # Mixtral, Qwen3 (norm_topk_prob) and DeepSeek-V3 renormalise the chosen k to sum to 1
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + (1e-20 if routing.score_func == "sigmoid" else 0.0))
  weights = weights * routing.scaling if routing.scaling != 1.0 else weights
  choice = jax.nn.one_hot(experts, e, dtype=jnp.float32) * token_mask[..., None, None]  # [b, s, k, e]
  assigned = jnp.sum(choice, axis=(1, 2))  # [b, e]
  # The balancing loss's router probabilities must sum to 1 over the experts for its scale (top_k when balanced):
  # sigmoid scores are normalised per token, DeepSeek-V3's affinities s_e / sum_j s_j in its sequence-wise balance loss.
  balance_probs = probs / jnp.sum(probs, axis=-1, keepdims=True) if routing.score_func == "sigmoid" else probs
  prob_sum = jnp.sum(balance_probs * token_mask[..., None], axis=1)  # [b, e]
  tokens = jnp.sum(token_mask, axis=1)  # [b]
  # tokens_b * num_experts * sum_e density_be * density_prob_be, with both densities over tokens_b: see
  # load_balance_loss. A sequence of padding only adds 0.
  lb_sum = e * jnp.sum(assigned * prob_sum, axis=-1) / jnp.maximum(tokens, 1.0)
  stats = {"lb_sum": jnp.sum(lb_sum), "tokens": jnp.sum(tokens), "routed": jnp.sum(choice)}
  if routing.bias is not None:  # what the bias update balances (training/train_step.py)
    stats["expert_counts"] = jnp.sum(assigned, axis=0)
  return weights, experts, choice, stats


@dataclasses.dataclass(frozen=True)
class Routing:
  """DeepSeek's router: score_func softmax | sigmoid, bias [experts] added for the choice only, the choice limited
  to the top_groups best of `groups` expert groups (a group's worth: the sum of its two best biased scores), and
  the weights multiplied by `scaling`."""

  score_func: str = "softmax"
  bias: jax.Array | None = None
  groups: int = -1
  top_groups: int = -1
  scaling: float = 1.0


def _best_groups_only(scores: jax.Array, groups: int, top_groups: int) -> jax.Array:
  """scores [..., e] with the experts outside each token's top_groups best groups set to -inf."""
  *lead, e = scores.shape
  grouped = scores.reshape(*lead, groups, e // groups)
  worth = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [..., groups]
  _, best = jax.lax.top_k(worth, top_groups)
  keep = jnp.sum(jax.nn.one_hot(best, groups, dtype=jnp.bool_), axis=-2, dtype=jnp.bool_)  # [..., groups]
  return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(*lead, e)


def route(
  router_logits: jax.Array,
  token_mask: jax.Array,
  top_k: int,
  capacity: int,
  normalize_top_k: bool = True,
  routing: Routing | None = None,
) -> tuple:
  """Top-k softmax routing -> (dispatch [b,s,e,c] 0/1, combine [b,s,e,c] weights, routing sums).

  The routing sums (the load-balancing loss weighted by real tokens, those tokens, routed and dropped
  assignments) add up across shards and microbatches; see load_balance_loss.

  A token's k-th choice competes for slots after every token's (k-1)-th choice (earlier choices
  have priority), and within one rank earlier positions in the sequence win.
  """
  b, s, e = router_logits.shape
  weights, _, choice, stats = choose_experts(router_logits, token_mask, top_k, normalize_top_k, routing)
  by_rank = jnp.swapaxes(choice, 1, 2).reshape(b, top_k * s, e)
  slot = (jnp.cumsum(by_rank, axis=1) - 1.0) * by_rank  # 0-based slot in the chosen expert
  kept = by_rank * (slot < capacity)
  slot_one_hot = jax.nn.one_hot(slot.astype(jnp.int32), capacity, dtype=jnp.float32) * kept[..., None]
  per_rank = jnp.swapaxes(slot_one_hot.reshape(b, top_k, s, e, capacity), 1, 2)  # [b, s, k, e, c]
  dispatch = jnp.sum(per_rank, axis=2)
  combine = jnp.einsum("bsk,bskec->bsec", weights, per_rank)
  return dispatch, combine, {**stats, "dropped": stats["routed"] - jnp.sum(kept)}


@dataclasses.dataclass(frozen=True)
class ExpertFeatures:
  """What a family's experts compute, which the family decides from its own keys (this layer reads none of them).

  router_bias: a learned bias on the router logits, trained by its gradient as any weight. choice_bias: a bias added
  to the scores for choosing experts only, moved by train_step instead (routed_bias, routed_bias_update_rate).
  expert_bias: a learned bias on each expert's gate, up and down projections. gated(gate, up) -> hidden: the experts'
  gated unit."""

  router_bias: bool = False
  choice_bias: bool = False
  expert_bias: bool = False
  gated: Callable[[jax.Array, jax.Array], jax.Array] = silu_gated


class MoeBlock(nn.Module):
  """x [b, s, embed], token_mask [b, s] -> (y [b, s, embed], routing sums; see route). features: the family's
  (ExpertFeatures); None = SwiGLU experts with the config's routed_bias as a choice-only bias."""

  config: Config
  features: ExpertFeatures | None = None

  @nn.compact
  def __call__(self, x: jax.Array, token_mask: jax.Array) -> tuple[jax.Array, dict]:
    cfg = self.config
    features = self.features or ExpertFeatures(choice_bias=cfg.routed_bias)
    dtype, wdtype = dtype_of(cfg.dtype), dtype_of(cfg.weight_dtype)
    n, emb, mlp = cfg.num_experts, cfg.base_emb_dim, cfg.moe_mlp_dim
    # float32_gate_logits: in bfloat16, logits closer than the type's spacing (2^-7 at 1) round to a tie that top_k
    # breaks by index, so a bfloat16 model would route unlike its float32 self and unlike transformers' DeepSeek-V3
    # router, which casts both operands to float32.
    gate_dtype = jnp.float32 if cfg.float32_gate_logits else dtype
    router_logits = DenseGeneral(
      n,
      ("embed", None),
      dtype=gate_dtype,
      weight_dtype=wdtype,
      init_scale=cfg.dense_init_scale,
      use_bias=features.router_bias,
      name="gate",
    )(x)
    routing = Routing(
      score_func=cfg.routed_score_func or "softmax",
      # Its gradient is zero (it only decides top_k); train_step moves it by routed_bias_update_rate instead.
      bias=self.param("score_correction_bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (n,))
      if features.choice_bias
      else None,
      groups=cfg.n_routing_groups,
      top_groups=cfg.topk_routing_group,
      scaling=cfg.routed_scaling_factor,
    )

    def kernel(name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> jax.Array:
      init = nn.initializers.variance_scaling(
        cfg.dense_init_scale, "fan_in", "truncated_normal", in_axis=1, out_axis=2, batch_axis=(0,)
      )
      return cast_weight(self.param(name, nn.with_logical_partitioning(init, axes), shape, wdtype), dtype)

    wi_0 = kernel("wi_0", (n, emb, mlp), ("exp", "embed", "mlp"))
    wi_1 = kernel("wi_1", (n, emb, mlp), ("exp", "embed", "mlp"))
    wo = kernel("wo", (n, mlp, emb), ("exp", "mlp", "embed"))
    biases = None
    if features.expert_bias:  # MaxText's names and axes (mlp_bias)
      bias = lambda name, width, axis: cast_weight(
        self.param(name, nn.with_logical_partitioning(nn.initializers.zeros, ("exp", axis)), (n, width), wdtype), dtype
      )
      biases = (bias("wi_0_bias", mlp, "mlp"), bias("wi_1_bias", mlp, "mlp"), bias("wo_bias", emb, "embed"))
    mask = token_mask.astype(jnp.float32)
    if cfg.sparse_matmul:
      weights, experts, _, aux = choose_experts(
        router_logits, mask, cfg.num_experts_per_tok, cfg.norm_topk_prob, routing
      )
      y, dropped = sparse_experts(
        x.astype(dtype),
        weights,
        experts,
        mask,
        wi_0,
        wi_1,
        wo,
        cfg.capacity_factor,
        cfg.ragged_buffer_factor,
        GroupedMatmul(cfg.megablox, cfg.megablox_interpret),
        biases,
        features.gated,
      )
      y = nn.with_logical_constraint(y, EMBED_ACTIVATION)
      return checkpoint_name(y, "mlpwo"), {**aux, "dropped": dropped}
    capacity = expert_capacity(x.shape[1], n, cfg.num_experts_per_tok, cfg.capacity_factor)
    dispatch, combine, aux = route(router_logits, mask, cfg.num_experts_per_tok, capacity, cfg.norm_topk_prob, routing)

    tokens = jnp.einsum("bsec,bsd->ebcd", dispatch.astype(dtype), x.astype(dtype))
    tokens = nn.with_logical_constraint(tokens, EXPERT_ACTIVATION)
    gate = jnp.einsum("ebcd,edm->ebcm", tokens, wi_0)
    up = jnp.einsum("ebcd,edm->ebcm", tokens, wi_1)
    if biases is not None:  # empty slots get them too, and a combine weight of 0
      gate, up = gate + biases[0][:, None, None, :], up + biases[1][:, None, None, :]
    gate = checkpoint_name(nn.with_logical_constraint(gate, EXPERT_HIDDEN), "moe_mlpwi_0")
    up = checkpoint_name(nn.with_logical_constraint(up, EXPERT_HIDDEN), "moe_mlpwi_1")
    hidden = nn.with_logical_constraint(features.gated(gate, up), EXPERT_HIDDEN)
    out = jnp.einsum("ebcm,emd->ebcd", hidden, wo)
    if biases is not None:
      out = out + biases[2][:, None, None, :]
    out = nn.with_logical_constraint(out, EXPERT_ACTIVATION)
    y = jnp.einsum("ebcd,bsec->bsd", checkpoint_name(out, "moe_mlpwo"), combine.astype(dtype))
    y = nn.with_logical_constraint(y, EMBED_ACTIVATION)
    return checkpoint_name(y, "mlpwo"), aux

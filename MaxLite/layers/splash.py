"""Splash attention: jax's Pallas TPU flash-attention kernel, causal and packed-segment masked, under shard_map.

The kernel never materialises the [seq, seq] scores: it walks blocks of queries and keys, skips the blocks the
causal mask rules out, and keeps only a running max and sum per query row. On TPU it compiles to a Mosaic
kernel; anywhere else it runs the same kernel code in Pallas interpret mode (slow, but numerically the same),
which is how its forward and backward passes are tested on CPU.

Layout across devices: the batch and query heads are split as the activations already are (the logical axes
`activation_batch` and `activation_heads`), the query sequence is split over the `activation_length` axes, and
keys/values are gathered along the sequence (each query block needs every earlier key).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import partitioning as nn_partitioning
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from MaxLite.config import Config
from MaxLite.config.splash_blocks import capped_blocks
from MaxLite.parallel import context


def block_sizes(config: Config, q_len: int, kv_len: int) -> kernel_lib.BlockSizes:
  blocks = capped_blocks(config.to_dict(), q_len, kv_len)
  fused = config.sa_use_fused_bwd_kernel
  return kernel_lib.BlockSizes(
    block_q=blocks["sa_block_q"],
    block_kv=blocks["sa_block_kv"],
    block_kv_compute=blocks["sa_block_kv_compute"],
    block_q_dkv=blocks["sa_block_q_dkv"],
    block_kv_dkv=blocks["sa_block_kv_dkv"],
    block_kv_dkv_compute=blocks["sa_block_kv_dkv_compute"],
    block_q_dq=None if fused else blocks["sa_block_q_dq"],
    block_kv_dq=None if fused else blocks["sa_block_kv_dq"],
    use_fused_bwd_kernel=fused,
  )


def _shards(mesh: jax.sharding.AbstractMesh, axes: str | tuple[str, ...] | None) -> int:
  names = (axes,) if isinstance(axes, str) else axes or ()
  return math.prod(mesh.shape[a] for a in names)


def splash_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  segment_ids: jax.Array,
  config: Config,
  interpret: bool,
  window: int = 0,
  cap: float = 0.0,
  sinks: jax.Array | None = None,
  order: np.ndarray | None = None,
  local: bool = False,
) -> jax.Array:
  """q [b, s, heads, d]; k, v [b, s, kv_heads, d]; segment_ids [b, s] (0 = padding). q is already scaled.
  window > 0: each query sees its `window` latest keys only (the kernel skips the blocks outside the band);
  cap > 0: the scores are soft-capped; sinks [heads]: one more logit per head in each softmax's denominator (the
  kernel starts each row's running max and sum from it); order [s]: the original index of each place of a
  load-balanced sequence (parallel/context.py): the queries stay where their shard has them, the gathered keys and
  values go back to the original order, and the mask compares original indices. local: called inside a shard_map
  (layers/context_attention.py's Ulysses) on whole sequences of this device's heads: no sharding of its own."""
  value_dim = v.shape[-1]
  if value_dim < q.shape[-1]:  # MLA's values are narrower than its queries; the kernel takes one head width
    v = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - value_dim)])
  mesh = jax.sharding.get_abstract_mesh()
  on_mesh = mesh is not None and not mesh.empty and not local
  q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # the kernel wants [heads, seq, d] per example
  heads, seq = q.shape[1], q.shape[2]
  batch_axes = head_axes = seq_axes = None
  if on_mesh:
    batch_axes, head_axes, seq_axes = nn_partitioning.logical_to_mesh_axes(
      ("activation_batch", "activation_heads", "activation_length")
    )
  head_shards, seq_shards = (_shards(mesh, head_axes), _shards(mesh, seq_axes)) if on_mesh else (1, 1)

  one_head = CausalBandMask((seq, seq), order, window)
  mask = mask_lib.MultiHeadMask([one_head for _ in range(heads)])
  kernel = kernel_lib.make_splash_mha(
    mask,
    attn_logits_soft_cap=cap if cap > 0 else None,
    block_sizes=block_sizes(config, seq // seq_shards, seq),
    head_shards=head_shards,
    q_seq_shards=seq_shards,
    interpret=interpret,
  )

  def attend(kernel, q, k, v, q_segments, kv_segments, sinks):
    if order is not None:  # every key and value is here (gathered along the sequence): back to the original order
      k, v = context.restore(k, order, axis=2), context.restore(v, order, axis=2)
      kv_segments = context.restore(kv_segments, order, axis=1)

    def per_example(q, k, v, qs, ks):
      return kernel(q, k, v, segment_ids=kernel_lib.SegmentIds(qs, ks), **({} if sinks is None else {"sinks": sinks}))

    return jax.vmap(per_example)(q, k, v, q_segments, kv_segments)

  if sinks is not None:
    sinks = sinks.astype(jnp.float32)
  if not on_mesh:
    out = attend(kernel, q, k, v, segment_ids, segment_ids, sinks)
  else:
    q_spec = P(batch_axes, head_axes, seq_axes, None)
    kv_spec = P(batch_axes, head_axes, None, None)
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(head_axes, seq_axes)))
    sharded = jax.shard_map(
      attend,
      mesh=mesh,
      in_specs=(
        kernel_spec,
        q_spec,
        kv_spec,
        kv_spec,
        P(batch_axes, seq_axes),
        P(batch_axes, None),
        None if sinks is None else P(head_axes),  # each head shard takes its heads' sinks
      ),
      out_specs=q_spec,
      check_vma=False,
    )
    out = sharded(kernel, q, k, v, segment_ids, segment_ids, sinks)
  return jnp.swapaxes(out, 1, 2)[..., :value_dim]


class CausalBandMask(mask_lib._ComputableMask):  # noqa: SLF001 (the kernel's own mask protocol)
  """Causal (and with window > 0 banded) over original token indices. With `order` (queries in a load-balanced
  order) the kernel evaluates the mask function on each query's entry of `q_sequence` (its original index) and each
  key's index (keys in the original order), so the blocks it skips are those of the reordered queries.

  The kernel classifies every block of the [seq, seq] mask on the host before compiling, by slicing the mask and
  asking `any()` and `all()`: jax's CausalMask and LocalMask compute each slice, seq^2 comparisons (75 s at 131,072
  tokens over 8 shards). Here a block whose queries' index range puts it wholly inside or outside the band is answered
  from that range and only the blocks the band crosses are computed."""

  def __init__(self, shape: tuple[int, int], order: np.ndarray | None = None, window: int = 0):
    self.window = window

    def mask_function(q_ids, kv_ids):  # numpy while the mask is processed, jax inside the kernel
      causal = q_ids >= kv_ids
      return causal & (q_ids - kv_ids < window) if window > 0 else causal

    super().__init__(shape=shape, mask_function=mask_function)
    if order is not None:
      self.q_sequence = np.asarray(order, dtype=np.int32)
    self._constants: dict[tuple[bool, int, int], np.ndarray] = {}

  def __getitem__(self, idx) -> np.ndarray:
    q_slice, kv_slice = idx
    if not isinstance(q_slice, slice) or not isinstance(kv_slice, slice):
      return super().__getitem__(idx)
    rows = self.q_sequence[q_slice]
    first, stop, step = kv_slice.indices(self.shape[1])
    if rows.size == 0 or stop <= first or step != 1:
      return super().__getitem__(idx)
    low, high = int(rows.min()), int(rows.max())
    inside = low >= stop - 1 and (self.window <= 0 or high - first < self.window)
    outside = high < first or (self.window > 0 and low - (stop - 1) >= self.window)
    if not (inside or outside):
      return super().__getitem__(idx)
    key = (inside, rows.size, stop - first)
    if key not in self._constants:
      block = np.full(key[1:], inside)
      block.flags.writeable = False
      self._constants[key] = block
    return self._constants[key]

  def __eq__(self, other: object):
    if not isinstance(other, type(self)):
      return NotImplemented
    return (self.shape, self.window) == (other.shape, other.window) and np.array_equal(
      self.q_sequence, other.q_sequence
    )

  def __hash__(self):
    return hash((type(self), self.shape, self.window, self.q_sequence.tobytes()))

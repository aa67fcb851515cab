"""The cuDNN attention path (layers/cudnn.py) equals dot_product on packed rows, for every family, and its CUDA program
holds no [batch, 1, seq, seq] mask.

Off a GPU the path runs jax's XLA implementation of the same call, with the same segment lengths and offsets the
cuDNN kernel gets; the cuDNN call itself is checked by lowering the model for CUDA (the one fake: jax's query of
the GPU's cuDNN version and compute capability, which answers as an H100 with cuDNN 9.19 would).
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.config import REPO, make_config

from MaxLite import config as config_lib
from MaxLite.config import validation
from MaxLite.layers.attention import attention_mask, dot_product_attention
from MaxLite.layers.cudnn import cudnn_attention, packed_layout
from MaxLite.models import build

SEQ = 128


def _rows(batch: int) -> np.ndarray:
  """Packed rows as the packer makes them: several documents, single-token ones, one full row, trailing padding, a
  row of padding only."""
  rows = [
    [1] * 30 + [2] * 50 + [3] * 20 + [0] * 28,
    [1] * SEQ,
    [1] + [2] + [3] * 60 + [4] * 66,
    [0] * SEQ,
    [1] * 100 + [0] * 28,
    [1] * 7 + [2] * 9 + [3] * 100 + [4] * 12,
  ]
  return np.asarray((rows * batch)[:batch], np.int32)


@pytest.mark.slow
def test_packed_layout_gives_each_rows_segment_offsets_and_lengths():
  lengths, offsets = packed_layout(jnp.asarray(_rows(6)), 4)
  np.testing.assert_array_equal(
    lengths, [[30, 50, 20, -1], [SEQ, -1, -1, -1], [1, 1, 60, 66], [-1] * 4, [100, -1, -1, -1], [7, 9, 100, 12]]
  )
  np.testing.assert_array_equal(
    offsets,
    [[0, 30, 80, -1, -1], [0, -1, -1, -1, -1], [0, 1, 2, 62, -1], [-1] * 5, [0, -1, -1, -1, -1], [0, 7, 16, 116, -1]],
  )
  # Equal ids that are not one run are two segments (the packer never makes them; dot_product would join them).
  lengths, offsets = packed_layout(jnp.asarray([[1, 1, 2, 2, 1, 1, 0, 0]]), 3)
  np.testing.assert_array_equal(lengths, [[2, 2, 2]])
  np.testing.assert_array_equal(offsets, [[0, 2, 4, -1]])


def _qkv(heads: int, kv_heads: int, dim: int = 32, value_dim: int | None = None):
  keys = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(keys[0], (6, SEQ, heads, dim)) * dim**-0.5
  k = jax.random.normal(keys[1], (6, SEQ, kv_heads, dim))
  v = jax.random.normal(keys[2], (6, SEQ, kv_heads, value_dim or dim))
  return q, k, v


def _loss_and_grads(attend, q, k, v, segments):
  real = (segments != 0)[:, :, None, None]  # padding positions are not compared (the loss never reads them)
  loss = lambda q, k, v: jnp.sum(jnp.where(real, jnp.sin(attend(q, k, v)), 0.0))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("window", [0, 1, 16, 40])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_cudnn_path_equals_dot_product_on_packed_rows(heads, kv_heads, window):
  _assert_cudnn_equals_dot_product(_qkv(heads, kv_heads), jnp.asarray(_rows(6)), 4, window)


def _assert_cudnn_equals_dot_product(qkv, segments, count, window):
  """Loss and gradients of the cuDNN path (its XLA implementation, `count` segments per row) = dot_product's."""
  reference = lambda q, k, v: dot_product_attention(q, k, v, attention_mask(segments, window))
  want = _loss_and_grads(reference, *qkv, segments)
  got = _loss_and_grads(lambda q, k, v: cudnn_attention(q, k, v, segments, count, window, "xla"), *qkv, segments)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w, atol=2e-5)


@pytest.mark.parametrize("window", [0, 16])
def test_one_document_rows_take_the_public_call_with_sequence_lengths(window):
  """attention_segments=1 (synthetic data): the padding at each row's end as query/key lengths."""
  segments = jnp.asarray(np.where(np.arange(SEQ) < np.array([[SEQ], [90], [1], [0], [128], [64]]), 1, 0), jnp.int32)
  _assert_cudnn_equals_dot_product(_qkv(8, 2), segments, 1, window)


def test_values_narrower_than_queries_are_padded_and_cut_back():
  """MLA: 24-wide queries and keys, 16-wide values."""
  q, k, v = _qkv(4, 4, dim=24, value_dim=16)
  segments = jnp.asarray(_rows(6))
  got = cudnn_attention(q, k, v, segments, 4, 0, "xla")
  want = dot_product_attention(q, k, v, attention_mask(segments))
  assert got.shape == want.shape == (6, SEQ, 4, 16)
  real = (segments != 0)[:, :, None, None]
  np.testing.assert_allclose(jnp.where(real, got, 0), jnp.where(real, want, 0), atol=2e-6)
  assert not np.any(np.asarray(got)[~np.asarray(real)[..., 0, 0]])  # padding positions are zeros


def _cudnn_config(*overrides: str, dtype: str = "float32") -> config_lib.Config:
  """The config a GPU run makes (autoselected resolves to cudnn), by default computed in float32 so the comparison
  is tight."""
  raw = config_lib.load_raw([os.path.join(REPO, "configs", "base.yml"), "dtype=bfloat16", *overrides])
  c = validation.validate_and_derive(raw, num_devices=1, num_slices=1, process_count=1, platform="gpu")
  assert c["attention_kernel"] == "cudnn", c["attention_choice"]
  return config_lib.Config({**c, "dtype": dtype})


FAMILIES = ["tiny", "tiny-gemma3", "tiny-deepseek", "tiny-moe"]


def _batch(config, seed=0):
  rows = _rows(6)[[0, 2, 4, 5]]
  ids = np.random.default_rng(seed).integers(0, config.vocab_size, rows.shape)
  starts = np.concatenate([np.ones((4, 1), bool), rows[:, 1:] != rows[:, :-1]], axis=1)
  pos = np.zeros_like(rows)
  for r in range(4):  # positions restart at each segment
    for t in range(1, SEQ):
      pos[r, t] = 0 if starts[r, t] else pos[r, t - 1] + 1
  return ids, pos, rows


@pytest.mark.slow
@pytest.mark.parametrize("model", FAMILIES)
def test_every_family_gives_dot_products_logits_through_the_cudnn_path(model):
  """Packed rows through the whole model: Gemma 3's local layers keep their window (lax.cond under nn.scan), MLA's
  narrow values are padded, MoE routes the same tokens."""
  common = (f"model_name={model}", f"max_target_length={SEQ}", "per_device_batch_size=4", "max_segments_per_seq=4")
  reference = make_config(*common, "attention=dot_product")
  cudnn = _cudnn_config(*common)
  assert cudnn.attention_segments == 4
  ids, pos, seg = _batch(reference)
  params = build.model(reference).init(jax.random.key(0), ids, pos, seg)
  logits = {}
  for name, config in (("dot_product", reference), ("cudnn", cudnn)):
    logits[name] = np.asarray(jax.jit(build.model(config).apply)(params, ids, pos, seg))
  real = seg > 0
  np.testing.assert_allclose(logits["cudnn"][real], logits["dot_product"][real], atol=5e-5)
  if model == "tiny-gemma3":  # the window matters here: without it the local layers' result differs
    unwindowed = config_lib.Config({**cudnn.to_dict(), "sliding_window_size": 0})
    other = np.asarray(jax.jit(build.model(unwindowed).apply)(params, ids, pos, seg))
    assert np.abs(other[real] - logits["dot_product"][real]).max() > 1e-3


def _lower_for_cuda(config, monkeypatch) -> str:
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91900)
  monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: float(capability) <= 9.0)
  monkeypatch.setattr(cudnn, "is_cuda_compute_capability_equal", lambda capability: capability == "9.0")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the model picks the cuDNN call, as on a GPU
  model = build.model(config)
  ids, pos, seg = _batch(config)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, pos, seg))

  def loss(params):
    return jnp.sum(model.apply(params, ids, pos, seg).astype(jnp.float32))

  lowered = jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",))
  return lowered.as_text()


@pytest.mark.slow
@pytest.mark.parametrize("model, window", [("tiny", 0), ("tiny-gemma3", 16), ("tiny-deepseek", 0)])
def test_the_cuda_program_calls_cudnn_with_the_packed_layout_and_holds_no_mask(model, window, monkeypatch):
  config = _cudnn_config(f"model_name={model}", f"max_target_length={SEQ}", "max_segments_per_seq=4", dtype="bfloat16")
  text = _lower_for_cuda(config, monkeypatch)
  assert "__cudnn$fmhaSoftmax" in text and "__cudnn$fmhaSoftmaxBackward" in text
  assert "Bias" not in re.sub(r"loc\(.*", "", text)  # no bias (what a mask becomes) is read by the kernel
  assert not re.search(rf"tensor<\d+x1x{SEQ}x{SEQ}x", text)  # no [b, 1, seq, seq] mask or bias anywhere
  assert r"\22max_seg_per_batch\22: 4" in text
  windows = set(re.findall(r"sliding_window_length\\22: (\d+)", text))
  assert windows == ({"0", str(window)} if window else {"0"})

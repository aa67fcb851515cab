"""decode.py: the KV-cache path gives the no-cache logits at every step; sampling strategies behave."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_config

from MaxLite.decode import generate, sample
from MaxLite.layers.decoder import Transformer
from MaxLite.parallel.sharding import unbox

PROMPTS = [[5, 17, 99, 3, 250], [7, 8], [42, 43, 44, 45, 46, 47, 48, 49]]


def _params(config):
  ids = jnp.zeros((1, config.max_target_length), jnp.int32)
  return unbox(Transformer(config).init(jax.random.key(3), ids, ids, ids)["params"])


def _full_logits(config, params, rows):
  """No-cache logits of every position of each row (right-padded; padding is segment 0)."""
  ids = np.zeros((len(rows), config.max_target_length), np.int32)
  segments = np.zeros_like(ids)
  for r, tokens in enumerate(rows):
    ids[r, : len(tokens)], segments[r, : len(tokens)] = tokens, 1
  pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
  return np.asarray(jax.jit(Transformer(config).apply)({"params": params}, ids, pos, segments))


@pytest.mark.slow
@pytest.mark.parametrize(
  "model",
  [("model_name=tiny",), ("model_name=tiny", "scan_layers=false"), ("model_name=tiny-moe",)],
  ids=["scanned", "unscanned", "moe"],
)
def test_cached_decoding_equals_full_recomputation(model):
  config = make_config(*model, "max_target_length=32", "max_prefill_predict_length=10", "max_decode_steps=8")
  params = _params(config)
  outputs, step_logits = generate(config, params, PROMPTS, return_logits=True)
  assert [len(o) for o in outputs] == [8, 8, 8]
  # Causal attention: position len(prompt) - 1 + i of the full sequence predicts generated token i.
  full = _full_logits(config, params, [p + o for p, o in zip(PROMPTS, outputs)])
  for row, prompt in enumerate(PROMPTS):
    for i in range(8):
      expected = full[row, len(prompt) - 1 + i]
      np.testing.assert_allclose(step_logits[i][row], expected, rtol=1e-5, atol=1e-5)
      assert outputs[row][i] == int(np.argmax(expected))  # greedy picks the recomputed argmax


@pytest.mark.slow
def test_decoding_stops_a_row_at_eos():
  config = make_config("model_name=tiny", "max_target_length=32", "max_prefill_predict_length=10", "max_decode_steps=8")
  params = _params(config)
  free, _ = generate(config, params, PROMPTS[:1])
  eos = free[0][2]
  stopped, _ = generate(config, params, PROMPTS[:1], eos_id=eos)
  assert stopped[0] == free[0][: free[0].index(eos) + 1]


def _settings(strategy, **kw):
  return types.SimpleNamespace(
    decode_sampling_strategy=strategy,
    decode_sampling_temperature=kw.get("t", 1.0),
    decode_sampling_top_k=kw.get("k", 40),
    decode_sampling_nucleus_p=kw.get("p", 0.9),
  )


def test_sampling_strategies():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
  keys = [jax.random.key(i) for i in range(200)]
  draws = lambda s: np.stack([np.asarray(sample(logits, k, s)) for k in keys])
  assert sample(logits, keys[0], _settings("greedy")).tolist() == [0, 3]
  assert (draws(_settings("topk", k=1)) == [0, 3]).all()
  top2 = draws(_settings("topk", k=2))
  assert set(top2[:, 0]) == {0, 1} and set(top2[:, 1]) == {3, 2}
  # Nucleus p=0.7: the smallest set reaching 0.7 is the two most likely tokens.
  nucleus = draws(_settings("nucleus", p=0.7))
  assert set(nucleus[:, 0]) == {0, 1} and set(nucleus[:, 1]) == {3, 2}
  everything = draws(_settings("weighted", t=1.0))
  assert set(everything[:, 0]) == {0, 1, 2, 3}
  assert (draws(_settings("weighted", t=1e-3)) == [0, 3]).all()  # a cold softmax is greedy


def test_prefill_plus_decode_must_fit_the_cache():
  config = make_config("model_name=tiny", "max_target_length=16", "max_prefill_predict_length=10", "max_decode_steps=8")
  with pytest.raises(Exception, match="exceeds max_target_length=16"):
    generate(config, None, PROMPTS)

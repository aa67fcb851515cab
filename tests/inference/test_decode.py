"""decode.py: the KV-cache path gives the no-cache logits at every step; sampling strategies behave."""

import json
import os
import re
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.config import BASE_YML, FAST_COMPILE, REPO, first_devices, make_config, run_train_cli

from MaxLite.cli.errors import ConfigError
from MaxLite.decode import generate, sample
from MaxLite.models.transformer import Transformer
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


def test_a_decode_step_never_transposes_the_whole_kv_cache():
  """The cache is stored heads before slots, the layout the attention's dots read: a layout they had to transpose
  made XLA copy every layer's whole cache at every step (a step's cost then grows with batch x max_target_length,
  not with the tokens held: 60% of the step at batch 16 and 1,024 slots on CPU)."""
  import functools

  from MaxLite.models import build, sampling

  config = make_config("model_name=tiny", "scan_layers=false", "max_target_length=96", "max_prefill_predict_length=8")
  model = build.model(config, decode=True, stored=False)
  params = _params(config)
  rows = 4
  ids, lengths = jnp.ones((rows, 8), jnp.int32), jnp.full((rows,), 5, jnp.int32)
  _, cache = jax.jit(functools.partial(sampling.prefill, model=model))(params, ids, lengths)
  sizes = {x.size for x in jax.tree.leaves(cache) if x.ndim == 4}
  assert sizes == {rows * config.base_num_kv_heads * 96 * config.head_dim}
  step = jax.jit(functools.partial(sampling.decode_step, model=model), donate_argnums=1)
  program = step.lower(params, cache, lengths, lengths).compile().as_text()
  moved = []
  for line in program.splitlines():
    m = re.search(r"= \w+\[([\d,]+)\]\S* (\w+)\(", line)
    if m and ("transpose" in line.split("=")[0] or m.group(2) in ("transpose", "copy")):
      if np.prod([int(d) for d in m.group(1).split(",")]) in sizes:
        moved.append(line.strip()[:160])
  assert not moved, moved


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


def test_topk_past_the_vocabulary_samples_every_token():
  logits = jnp.log(jnp.asarray([[0.4, 0.3, 0.2, 0.1]]))
  drawn = {int(sample(logits, jax.random.key(i), _settings("topk", k=40))[0]) for i in range(200)}
  assert drawn == {0, 1, 2, 3}


@pytest.mark.parametrize(
  "overrides, message",
  [
    (["decode_sampling_strategy=topk", "decode_sampling_top_k=0"], "decode_sampling_top_k must be in [1, inf)"),
    (["decode_sampling_top_k=-3"], "decode_sampling_top_k must be in [1, inf)"),
    (
      ["decode_sampling_strategy=nucleus", "decode_sampling_nucleus_p=1.5"],
      "decode_sampling_nucleus_p must be in (0, 1]",
    ),
    (["decode_sampling_nucleus_p=0"], "decode_sampling_nucleus_p must be in (0, 1]"),
    (["decode_sampling_nucleus_p=nan"], "decode_sampling_nucleus_p must be in (0, 1]"),
    (
      ["decode_sampling_strategy=weighted", "decode_sampling_temperature=0"],
      "decode_sampling_temperature must be in (0, inf) for decode_sampling_strategy='weighted'",
    ),
    (
      ["decode_sampling_strategy=topk", "decode_sampling_temperature=-1"],
      "decode_sampling_temperature must be in (0, inf) for decode_sampling_strategy='topk'",
    ),
    (
      ["decode_sampling_strategy=nucleus", "decode_sampling_temperature=inf"],
      "decode_sampling_temperature must be in (0, inf) for decode_sampling_strategy='nucleus'",
    ),
    (["max_prefill_predict_length=0"], "max_prefill_predict_length must be at least 1"),
    (["max_decode_steps=-1"], "max_decode_steps must be at least 1"),
    (["decode_seed=-1"], "decode_seed must be in [0, 2**32)"),
    (["decode_seed=4294967296"], "decode_seed must be in [0, 2**32)"),
  ],
)
def test_decode_settings_out_of_range_are_one_clear_error(overrides, message):
  with pytest.raises(ConfigError) as e:
    make_config(*overrides)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_greedy_takes_temperature_zero():
  """Greedy never reads the temperature; 0 is how other tools spell greedy."""
  assert make_config("decode_sampling_temperature=0").decode_sampling_temperature == 0.0


def _decode_cli(*overrides: str, cwd: str = REPO) -> subprocess.CompletedProcess:
  """`python MaxLite/decode.py configs/base.yml ...` on one CPU device, random weights unless a path is given."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
  command = [sys.executable, os.path.join(REPO, "MaxLite", "decode.py"), BASE_YML, "jax_cache_dir=", *overrides]
  return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _printed(stdout: str) -> list[tuple[int, str, str]]:
  """decode.py's output as (row, label, text): every line is `[i] label: "text"`, the text a JSON string."""
  rows = []
  for line in stdout.splitlines():
    match = re.fullmatch(r"\[(\d+)\] (\w+): (\".*\")", line)
    assert match, f"not a labeled line: {line!r} in {stdout!r}"
    rows.append((int(match[1]), match[2], json.loads(match[3])))
  return rows


@pytest.mark.slow
@pytest.mark.parametrize(
  "overrides, message",
  [
    (
      ["decode_sampling_strategy=topk", "decode_sampling_top_k=0"],
      "decode_sampling_top_k must be in [1, inf) (the most likely tokens kept), got 0",
    ),
    (
      ["decode_sampling_strategy=nucleus", "decode_sampling_nucleus_p=1.5"],
      "decode_sampling_nucleus_p must be in (0, 1] (probability mass kept), got 1.5",
    ),
    (
      ["decode_sampling_strategy=weighted", "decode_sampling_temperature=0"],
      "decode_sampling_temperature must be in (0, inf) for decode_sampling_strategy='weighted', got 0.0",
    ),
  ],
  ids=["top_k=0", "nucleus_p=1.5", "weighted-temperature=0"],
)
def test_decode_cli_bad_sampling_is_one_line(overrides, message):
  proc = _decode_cli("max_decode_steps=4", *overrides)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
  assert message in errors[0] and "Traceback" not in proc.stderr, errors[0]


@pytest.mark.slow
def test_decode_cli_bad_input_is_one_line(tmp_path):
  missing = _decode_cli(f"load_parameters_path={tmp_path / 'nope'}")
  assert missing.returncode == 2 and "load_parameters_path" in missing.stderr and "Traceback" not in missing.stderr
  too_long = _decode_cli("model_name=tiny", "max_prefill_predict_length=200", "max_decode_steps=100")
  assert too_long.returncode == 2 and "exceeds max_target_length=256" in too_long.stderr, too_long.stderr[-2000:]
  bad_strategy = _decode_cli("decode_sampling_strategy=beam")
  assert bad_strategy.returncode == 2 and "decode_sampling_strategy='beam' is not one of" in bad_strategy.stderr


def test_fit_prompt_keeps_bos_and_the_last_tokens():
  from MaxLite.inference.generate import fit_prompt

  assert fit_prompt([1, 5, 6], 3, keep_first=True) == [1, 5, 6]  # fits: unchanged
  assert fit_prompt([1, 5, 6, 7, 8], 3, keep_first=True) == [1, 7, 8]
  assert fit_prompt([5, 6, 7, 8], 3, keep_first=False) == [6, 7, 8]
  assert fit_prompt([1, 5, 6], 1, keep_first=True) == [1]


@pytest.mark.slow
def test_decode_cli_warns_of_a_cut_prompt_and_shows_what_the_model_saw():
  words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omega"
  proc = _decode_cli(f"prompt={words} ||| short", "max_prefill_predict_length=6", "max_decode_steps=2")
  assert proc.returncode == 0, proc.stderr[-3000:]
  warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: prompt")]
  assert len(warnings) == 1, proc.stderr[-3000:]  # the short prompt fits
  assert "warning: prompt [0] is " in warnings[0] and "longer than max_prefill_predict_length=6" in warnings[0]
  assert "sees only its last 5 after BOS" in warnings[0]
  printed = _printed(proc.stdout)
  assert [(row, label) for row, label, _ in printed] == [
    (0, "prompt"),
    (0, "completion"),
    (1, "prompt"),
    (1, "completion"),
  ]
  shown = printed[0][2]
  assert shown.startswith("…") and "omega" in shown and "alpha" not in shown, proc.stdout
  assert printed[2][2] == "short"


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface"])
def test_the_continuation_keeps_the_space_decoding_it_alone_drops(kind):
  """decode.py printed `The list type isthe :issue:`: sentencepiece drops the leading space of a text's first piece,
  so a continuation decoded on its own lost the space before it. Decoded with its prompt, the text reads as the model
  wrote it, for the shipped sentencepiece model and the shipped tokenizer.json alike."""
  from MaxLite.data.tokenizer import continuation_text, load_tokenizer

  path = {"sentencepiece": "assets/tokenizer/maxlite_sp8k.model", "huggingface": "assets/tokenizer/chat"}[kind]
  tokenizer = load_tokenizer(os.path.join(REPO, path), kind)
  prompt_text, whole = "The list type is", "The list type is the :issue: x — naïve"
  prompt = tokenizer.encode(prompt_text)
  new = tokenizer.encode(whole)[len(prompt) :]
  assert tokenizer.encode(whole)[: len(prompt)] == prompt
  bos = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
  assert prompt_text + continuation_text(tokenizer, bos + prompt, new) == whole


CHAT = ("tokenizer_type=huggingface", f"tokenizer_path={os.path.join(REPO, 'assets', 'tokenizer', 'chat')}")


@pytest.mark.parametrize(
  "prompt, messages",
  [
    ("What is a list?", [{"role": "user", "content": "What is a list?"}]),
    (
      '[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, '
      '{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is a tuple?"}]',
      None,
    ),
  ],
  ids=["text", "messages"],
)
def test_a_chat_prompt_is_what_apply_chat_template_gives(prompt, messages):
  """decode.py use_chat_template=true: a text prompt is one user turn, a JSON list is the conversation; either is
  rendered with the assistant's turn opened, token for token as transformers' apply_chat_template."""
  import json

  from transformers import AutoTokenizer

  from MaxLite.data.chat import ChatTemplate
  from MaxLite.data.tokenizer import load_tokenizer
  from MaxLite.inference.generate import chat_prompt_ids

  path = os.path.join(REPO, "assets", "tokenizer", "chat")
  tokenizer, template = load_tokenizer(path, "huggingface"), ChatTemplate.load(path)
  reference = AutoTokenizer.from_pretrained(path).apply_chat_template(
    messages or json.loads(prompt), add_generation_prompt=True, tokenize=True
  )
  reference = reference if isinstance(reference, list) else reference["input_ids"]
  assert chat_prompt_ids(tokenizer, template, prompt) == list(reference)


@pytest.mark.parametrize("also", [(), ("use_sft=true",)], ids=["alone", "with_use_sft"])
def test_decode_with_a_chat_template_prints_the_reply_up_to_the_end_of_turn(monkeypatch, capsys, also):
  """The template was refused without use_sft/use_dpo and silently not applied with use_sft: now it renders the
  prompt and generation stops at the chat's end-of-turn token (<|im_end|>). Each row prints its messages, then the
  reply (the reply alone lost a batch's questions)."""
  from MaxLite.data.tokenizer import load_tokenizer
  from MaxLite.inference import generate

  tokenizer = load_tokenizer(CHAT[1].split("=", 1)[1], "huggingface")
  reply = tokenizer.encode("A list holds items in order.")
  seen = {}

  def fake_generate(config, params, prompts, eos_id=None, return_logits=False):
    seen["prompts"], seen["eos"] = prompts, eos_id
    return [reply + [eos_id] for _ in prompts], None

  monkeypatch.setattr(generate, "load_params", lambda config, mesh: None)
  monkeypatch.setattr(generate, "generate", fake_generate)
  conversation = '[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a tuple?"}]'
  texts = [conversation] + ["What is a list?"] * (len(jax.devices()) - 1)  # one row per device (pytest sees 8)
  results = generate.run(
    [BASE_YML, "model_name=tiny", *CHAT, "use_chat_template=true", f"prompt={' ||| '.join(texts)}", *also]
  )
  assert results == ["A list holds items in order."] * len(jax.devices())
  # Each question is printed with its answer: a batch of replies keeps its questions.
  assert capsys.readouterr().out.splitlines()[:5] == [
    '[0] system: "Be brief."',
    '[0] user: "What is a tuple?"',
    '[0] assistant: "A list holds items in order."',
    '[1] user: "What is a list?"',
    '[1] assistant: "A list holds items in order."',
  ]
  assert tokenizer.decode(seen["prompts"][1]).endswith("<|im_start|>assistant\n")
  assert seen["eos"] == tokenizer.encode("<|im_end|>")[0]
  with pytest.raises(ConfigError, match="use_chat_template=true needs tokenizer_type=huggingface"):
    generate.run([BASE_YML, "model_name=tiny", "use_chat_template=true"])


@pytest.mark.slow
def test_decoding_on_a_data_fsdp_tensor_mesh_equals_one_device():
  """XLA miscomputed a decode step's output projections on this mesh (rows of two batch shards swapped) until the
  decoder traced with the residual stream whole (sharding.decode_axis_rules). Prompts of different lengths, so every
  row decodes at its own positions."""
  from flax.linen import partitioning as nn_partitioning

  from MaxLite.models import build
  from MaxLite.parallel import sharding
  from MaxLite.parallel.mesh import create_mesh

  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(1, 8000, size=rng.integers(5, 30))) for _ in range(8)]
  common = ("model_name=tiny", "max_target_length=64", "max_prefill_predict_length=40", "max_decode_steps=8")
  layouts = {
    1: ("per_device_batch_size=8",),
    8: ("per_device_batch_size=1", "ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
  }
  outputs = {}
  for n, layout in layouts.items():
    config = make_config(*common, *layout, num_devices=n)
    mesh = create_mesh(config, first_devices(n))
    with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding.axis_rules(config)):
      params = build.random_parameters(config, build.parameters(config, mesh, stored=False))
      outputs[n], _ = generate(config, params, prompts)
  assert outputs[8] == outputs[1]


# ---------------------------------------------------------------------- a real run's checkpoint and its tokenizer

CHAT_RUN = ("tokenizer_type=huggingface", "tokenizer_path=assets/tokenizer/chat", "vocab_size=4096")
SHORT = ("max_decode_steps=6", "max_prefill_predict_length=16", "max_target_length=64")


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
  """A real tiny training run with the shipped chat tokenizer, named by its repo-relative path, and vocab_size 4096:
  its orbax checkpoint's saved config holds those keys. Returns its base_output_directory (run_name=chat, step 3)."""
  out = tmp_path_factory.mktemp("runs")
  run = ("model_name=tiny", "steps=3", "max_target_length=64", "eval_interval=-1", "enable_tensorboard=false")
  trained = run_train_cli(
    *run,
    *CHAT_RUN,
    "per_device_batch_size=2",
    "enable_checkpointing=true",
    f"base_output_directory={out}",
    "run_name=chat",
    "jax_cache_dir=",
  )
  assert trained.returncode == 0, trained.stderr[-3000:]
  return out


@pytest.mark.slow
def test_decode_takes_the_tokenizer_saved_with_the_checkpoint(chat_run, tmp_path):
  """decode.py with load_parameters_path and no tokenizer keys read the run's ids with the default sentencepiece
  model (8192 pieces for a 4096-row model) and printed garbage, exit 0. The saved tokenizer keys come with the
  checkpoint, as its model keys do: the output equals that of the tokenizer named on the command line, from another
  working directory too (the saved repo-relative path is found under the repo)."""
  step = chat_run / "chat" / "checkpoints" / "3"
  common = (f"load_parameters_path={step}", "prompt=The Python ||| import", *SHORT)
  implicit = _decode_cli(*common, cwd=str(tmp_path))
  named = _decode_cli(*common, *CHAT)
  assert implicit.returncode == 0 and named.returncode == 0, implicit.stderr[-3000:] + named.stderr[-3000:]
  assert implicit.stdout == named.stdout and "⁇" not in implicit.stdout, implicit.stdout + named.stdout
  _assert_labeled(named.stdout)  # greedy, two processes: the same text


@pytest.mark.slow
def test_a_tokenizer_the_model_cannot_embed_is_one_line(chat_run, tmp_path):
  """An explicit tokenizer wins over the checkpoint's, but one whose vocabulary exceeds the model's vocab_size is one
  error line naming both; so is a saved tokenizer path that no longer exists, naming the paths tried."""
  step = chat_run / "chat" / "checkpoints" / "3"
  sentencepiece = ("tokenizer_type=sentencepiece", "tokenizer_path=assets/tokenizer/maxlite_sp8k.model")
  foreign = _decode_cli(f"load_parameters_path={step}", *sentencepiece, *SHORT)
  errors = [line for line in foreign.stderr.splitlines() if line.startswith("error:")]
  assert foreign.returncode == 2 and len(errors) == 1 and "Traceback" not in foreign.stderr, foreign.stderr[-3000:]
  assert "tokenizer_path=assets/tokenizer/maxlite_sp8k.model (set explicitly) has 8192 tokens" in errors[0]
  assert "more than the model's vocab_size=4096" in errors[0], errors[0]

  moved = tmp_path / "moved"
  shutil.copytree(step, moved)
  saved = moved / "config" / "config.json"
  settings = json.loads(saved.read_text())
  settings["tokenizer_path"] = "gone/chat"
  saved.write_text(json.dumps(settings))
  gone = _decode_cli(f"load_parameters_path={moved}", *SHORT, cwd=str(tmp_path))
  errors = [line for line in gone.stderr.splitlines() if line.startswith("error:")]
  assert gone.returncode == 2 and len(errors) == 1 and "Traceback" not in gone.stderr, gone.stderr[-3000:]
  assert (
    f"tokenizer_path=gone/chat (from the checkpoint {moved}) does not exist (tried {tmp_path}/gone/chat" in (errors[0])
  ), errors[0]
  assert f"{REPO}/gone/chat" in errors[0], errors[0]


@pytest.mark.slow
def test_a_run_name_decodes_its_newest_checkpoint(chat_run):
  """`decode.py configs/base.yml run_name=R base_output_directory=D` decoded random weights with a warning; the keys
  that named the run find its newest checkpoint, as training's resume does. A run with none is one line."""
  by_name = _decode_cli("run_name=chat", f"base_output_directory={chat_run}", "prompt=The Python", *SHORT)
  by_path = _decode_cli(f"load_parameters_path={chat_run / 'chat' / 'checkpoints' / '3'}", "prompt=The Python", *SHORT)
  assert by_name.returncode == 0, by_name.stderr[-3000:]
  assert "randomly initialised" not in by_name.stderr and by_name.stdout == by_path.stdout, by_name.stderr[-3000:]
  assert f"newest checkpoint: {chat_run}/chat/checkpoints/3" in by_name.stderr
  missing = _decode_cli("run_name=nothing", f"base_output_directory={chat_run}", *SHORT)
  errors = [line for line in missing.stderr.splitlines() if line.startswith("error:")]
  assert missing.returncode == 2 and errors == [
    f"error: run_name=nothing: no complete checkpoint in {chat_run}/nothing/checkpoints to decode; name one with "
    "load_parameters_path=STEP_DIR (or leave run_name out to decode random weights)"
  ], missing.stderr[-3000:]


@pytest.mark.slow
def test_decode_prints_each_prompt_and_its_completion_on_labeled_lines(chat_run):
  """The continuation was printed straight after the prompt, so where one ended and the other began could not be
  seen. Now each row is `[i] prompt: "..."` then `[i] completion: "..."`, JSON strings (a leading space shows);
  sampled rows as greedy ones (greedy: test_decode_takes_the_tokenizer_saved_with_the_checkpoint)."""
  step = chat_run / "chat" / "checkpoints" / "3"
  sampling = ("decode_sampling_strategy=nucleus", "decode_sampling_nucleus_p=0.9")
  proc = _decode_cli(f"load_parameters_path={step}", *CHAT, "prompt=The Python ||| import", *sampling, *SHORT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  _assert_labeled(proc.stdout)


def _assert_labeled(stdout: str) -> None:
  """Two prompts ("The Python", "import"), each on its line, then its non-empty completion on the next."""
  printed = _printed(stdout)
  assert [(row, label) for row, label, _ in printed] == [
    (0, "prompt"),
    (0, "completion"),
    (1, "prompt"),
    (1, "completion"),
  ]
  assert (printed[0][2], printed[2][2]) == ("The Python", "import")
  assert printed[1][2] and printed[3][2], stdout


@pytest.mark.slow
def test_to_hf_exports_the_tokenizer_saved_with_the_checkpoint(chat_run, tmp_path, monkeypatch):
  """to_hf of a run trained with the chat tokenizer wrote no tokenizer (and null BOS/EOS ids) unless told which: it
  comes with the checkpoint now, found from any working directory."""
  from transformers import AutoTokenizer

  from MaxLite.checkpoint import hf
  from MaxLite.data.tokenizer import load_tokenizer

  monkeypatch.chdir(tmp_path)
  out = tmp_path / "hf"
  files = hf.to_hf(str(chat_run / "chat" / "checkpoints"), str(out), [])
  assert "tokenizer.json" in files and "chat_template.jinja" in files, files
  ours = load_tokenizer(os.path.join(REPO, "assets", "tokenizer", "chat"), "huggingface")
  exported = AutoTokenizer.from_pretrained(str(out))
  assert exported("The Python", add_special_tokens=False)["input_ids"] == ours.encode("The Python")
  assert json.loads((out / "config.json").read_text())["eos_token_id"] == ours.eos_id


def test_a_saved_relative_tokenizer_path_is_found_where_the_run_was_trained(tmp_path, monkeypatch):
  """A run trained from its own project folder saved tokenizer_path=tok (relative): decoding from elsewhere finds it
  there (the saved run_dir ends with the relative base_output_directory/run_name); explicit keys still win."""
  from MaxLite.checkpoint import run_tokenizer

  project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
  shutil.copytree(os.path.join(REPO, "assets", "tokenizer", "chat"), project / "tok")
  step = project / "outputs" / "r" / "checkpoints" / "3"
  (step / "config").mkdir(parents=True)
  saved = {"tokenizer_type": "huggingface", "tokenizer_path": "tok", "add_bos": False, "dataset_type": "grain"}
  saved |= {"base_output_directory": "outputs", "run_name": "r", "run_dir": str(project / "outputs" / "r")}
  (step / "config" / "config.json").write_text(json.dumps(saved))
  elsewhere.mkdir()
  monkeypatch.chdir(elsewhere)
  raw = {"load_parameters_path": str(step), "explicit_keys": ["add_bos"], "add_bos": True}
  assert run_tokenizer.take_from_checkpoint(raw) == f"(from the checkpoint {step})"
  assert (raw["tokenizer_type"], raw["tokenizer_path"], raw["add_bos"]) == ("huggingface", str(project / "tok"), True)


def test_a_checkpoint_naming_no_tokenizer_refuses_a_default_of_another_size(tmp_path):
  """A converted step saves no tokenizer keys: decoding it without any read the shipped 8192-piece model's ids into a
  model of another vocabulary (a Qwen or Llama 3 conversion) and printed garbage. Now that is one line; a tokenizer
  named on the command line is checked only for ids past the model's rows."""
  from MaxLite.checkpoint import run_tokenizer
  from MaxLite.cli.errors import InputError
  from MaxLite.data.tokenizer import load_tokenizer

  default = load_tokenizer(os.path.join(REPO, "assets", "tokenizer", "maxlite_sp8k.model"))
  config = make_config("model_name=tiny", "vocab_size=16384", f"load_parameters_path={tmp_path}")
  with pytest.raises(InputError) as e:
    run_tokenizer.check_vocabulary(default, config, None)
  assert f"the checkpoint {tmp_path} names no tokenizer, and the default tokenizer_path=" in str(e.value)
  assert "has 8192 tokens where the model has vocab_size=16384" in str(e.value) and "\n" not in str(e.value)
  named = make_config("model_name=tiny", "vocab_size=16384", f"load_parameters_path={tmp_path}", "tokenizer_path=x")
  run_tokenizer.check_vocabulary(default, named, None)  # the user's choice: its ids all have rows

"""SFT and DPO math against transformers and torch on a tiny Llama built by transformers; records -> masked, packed
rows; the post-training keys' one-line errors."""

import functools
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.config import REPO, first_devices, make_config
from support.hf import hf_model, maxlite_config, maxlite_params

from MaxLite.checkpoint import hf as convert_hf
from MaxLite.checkpoint.manager import saved_arrays
from MaxLite.cli.errors import ConfigError, InputError
from MaxLite.data.grain_pipeline import Records, make_grain_iterator
from MaxLite.data.packing import Group, Masked, pack_documents
from MaxLite.data.records import EncodeRecord
from MaxLite.data.tokenizer import load_tokenizer
from MaxLite.models.hf_layout import global_tensors, layer_tensors
from MaxLite.models.transformer import Transformer
from MaxLite.objectives import cross_entropy as loss
from MaxLite.objectives import dpo
from MaxLite.training.train_step import batch_loss_sums
from MaxLite.training.trainer import train

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 48
SENTENCEPIECE = f"{REPO}/assets/tokenizer/maxlite_sp8k.model"


def _random_documents(rng, vocab, count, prompt=(3, 9), response=(2, 8)):
  """(prompt ids, response ids) pairs."""
  out = []
  for _ in range(count):
    p, r = rng.integers(*prompt), rng.integers(*response)
    out.append((rng.integers(1, vocab, p).tolist(), rng.integers(1, vocab, r).tolist()))
  return out


def _masked(prompt, response):
  return Masked(np.asarray(prompt + response), np.asarray([0] * len(prompt) + [1] * len(response)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """A tiny transformers Llama (the policy) and a perturbed copy (the reference), with both converted to MaxLite."""
  tmp = tmp_path_factory.mktemp("models")
  policy, path = hf_model(tmp, "policy")
  reference = transformers.LlamaForCausalLM(policy.config).eval()
  reference.load_state_dict(policy.state_dict())
  torch.manual_seed(1)
  with torch.no_grad():
    for param in reference.parameters():
      param.add_(0.02 * torch.randn_like(param))
  reference.save_pretrained(str(tmp / "reference"))
  step_dir = convert_hf.to_maxlite(path, str(tmp / "ml_policy"), [])
  ref_dir = convert_hf.to_maxlite(str(tmp / "reference"), str(tmp / "ml_reference"), [])
  config = maxlite_config(step_dir, f"max_target_length={SEQ}")
  return policy, reference, config, maxlite_params(config, step_dir), maxlite_params(config, ref_dir)


def _torch_token_log_probs(model, ids):
  """Per-position log-probability of the next token of each sequence (batch of 1 each, no padding)."""
  out = []
  for seq in ids:
    x = torch.tensor([seq])
    logp = torch.log_softmax(model(x).logits.float(), -1)[0, :-1]
    out.append(logp.gather(-1, x[0, 1:, None])[:, 0])
  return out


@pytest.mark.slow
def test_sft_loss_with_completion_mask_equals_transformers(models):
  policy, _, config, params, _ = models
  rng = np.random.default_rng(0)
  conversations = _random_documents(rng, policy.config.vocab_size, 9, prompt=(3, 14), response=(2, 12))
  batch = pack_documents([Group((_masked(p, r),)) for p, r in conversations], SEQ)
  assert len(batch["inputs"]) >= 2 and (np.diff(batch["inputs_segmentation"], axis=1) > 0).any()  # packed rows
  _, sums = batch_loss_sums(params, Transformer(config).apply, batch, jax.random.key(0), config)
  ours = float(sums["loss_sum"] / sums["count"])
  # transformers: each conversation its own padded row, prompt and padding labelled -100.
  longest = max(len(p) + len(r) for p, r in conversations)
  ids = np.zeros((len(conversations), longest), np.int64)
  labels = np.full_like(ids, -100)
  attention = np.zeros_like(ids)
  for i, (p, r) in enumerate(conversations):
    ids[i, : len(p) + len(r)] = p + r
    labels[i, len(p) : len(p) + len(r)] = r
    attention[i, : len(p) + len(r)] = 1
  with torch.no_grad():
    out = policy(torch.tensor(ids), attention_mask=torch.tensor(attention), labels=torch.tensor(labels))
  print(f"SFT loss: MaxLite {ours:.8f} transformers {out.loss.item():.8f}")
  assert float(sums["count"]) == sum(len(r) for _, r in conversations)
  np.testing.assert_allclose(ours, out.loss.item(), rtol=1e-5)


def _dpo_batch(rng, vocab, pairs=5):
  docs = []
  for prompt, chosen in _random_documents(rng, vocab, pairs):
    rejected = rng.integers(1, vocab, rng.integers(2, 8)).tolist()
    docs.append((prompt, chosen, rejected))
  batch = pack_documents([Group((_masked(p, c), _masked(p, r))) for p, c, r in docs], SEQ)
  return docs, batch


def _torch_dpo_loss(policy, reference, docs, beta, smoothing):
  def response_sums(model, grad):
    with torch.set_grad_enabled(grad):
      chosen = _torch_token_log_probs(model, [p + c for p, c, _ in docs])
      rejected = _torch_token_log_probs(model, [p + r for p, _, r in docs])
    # position t predicts token t+1: the response tokens are predicted from len(prompt)-1 on
    pick = lambda logps: torch.stack([lp[len(p) - 1 :].sum() for lp, (p, _, _) in zip(logps, docs)])  # noqa: E731
    return pick(chosen), pick(rejected)

  pc, pr = response_sums(policy, True)
  rc, rr = response_sums(reference, False)
  logits = beta * ((pc - rc) - (pr - rr))
  losses = -(1 - smoothing) * torch.nn.functional.logsigmoid(logits) - smoothing * torch.nn.functional.logsigmoid(
    -logits
  )
  return losses.mean(), beta * (pc - rc).detach(), beta * (pr - rr).detach()


def _hf_named(config, tree):
  """MaxLite arrays (parameters or their gradients) under transformers' names, in transformers' layout."""

  def get(path):
    node = tree
    for part in path.split("/"):
      node = node[part]
    return np.asarray(node)

  named = {t.hf_name: t.to_hf(get(t.path)) for t in global_tensors(config.logits_via_embedding)}
  for i in range(config.base_num_decoder_layers):
    for t in layer_tensors(config):
      named[f"model.layers.{i}.{t.hf_name}"] = t.to_hf(get(f"decoder/layers/{t.path}")[i])
  return named


@pytest.mark.slow
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_dpo_loss_and_gradients_equal_torch(models, smoothing):
  policy, reference, config, params, ref_params = models
  config = maxlite_config(
    config.load_parameters_path, f"max_target_length={SEQ}", "use_dpo=true", f"dpo_label_smoothing={smoothing}"
  )
  docs, batch = _dpo_batch(np.random.default_rng(1), policy.config.vocab_size)
  apply = Transformer(config).apply

  def mean_loss(p):
    total, sums = batch_loss_sums(p, apply, batch, jax.random.key(0), config, reference=ref_params)
    return total / sums["count"], sums

  (ours, sums), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
  policy.zero_grad()
  theirs, chosen_rewards, rejected_rewards = _torch_dpo_loss(policy, reference, docs, config.dpo_beta, smoothing)
  theirs.backward()
  print(f"DPO loss (label smoothing {smoothing}): MaxLite {float(ours):.8f} torch {theirs.item():.8f}")
  assert float(sums["pairs"]) == len(docs)
  np.testing.assert_allclose(float(ours), theirs.item(), rtol=1e-5)
  np.testing.assert_allclose(float(sums["rewards/chosen"]), chosen_rewards.sum().item(), rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(float(sums["rewards/rejected"]), rejected_rewards.sum().item(), rtol=1e-4, atol=1e-6)
  assert float(sums["rewards/accuracies"]) == (chosen_rewards > rejected_rewards).sum().item()
  ours_named = _hf_named(config, grads)
  torch_grads = {name: p.grad.numpy() for name, p in policy.named_parameters()}
  assert set(ours_named) == set(torch_grads)
  worst = max(np.abs(ours_named[n] - torch_grads[n]).max() / (np.abs(torch_grads[n]).max() + 1e-12) for n in ours_named)
  print(f"largest gradient difference relative to the tensor's largest entry: {worst:.2e}")
  for name, expected in torch_grads.items():
    np.testing.assert_allclose(ours_named[name], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(), err_msg=name)


def test_dpo_loss_is_log_2_when_policy_is_reference(models):
  policy, _, config, params, _ = models
  config = maxlite_config(config.load_parameters_path, f"max_target_length={SEQ}", "use_dpo=true")
  _, batch = _dpo_batch(np.random.default_rng(2), policy.config.vocab_size, pairs=6)
  _, sums = batch_loss_sums(params, Transformer(config).apply, batch, jax.random.key(0), config, reference=params)
  assert float(sums["pairs"]) == 6
  np.testing.assert_allclose(float(sums["loss_sum"]) / 6, math.log(2), rtol=1e-6)
  assert float(sums["rewards/margins"]) == 0.0 and float(sums["rewards/accuracies"]) == 0.0


def test_dpo_reference_runs_without_dropout(models):
  """With dropout_rate > 0 the policy's forward pass drops activations but the frozen reference's never does: the
  reference log-probabilities in the rewards are those of a deterministic forward pass of the reference params."""
  policy, _, config, params, ref_params = models
  config = maxlite_config(config.load_parameters_path, f"max_target_length={SEQ}", "use_dpo=true", "dropout_rate=0.5")
  _, batch = _dpo_batch(np.random.default_rng(3), policy.config.vocab_size)
  rng = jax.random.key(7)
  dropping, deterministic = Transformer(config, deterministic=False).apply, Transformer(config).apply
  _, sums = batch_loss_sums(params, dropping, batch, rng, config, reference=ref_params)

  def responses(apply, p):  # the train step's forward pass: dropout drawn from `rng`
    logits, _ = apply(
      {"params": p},
      batch["inputs"],
      batch["inputs_position"],
      batch["inputs_segmentation"],
      rngs={"dropout": rng},
      mutable="intermediates",
    )
    log_p, _ = loss.target_log_probs(logits, batch["targets"])
    return dpo.response_log_probs(log_p, batch["targets_segmentation"])

  chosen, rejected, valid = responses(dropping, params)
  ref_chosen, ref_rejected, _ = responses(deterministic, ref_params)
  assert not np.allclose(responses(dropping, ref_params)[0], ref_chosen)  # the dropout changes log-probabilities
  beta = config.dpo_beta
  np.testing.assert_allclose(float(sums["rewards/chosen"]), beta * float(np.sum(valid * (chosen - ref_chosen))), 1e-5)
  np.testing.assert_allclose(
    float(sums["rewards/rejected"]), beta * float(np.sum(valid * (rejected - ref_rejected))), 1e-5
  )


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Sharding info not provided when restoring")  # the arrays are compared on host
def test_dpo_from_the_full_state_of_a_run_without_dpo(tmp_path):
  """load_full_state_path may name a step of a pretraining or SFT run, whose state holds no reference: DPO goes on
  from that state (its step, parameters and optimizer moments) with its parameters as the frozen reference, so the
  first loss is log 2, and the DPO run's checkpoint holds those parameters as its reference."""
  import orbax.checkpoint as ocp

  common = (
    "model_name=tiny",
    "max_target_length=64",
    "per_device_batch_size=2",
    "enable_tensorboard=false",
    "enable_checkpointing=true",
    f"base_output_directory={tmp_path}",
  )
  train(make_config(*common, "run_name=pre", "dataset_type=synthetic", "steps=2"), first_devices(1))
  preferences = os.path.join(REPO, "assets", "post_training", "preferences-train.jsonl")
  rows = train(
    make_config(
      *common,
      "run_name=dpo",
      "use_dpo=true",
      "dataset_type=grain",
      "grain_file_type=jsonl",
      f"grain_train_files={preferences}",
      "grain_eval_files=",
      f"load_full_state_path={tmp_path}/pre/checkpoints/2",
      "steps=3",
    ),
    first_devices(1),
  )
  assert [r["step"] for r in rows] == [3]
  np.testing.assert_allclose(rows[0]["loss"], math.log(2), rtol=1e-6)
  dpo_state = str(tmp_path / "dpo" / "checkpoints" / "3" / "state")
  assert any(name.startswith("reference.") for name in saved_arrays(dpo_state))
  with ocp.PyTreeCheckpointer() as checkpointer:
    loaded = checkpointer.restore(str(tmp_path / "pre" / "checkpoints" / "2" / "state"))["params"]
    reference = checkpointer.restore(dpo_state)["reference"]
  jax.tree.map(np.testing.assert_array_equal, reference, loaded)


def test_response_log_probs_per_pair():
  """Segments 2p+1 / 2p+2 are pair p's chosen / rejected; zero segments (prompts, padding) never count; a pair
  whose rejected side has no response token is not valid."""
  logp = np.arange(1.0, 13.0)[None].repeat(2, 0)
  segments = np.array([[1, 1, 0, 2, 2, 3, 0, 4, 0, 0, 0, 0], [0, 1, 1, 1, 2, 2, 0, 3, 3, 0, 0, 0]])
  chosen, rejected, valid = (np.asarray(a) for a in dpo.response_log_probs(logp, segments))
  np.testing.assert_array_equal(chosen[:, :2], [[1 + 2, 6], [2 + 3 + 4, 8 + 9]])
  np.testing.assert_array_equal(rejected[:, :2], [[4 + 5, 8], [5 + 6, 0]])
  np.testing.assert_array_equal(valid[:, :3], [[1, 1, 0], [1, 0, 0]])


def test_dpo_ties_within_rounding_are_not_wins():
  """policy = reference (DPO's first step) on a sharded mesh: the two forward passes are compiled apart and their
  summed log-probabilities differ by a few float32 roundings (default model, ici_tensor_parallelism=2: step 1 logged
  rewards/accuracies 0.08 with margins 0.000). Those pairs are ties, and as in TRL ((chosen_rewards >
  rejected_rewards).float()) a tie is not a win; a margin well above rounding still is."""
  rng = np.random.default_rng(0)
  pairs = 40
  reference = [jnp.asarray(-rng.uniform(200, 900, (2, pairs)).astype(np.float32)) for _ in range(2)]

  def ulps(x, n):  # x moved by n float32 roundings, n random in [-n, n]
    steps = rng.integers(-n, n + 1, x.shape)
    out = np.asarray(x).copy()
    for _ in range(n):
      out = np.where(steps > 0, np.nextafter(out, np.float32(np.inf)), out)
      out = np.where(steps < 0, np.nextafter(out, np.float32(-np.inf)), out)
      steps = steps - np.sign(steps)
    return jnp.asarray(out)

  valid = jnp.ones((2, pairs), jnp.float32)
  noisy = (ulps(reference[0], 3), ulps(reference[1], 3))
  sums = dpo.dpo_sums(noisy, tuple(reference), valid, beta=0.1, label_smoothing=0.0)
  assert abs(float(sums["rewards/margins"])) / (2 * pairs) < 1e-4  # reads 0.000
  assert float(sums["rewards/accuracies"]) == 0.0
  # A real preference one step of training can make (a margin of 1e-3 in reward) is a win.
  moved = (reference[0] + 0.01, reference[1])
  sums = dpo.dpo_sums(moved, tuple(reference), valid, beta=0.1, label_smoothing=0.0)
  assert float(sums["rewards/accuracies"]) == 2 * pairs


def test_records_become_masked_documents_and_whole_pairs():
  tokenizer = load_tokenizer(SENTENCEPIECE)
  encode = functools.partial(EncodeRecord, tokenizer=tokenizer, template=None, add_bos=True, add_eos=True)
  record = {"prompt": "What does len() return?", "completion": " The number of items."}
  (doc,) = encode("prompt_completion", completion_only=True).map(record)
  prompt_ids = [tokenizer.bos_id] + tokenizer.encode(record["prompt"])
  completion_ids = tokenizer.encode(record["completion"]) + [tokenizer.eos_id]
  np.testing.assert_array_equal(doc.tokens, prompt_ids + completion_ids)
  np.testing.assert_array_equal(doc.mask, [0] * len(prompt_ids) + [1] * len(completion_ids))
  assert encode("prompt_completion", completion_only=False).map(record)[0].mask.all()

  pair = encode("preference", completion_only=False).map(
    {"prompt": record["prompt"], "chosen": record["completion"], "rejected": " A list."}
  )
  assert isinstance(pair, Group) and len(pair) == 2
  assert not pair[1].mask[: len(prompt_ids)].any() and pair[1].mask[len(prompt_ids) :].all()
  rows = pack_documents([pair, pair, pair], seq_len=30)
  # Each row holds whole pairs as segments 1, 2 (, 3, 4): a pair that does not fit opens the next row.
  for row_inputs, row_targets in zip(rows["inputs_segmentation"], rows["targets_segmentation"]):
    used = row_inputs[row_inputs > 0]
    assert set(used) in ({1, 2}, {1, 2, 3, 4}) and np.all(np.diff(used) >= 0)
    # Only response targets count: the prompt's are 0, so per row the learned targets are the responses.
    assert set(row_targets[row_targets > 0]) == set(used)
  assert (rows["inputs_segmentation"] > 0).sum() == 3 * (len(pair[0].tokens) - 1 + len(pair[1].tokens) - 1)


@pytest.mark.parametrize(
  ("overrides", "message"),
  [
    (("use_sft=true", "use_dpo=true"), "choose one"),
    (("use_dpo=true",), "use_dpo=true needs load_parameters_path"),
    (("use_sft=true",), r"train_data_columns=\['messages'\] needs use_chat_template=true"),
    (("use_sft=true", "train_data_columns=['chosen','rejected']"), r"does not fit use_sft; use \['messages'\] or"),
    (("use_sft=true", "train_data_columns=['prompt','completion']", "use_chat_template=true"), "tokenizer_type"),
    (("use_chat_template=true",), "needs use_sft=true or use_dpo=true"),
    (("use_dpo=true", "load_parameters_path=x", "dpo_label_smoothing=0.5"), r"dpo_label_smoothing must be in"),
    (("use_sft=true", "train_data_columns=['prompt','completion']", "dataset_type=synthetic"), "dataset_type=grain"),
  ],
)
def test_post_training_keys_errors(overrides, message):
  with pytest.raises(ConfigError, match=message):
    make_config(*overrides)


def test_shipped_sets_and_tokenizer_are_what_the_builder_makes(tmp_path):
  """assets/post_training/ and assets/tokenizer/chat/ are make_post_training_data.py's output, byte for byte."""
  from MaxLite import make_post_training_data

  assert make_post_training_data.main(["--output_dir", str(tmp_path)]) == 0
  for folder in ("post_training", os.path.join("tokenizer", "chat")):
    names = sorted(os.listdir(tmp_path / folder))
    assert names == sorted(os.listdir(os.path.join(REPO, "assets", folder)))
    for name in names:
      with open(tmp_path / folder / name, "rb") as built, open(os.path.join(REPO, "assets", folder, name), "rb") as f:
        assert built.read() == f.read(), f"{folder}/{name} differs from what make_post_training_data.py builds"


def test_a_changed_chat_template_refuses_to_resume_the_data_stream(tmp_path):
  tokenizer_dir = tmp_path / "tok"
  shutil.copytree(os.path.join(REPO, "assets", "tokenizer", "chat"), tokenizer_dir)
  args = dict(
    tokenizer_path=str(tokenizer_dir),
    seq_len=128,
    num_slots=2,
    slots=[0, 1],
    seed=0,
    add_bos=True,
    add_eos=True,
    tokenizer_type="huggingface",
    file_type="jsonl",
    records=Records("chat", ["messages"], use_chat_template=True, completion_only=True),
  )
  files = os.path.join(REPO, "assets", "post_training", "chats-eval.jsonl")
  first = make_grain_iterator(files, **args)
  batch = next(first)
  assert (batch["targets_segmentation"] > 0).any() and (
    batch["targets_segmentation"] < batch["inputs_segmentation"]
  ).any()
  state = first.get_state()
  again = make_grain_iterator(files, **args)
  again.set_state(state)
  np.testing.assert_array_equal(next(again)["inputs"], next(first)["inputs"])
  (tokenizer_dir / "chat_template.jinja").write_text((tokenizer_dir / "chat_template.jinja").read_text() + "\n")
  with pytest.raises(InputError, match="the tokenizer files or the chat template changed"):
    make_grain_iterator(files, **args).set_state(state)


def test_train_state_tree_is_flax_s_unless_it_holds_a_reference():
  """Checkpoints written by flax's TrainState (every pretraining checkpoint before DPO existed) keep restoring."""
  import optax
  from flax.training import train_state as flax_train_state

  from MaxLite.training.train_state import TrainState

  def paths(tree):
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]

  params = {"w": np.ones(3, np.float32)}
  ours = TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
  theirs = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
  assert paths(ours) == paths(theirs)
  with_reference = ours.replace(reference=params)
  assert paths(with_reference) == paths(theirs) + [".reference['w']"]
  assert jax.tree.map(lambda x: x, with_reference).reference["w"] is params["w"]

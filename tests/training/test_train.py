"""The sharded train loop: every mesh layout equals one device, accumulation, shardings, memory, NaN stop."""

import logging
import re

import jax
import numpy as np
import pytest
from flax.linen import partitioning as nn_partitioning
from support.config import first_devices, make_config

from MaxLite.models.transformer import Transformer
from MaxLite.parallel import sharding as sharding_lib
from MaxLite.parallel.mesh import create_mesh
from MaxLite.training.metrics import NonFiniteLossError
from MaxLite.training.optimizer import create_optimizer
from MaxLite.training.train_state import abstract_state, bytes_per_device, create_train_state, total_bytes
from MaxLite.training.trainer import train

TINY = (
  "model_name=tiny",
  "max_target_length=64",
  "steps=3",
  "dataset_type=synthetic",
  "eval_interval=-1",  # the last step's eval: the tests that evaluate ask for it
  "enable_tensorboard=false",
  "learning_rate=1e-2",
  "warmup_steps_fraction=0.0",
  "enable_checkpointing=false",  # the tests that save ask for it
)


def _losses(tmp_path, num_devices, *overrides):
  config = make_config(
    *TINY,
    f"base_output_directory={tmp_path}",
    f"run_name=r{num_devices}_{abs(hash(overrides))}",
    *overrides,
    num_devices=num_devices,
  )
  rows = train(config, first_devices(num_devices))
  return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
  return _losses(tmp_path_factory.mktemp("one"), 1, "per_device_batch_size=8")


@pytest.mark.slow
@pytest.mark.parametrize(
  "mesh",
  [
    # (tensor, sequence, stage and expert layouts: tests/parallel/test_parallelism.py)
    ("ici_fsdp_parallelism=8",),
    ("ici_data_parallelism=8", "ici_fsdp_parallelism=1"),
    ("ici_fsdp_parallelism=2", "dcn_data_parallelism=4", "num_slices=4"),
  ],
  ids=["fsdp8", "data8", "fsdp2_dcn_data4"],
)
def test_mesh_layouts_match_single_device(tmp_path, single_device, mesh):
  losses, grad_norms = _losses(tmp_path, 8, "per_device_batch_size=1", *mesh)
  np.testing.assert_allclose(losses, single_device[0], rtol=1e-5)
  np.testing.assert_allclose(grad_norms, single_device[1], rtol=1e-5)


@pytest.mark.slow
def test_gradient_accumulation_equals_one_big_batch(tmp_path, single_device):
  losses, grad_norms = _losses(tmp_path, 1, "per_device_batch_size=2", "gradient_accumulation_steps=4")
  np.testing.assert_allclose(losses, single_device[0], rtol=1e-5)
  np.testing.assert_allclose(grad_norms, single_device[1], rtol=1e-5)


@pytest.mark.slow
def test_same_seed_same_losses_bit_for_bit(tmp_path, single_device):
  again, grad_norms = _losses(tmp_path, 1, "per_device_batch_size=8")
  assert again == single_device[0] and grad_norms == single_device[1]
  other_seed, _ = _losses(tmp_path, 1, "per_device_batch_size=8", "init_weights_seed=1")
  assert other_seed != single_device[0]


def _state_on(config, n):
  mesh = create_mesh(config, first_devices(n))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    model, tx = Transformer(config), create_optimizer(config)
    return create_train_state(model, tx, config, abstract_state(model, tx, config, mesh)[2])


# Expected mesh placement of each parameter under base.yml's rules with fsdp=4 x tensor=2,
# written out by hand from the rules: embed -> fsdp, heads/mlp/vocab -> tensor, layers -> stage (size 1
# here), norm/kv -> replicated.
FS = ("fsdp", "sequence")  # the 'embed' rule: fsdp and sequence together (sequence=1 here)
EXPECTED_SPECS = {
  "token_embedder/embedding": ("tensor", FS),
  "decoder/layers/self_attention/query/kernel": ("stage", FS, "tensor", None),
  "decoder/layers/self_attention/key/kernel": ("stage", FS, "tensor", None),
  "decoder/layers/self_attention/value/kernel": ("stage", FS, "tensor", None),
  "decoder/layers/self_attention/out/kernel": ("stage", "tensor", None, FS),
  "decoder/layers/mlp/wi_0/kernel": ("stage", FS, "tensor"),
  "decoder/layers/mlp/wi_1/kernel": ("stage", FS, "tensor"),
  "decoder/layers/mlp/wo/kernel": ("stage", "tensor", FS),
  "decoder/layers/pre_self_attention_norm/scale": ("stage", None),
  "decoder/layers/post_self_attention_norm/scale": ("stage", None),
  "decoder_norm/scale": (None,),
  "logits_dense/kernel": (FS, "tensor"),
}


def test_parameter_shardings_follow_logical_rules():
  config = make_config(
    *TINY, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "per_device_batch_size=1", num_devices=8
  )
  state = _state_on(config, 8)
  seen = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
    name = "/".join(k.key for k in path)
    spec = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
    print(f"{name:50s} {leaf.shape} -> {spec}")
    seen[name] = spec
  assert seen == EXPECTED_SPECS
  # And the bytes really are split: the query kernel holds 1/8 of its elements on each device.
  query = state.params["decoder"]["layers"]["self_attention"]["query"]["kernel"]
  assert query.addressable_shards[0].data.size * 8 == query.size
  # Adam's moments are sharded exactly like the parameters they track.
  mu = state.opt_state[1][0].mu
  for p, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(mu)):
    assert p.sharding == m.sharding


def test_fsdp_divides_param_and_optimizer_memory_by_eight():
  overrides = ("model_name=tiny", "base_emb_dim=128", "base_mlp_dim=256", "dataset_type=synthetic")
  one = _state_on(make_config(*overrides, "per_device_batch_size=8"), 1)
  eight = _state_on(make_config(*overrides, "per_device_batch_size=1", "ici_fsdp_parallelism=8", num_devices=8), 8)
  total = total_bytes((one.params, one.opt_state))
  assert bytes_per_device((one.params, one.opt_state)) == total
  per_device = bytes_per_device((eight.params, eight.opt_state))
  print(f"params+optimizer bytes: 1 device {total}, fsdp=8 per device {per_device} (ratio {total / per_device:.3f})")
  assert abs(per_device / (total / 8) - 1) < 0.03
  # The shape-only estimate (used by train_compile and debug_sharding) agrees with the live shards.
  config = make_config(*overrides, "per_device_batch_size=1", "ici_fsdp_parallelism=8", num_devices=8)
  mesh = create_mesh(config, first_devices(8))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding_lib.axis_rules(config)):
    abstract, _, shardings = abstract_state(Transformer(config), create_optimizer(config), config, mesh)
  assert (
    sharding_lib.sharded_bytes((abstract.params, abstract.opt_state), (shardings.params, shardings.opt_state))
    == per_device
  )


def test_non_finite_loss_stops_with_the_step(tmp_path):
  config = make_config(
    *TINY,
    f"base_output_directory={tmp_path}",
    "learning_rate=1e38",
    "steps=5",
    "gradient_clipping_threshold=0",
    "per_device_batch_size=2",
  )
  with pytest.raises(NonFiniteLossError, match=r"step \d+: loss is \S+ and grad_norm is (nan|inf)"):
    train(config, first_devices(1))


@pytest.mark.slow
def test_eval_rows_are_logged_every_interval_and_at_the_last_step(tmp_path, capsys):
  config = make_config(
    *TINY,
    f"base_output_directory={tmp_path}",
    "run_name=ev",
    "per_device_batch_size=2",
    "steps=5",
    "eval_interval=2",
    "eval_steps=2",
  )
  rows = train(config, first_devices(1))
  evals = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in evals] == [2, 4, 5]  # step 5: the run's last, off the interval
  assert all(np.isfinite(r["eval_loss"]) for r in evals)
  written = (tmp_path / "ev" / "metrics.jsonl").read_text()
  assert written.count("eval_loss") == 3
  assert f"eval loss {evals[-1]['eval_loss']:.4f} at step 5, " in capsys.readouterr().out.splitlines()[-1]


class _CompileLog(logging.Handler):
  def __init__(self):
    super().__init__()
    self.names = []

  def emit(self, record):
    match = re.match(r"Compiling (jit\(\w+\))", record.getMessage())
    if match:
      self.names.append(match.group(1))


@pytest.mark.slow
def test_no_recompilation_after_the_first_step(tmp_path):
  """Train, eval and checkpoint saves each compile once; later steps reuse the executables."""
  handler = _CompileLog()
  logger = logging.getLogger("jax._src.interpreters.pxla")
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      train(
        make_config(
          "model_name=tiny",
          "max_target_length=64",
          "per_device_batch_size=2",
          "dataset_type=synthetic",
          "steps=6",
          "eval_interval=3",
          "eval_steps=2",
          "enable_checkpointing=true",
          "checkpoint_period=2",
          "enable_tensorboard=false",
          f"base_output_directory={tmp_path}",
        ),
        first_devices(1),
      )
  finally:
    logger.removeHandler(handler)
  assert handler.names.count("jit(split_train_step)") == 1, handler.names
  assert handler.names.count("jit(eval_step)") == 1, handler.names


def test_a_sharded_run_traces_the_model_s_initialiser_once(tmp_path, monkeypatch):
  """The abstract state (for the shardings) and the sharded init share one trace of the model, not one each."""
  from MaxLite.training import train_state

  traced, init_state = [], train_state.init_state
  monkeypatch.setattr(train_state, "init_state", lambda *args: traced.append(1) or init_state(*args))
  config = make_config(*TINY, "steps=1", "ici_fsdp_parallelism=8", f"base_output_directory={tmp_path}", num_devices=8)
  train(config, first_devices(8))
  assert len(traced) == 1


def test_metrics_in_a_bucket_are_uploaded_at_most_every_few_seconds(monkeypatch):
  """An object cannot be appended to, so each upload rewrites the whole file: never once per step."""
  from MaxLite.training import metrics

  uploads, clock = [], [100.0]
  monkeypatch.setattr(metrics.storage, "exists", lambda path: False)
  monkeypatch.setattr(metrics.storage, "write_text", lambda path, text: uploads.append((path, text)))
  monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
  config = make_config("base_output_directory=gs://bucket/runs", "run_name=r", "enable_tensorboard=false")
  writer = metrics.MetricsWriter(config, is_primary=True)
  for step in range(1, 6):
    writer.write({"step": step, "loss": 1.0})
  assert uploads == []
  clock[0] += metrics._OBJECT_REWRITE_S
  writer.write({"step": 6, "loss": 1.0})
  assert len(uploads) == 1 and uploads[0][0] == "gs://bucket/runs/r/metrics.jsonl"
  assert uploads[0][1].count("\n") == 6
  writer.write({"step": 7, "loss": 1.0})
  writer.flush()  # a checkpoint: every row so far is stored
  assert len(uploads) == 2 and uploads[1][1].count("\n") == 7
  writer.close()
  assert len(uploads) == 2  # nothing new to write


@pytest.mark.slow
def test_a_resumed_run_logs_each_step_once(tmp_path):
  """A run killed after logging step 4 with its last checkpoint at 2 replays steps 3 and 4: metrics.jsonl keeps one
  row per step (the replayed ones), not 1 2 3 4 3 4 5 6. In a bucket: end_to_end/test_gcs.py kills a real run there
  and reads back exactly one row per step."""
  import json
  import shutil

  from MaxLite import storage

  out = str(tmp_path)
  common = (
    *TINY,
    f"base_output_directory={out}",
    "run_name=re",
    "per_device_batch_size=1",
    "enable_checkpointing=true",
    "checkpoint_period=2",
    "log_period=1",
    "eval_interval=-1",
  )
  first = train(make_config(*common, "steps=4"), first_devices(1))
  # Step 4's checkpoint removed: the state of a run killed after writing step 4's row, before saving step 4.
  shutil.rmtree(tmp_path / "re" / "checkpoints" / "4")
  second = train(make_config(*common, "steps=6"), first_devices(1))
  assert [r["step"] for r in second] == [3, 4, 5, 6]  # resumed at 2
  rows = [json.loads(line) for line in storage.read_text(storage.join(out, "re", "metrics.jsonl")).splitlines()]
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert rows[:2] == first[:2] and rows[2:] == second  # the replayed steps' rows are the resumed run's


@pytest.mark.parametrize(
  "kind, flags, values, shown",
  [
    ("plain", {}, {"tokens": 4096.0}, "trained_tokens/step 4.1K"),
    ("sft", {"objective": "sft"}, {"tokens": 1234.0}, "trained_tokens/step 1.2K"),
    (
      "dpo",
      {"objective": "dpo"},
      {"tokens": 987.0, "pairs": 4.0, "rewards/accuracies": 0.5, "rewards/margins": 0.1},
      "trained_tokens/step 987",
    ),
    (
      "ensemble",
      {"ensemble_size": 2},
      {"tokens": 2.5e6, "loss/member_0": 2.0, "loss/member_1": 2.2},
      "trained_tokens/step 2.5M",
    ),
  ],
)
def test_step_line_shows_the_trained_tokens_of_every_kind_of_run(kind, flags, values, shown):
  """The console's step line carries the tokens the loss covered, as metrics.jsonl does, whatever the run trains."""
  from types import SimpleNamespace

  from MaxLite.training.metrics import log_line, metrics_row

  config = SimpleNamespace(
    global_batch_size_to_train_on=8,
    ensemble_size=1,
    max_target_length=512,
    z_loss_multiplier=0.0,
    objective="pretraining",
    peak_tflops_per_device=0.0,
  )
  vars(config).update(flags)
  row = metrics_row(config, 3, {"loss": 2.0, "grad_norm": 1.0, "learning_rate": 1e-3, **values}, 0.5, 1.0)
  assert row["trained_tokens"] == values["tokens"]
  assert f"| {shown} |" in log_line(row) + " |", log_line(row)


def test_a_training_run_logs_its_trained_tokens_progress_and_time_left_each_step(tmp_path, caplog):
  caplog.set_level(logging.INFO)
  config = make_config(*TINY, f"base_output_directory={tmp_path}", "per_device_batch_size=2", "steps=3")
  train(config, first_devices(1))
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
  assert len(lines) == 3 and all("| trained_tokens/step 128 |" in line for line in lines), lines  # 2 rows x 64 tokens
  # Where the run is and how long it has to go: the time left from the steps after the first (its compile), none at
  # the first step nor the last.
  assert [line.split(" | ")[0] for line in lines] == ["step      1/3", "step      2/3", "step      3/3"]
  assert [line.endswith("s left") for line in lines] == [False, True, False], lines

"""Config loading: inheritance, overlays, typed overrides, validation errors, derived values."""

import glob
import os
import re

import pytest
from support.config import BASE_YML, REPO, make_config, run_train_cli

from MaxLite.cli.errors import ConfigError
from MaxLite.config import available_models, load_config, load_raw
from MaxLite.config.choices import MESH_AXES


def test_every_shipped_model_config_loads():
  for name in available_models():
    config = make_config(f"model_name={name}", num_devices=8)
    assert config.model_name == name
    assert config.num_params > 0
  assert {"tiny", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "mistral-7b"} <= set(
    available_models()
  )


def test_known_parameter_counts():
  # Published sizes: Llama 2 7B has 6.74B parameters, Llama 3 8B 8.03B, Llama 2 70B 68.98B, Mixtral 46.70B.
  assert abs(make_config("model_name=llama2-7b").num_params / 1e9 - 6.738) < 0.01
  assert abs(make_config("model_name=llama3-8b").num_params / 1e9 - 8.030) < 0.01
  assert abs(make_config("model_name=llama2-70b").num_params / 1e9 - 68.977) < 0.01
  assert abs(make_config("model_name=mixtral-8x7b").num_params / 1e9 - 46.703) < 0.01  # Mixtral 8x7B: 46.70B


def test_overrides_are_typed_from_defaults():
  c = make_config(
    "steps=7",
    "learning_rate=1e-4",
    "scan_layers=false",
    "per_device_batch_size=2",
    "mlp_activations=[silu, linear]",
    "run_name=abc",
  )
  assert (c.steps, c.learning_rate, c.scan_layers, c.per_device_batch_size) == (7, 1e-4, False, 2.0)
  assert isinstance(c.learning_rate, float) and isinstance(c.steps, int)
  assert c.mlp_activations == ("silu", "linear")
  assert c.run_dir.endswith(os.path.join("outputs", "abc"))


def test_model_overlay_then_command_line_wins():
  c = make_config("model_name=tiny", "base_num_decoder_layers=3")
  assert c.base_emb_dim == 64 and c.base_num_decoder_layers == 3


def test_base_config_inheritance(tmp_path):
  parent = tmp_path / "parent.yml"
  parent.write_text(f"base_config: {BASE_YML}\nsteps: 11\nlearning_rate: 0.5\n")
  child = tmp_path / "child.yml"
  child.write_text("base_config: parent.yml\nsteps: 12\n")
  c = load_config([str(child)], num_devices=1, num_slices=1, process_count=1)
  assert (c.steps, c.learning_rate, c.warmup_steps_fraction) == (12, 0.5, 0.1)


def test_config_is_frozen():
  c = make_config()
  with pytest.raises(AttributeError):
    c.steps = 3
  assert isinstance(c.logical_axis_rules, tuple)


def test_mesh_fill_and_derived_values():
  c = make_config(
    "ici_fsdp_parallelism=-1",
    "ici_tensor_parallelism=2",
    "per_device_batch_size=1",
    "gradient_accumulation_steps=3",
    num_devices=8,
  )
  mesh = dict(zip(MESH_AXES, c.mesh_shape))
  assert mesh == {"ensemble": 1, "data": 1, "stage": 1, "fsdp": 4, "sequence": 1, "tensor": 2, "expert": 1}
  assert c.micro_batch_size == 8 and c.global_batch_size_to_train_on == 24
  assert c.batch_mesh_axes == ("data", "fsdp", "expert")


@pytest.mark.parametrize(
  "overrides, num_devices, fragment",
  [
    (["stepz=3"], 1, "unknown config key 'stepz'"),
    (["steps=abc"], 1, "config key 'steps' (from command line) expects int, got 'abc'"),
    (["scan_layers=maybe"], 1, "'scan_layers'"),
    (["ici_fsdp_parallelism=3"], 8, "ici_*_parallelism product is 3"),
    (["ici_fsdp_parallelism=-1", "ici_data_parallelism=-1"], 8, "at most one ici_*_parallelism may be -1"),
    (["per_device_batch_size=0.25"], 2, "not a whole number"),
    (["per_device_batch_size=0.5", "ici_fsdp_parallelism=8"], 8, "not divisible by the 8 batch shards"),
    (
      ["model_name=tiny", "ici_tensor_parallelism=4", "ici_fsdp_parallelism=2"],
      8,
      "base_num_kv_heads=2 is not divisible by tensor parallelism 4",
    ),
    (["base_num_query_heads=6", "base_num_kv_heads=4"], 1, "base_num_kv_heads=4 must divide base_num_query_heads=6"),
    (["remat_policy=sometimes"], 1, "remat_policy='sometimes' is not one of"),
    (["model_name=llama9"], 1, "unknown model_name 'llama9'"),
    (["dtype=float16"], 1, "dtype='float16' is not one of"),
    # a closed key's note on the values MaxText has and MaxLite has not
    (["quantization=int4"], 1, "is not one of: '', 'int8', 'fp8', 'fp8_full' (Qwix's quantized training; int4 and"),
    (["dataset_type=hf"], 1, "dataset_type='hf' is not one of: 'synthetic', 'grain' (MaxText's hf and tfds pipelines"),
    (["attention=cudnn_flash_te"], 1, "'cudnn_flash_jax' (MaxText's cudnn_flash_te (Transformer Engine), paged"),
    (["tokenizer_type=bpe"], 1, "tokenizer_type='bpe' is not one of: 'sentencepiece', 'huggingface', 'tiktoken'"),
    (
      ["max_target_length=30", "ici_sequence_parallelism=4", "ici_fsdp_parallelism=2"],
      8,
      "max_target_length=30 is not divisible by sequence parallelism 4",
    ),
    (["learning_rate=0"], 1, "learning_rate must be in (0, inf), got 0.0"),
    (["learning_rate=-3e-4"], 1, "learning_rate must be in (0, inf), got -0.0003"),
    (["learning_rate=nan"], 1, "learning_rate must be in (0, inf), got nan"),
    (["learning_rate=inf"], 1, "learning_rate must be in (0, inf), got inf"),
    (["adam_b1=1.0"], 1, "adam_b1 must be in [0, 1), got 1.0"),
    (["adam_b2=-0.5"], 1, "adam_b2 must be in [0, 1), got -0.5"),
    (["adam_eps=0"], 1, "adam_eps must be in (0, inf), got 0.0"),
    (["adam_weight_decay=-0.1"], 1, "adam_weight_decay must be in [0, inf), got -0.1"),
    (["gradient_clipping_threshold=-1"], 1, "gradient_clipping_threshold must be in [0, inf), got -1.0"),
    (["warmup_steps_fraction=1.5"], 1, "warmup_steps_fraction must be in [0, 1), got 1.5"),
    (["warmup_steps_fraction=-0.1"], 1, "warmup_steps_fraction must be in [0, 1), got -0.1"),
    (["learning_rate_final_fraction=2"], 1, "learning_rate_final_fraction must be in [0, 1], got 2.0"),
    (["z_loss_multiplier=-1e-4"], 1, "z_loss_multiplier must be in [0, inf), got -0.0001"),
    (["load_balance_loss_weight=-1"], 1, "load_balance_loss_weight must be in [0, inf), got -1.0"),
    (["steps=0"], 1, "steps must be positive, got 0"),
    (["per_device_batch_size=-2"], 1, "per_device_batch_size must be in (0, inf), got -2.0"),
    (["head_dim=0"], 1, "head_dim must be positive, got 0"),
    (["dropout_rate=1"], 1, "dropout_rate must be in [0, 1), got 1.0"),
    (["learning_rate_schedule_steps=0"], 1, "learning_rate_schedule_steps must be positive, or -1 for steps, got 0"),
    # each group's own checks (its model validator)
    (["eval_interval=5", "eval_steps=0"], 1, "eval_interval (5) and eval_steps (0) must be positive"),
    (["head_dim=7"], 1, "head_dim=7 must be even (RoPE rotates pairs of features)"),
    (["fused_qkv=true", "base_num_kv_heads=2"], 1, "fused_qkv=true needs base_num_kv_heads == base_num_query_heads"),
    (["base_moe_mlp_dim=0"], 1, "base_moe_mlp_dim=0 must be positive or -1 (= base_mlp_dim)"),
    (["rope_type=yarn", "rope_factor=0.5"], 1, "rope_type=yarn needs rope_factor >= 1"),
    (["rope_type=llama3.1", "rope_low_freq_factor=8"], 1, "needs 0 < rope_low_freq_factor < rope_high_freq_factor"),
    (["rope_type=yarn", "beta_slow=64"], 1, "rope_type=yarn needs 0 < beta_slow < beta_fast, got 64.0 and 32.0"),
    (["rope_type=yarn", "rope_attention_factor=0"], 1, "rope_attention_factor=0.0 must be > 0"),
    (["plan_quantizations=[int4]"], 1, "plan_quantizations: 'int4' is not one of: '', 'int8'"),
    (["enable_emergency_checkpoint=true"], 1, "needs local_checkpoint_directory, a directory on each host's"),
    (
      ["enable_emergency_checkpoint=true", "local_checkpoint_directory=/tmp/l", "local_checkpoint_period=0"],
      1,
      "needs local_checkpoint_period > 0 (got 0)",
    ),
    (
      ["enable_emergency_checkpoint=true", "local_checkpoint_directory=gs://bucket/l", "local_checkpoint_period=5"],
      1,
      "a directory on each host's own disk (got 'gs://bucket/l')",
    ),
    (
      ["enable_emergency_checkpoint=true", "local_checkpoint_directory=/tmp/l", "local_checkpoint_period=5"],
      2,
      "needs at least 2 data-parallel replicas on the data axis",
    ),
    (
      ["enable_emergency_checkpoint=true", "enable_checkpointing=false", "local_checkpoint_directory=/tmp/l"],
      1,
      "enable_emergency_checkpoint=true needs enable_checkpointing=true",
    ),
  ],
)
def test_bad_input_is_one_clear_error(overrides, num_devices, fragment):
  with pytest.raises(ConfigError) as e:
    make_config(*overrides, num_devices=num_devices)
  assert fragment in str(e.value)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize(
  "args, fragment",
  [
    (["stepz=3"], "unknown config key 'stepz'"),
    (["steps=abc"], "expects int"),
    (["ici_fsdp_parallelism=3"], "ici_*_parallelism product is 3 (ici_fsdp_parallelism=3) but there are 1 devices"),
    (["per_device_batch_size=0.5"], "not a whole number"),
    (["base_num_query_heads=6", "base_num_kv_heads=4"], "must divide base_num_query_heads=6"),
    (["remat_policy=sometimes"], "remat_policy"),
    (["model_name=nope"], "unknown model_name 'nope'"),
  ],
)
def test_cli_bad_input_exits_with_one_line(args, fragment):
  proc = run_train_cli(*args, timeout=120)
  assert proc.returncode == 2, proc.stderr
  assert "Traceback" not in proc.stderr
  error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(error_lines) == 1 and fragment in error_lines[0], proc.stderr


def test_missing_config_file_is_clear(tmp_path):
  with pytest.raises(ConfigError, match="config file not found"):
    load_config([str(tmp_path / "nope.yml")], num_devices=1, num_slices=1, process_count=1)


def test_remote_output_url_stays_a_url():
  config = make_config("base_output_directory=gs://bucket/runs", "run_name=r")
  assert (config.run_dir, config.checkpoint_dir) == ("gs://bucket/runs/r", "gs://bucket/runs/r/checkpoints")
  assert config.metrics_file == "gs://bucket/runs/r/metrics.jsonl" and not os.path.exists("gs:")


def test_old_maxlite_key_names_map_to_maxtext_names_with_a_warning(capsys, tmp_path):
  yml = tmp_path / "old.yml"
  yml.write_text(f"base_config: {BASE_YML}\nmax_checkpoints_to_keep: 5\nprint_sharding: true\n")
  config = load_config(
    [str(yml), "decode_sampling=top_k", "max_prefill_length=16", "cosine_learning_rate_final_fraction=0.2"],
    num_devices=1,
    num_slices=1,
    process_count=1,
  )
  assert config.max_num_checkpoints_to_keep == 5 and config.debug_sharding is True
  assert config.decode_sampling_strategy == "topk" and config.max_prefill_predict_length == 16
  assert config.learning_rate_final_fraction == 0.2
  warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
  assert len(warnings) == 6, warnings
  assert any("'print_sharding'" in w and "'debug_sharding'" in w for w in warnings)
  assert any("decode_sampling_strategy='top_k'" in w and "'topk'" in w for w in warnings)
  for old in ("max_checkpoints_to_keep", "decode_sampling", "print_sharding"):
    assert old not in config


@pytest.mark.parametrize("key", ["enable_goodput_recording=false", "mtp_num_layers=1", "mesh_axes=[data]"])
def test_maxtext_only_keys_name_themselves_as_unimplemented(key):
  with pytest.raises(ConfigError, match=r"is a MaxText key that MaxLite does not implement") as e:
    make_config(key)
  assert repr(key.split("=")[0]) in str(e.value)
  # A key neither MaxLite nor MaxText has is still an unknown key, with a suggestion.
  with pytest.raises(
    ConfigError, match=r"unknown config key 'ici_fsdp_paralelism'.*did you mean 'ici_fsdp_parallelism'"
  ):
    make_config("ici_fsdp_paralelism=2")


@pytest.mark.slow
def test_maxtext_style_command_trains_with_maxtext_key_names(tmp_path):
  """MaxText's names for checkpoint retention and sharding printout act, not just parse."""
  args = [
    "dataset_type=synthetic",
    "model_name=tiny",
    "steps=3",
    "max_target_length=32",
    "enable_checkpointing=true",
    "checkpoint_period=1",
    "max_num_checkpoints_to_keep=1",
    "debug_sharding=true",
    "async_checkpointing=false",
    "learning_rate_final_fraction=0.5",
    "dense_init_scale=0.5",
    "decode_sampling_strategy=weighted",
    "enable_tensorboard=false",
    "jax_cache_dir=",
    f"base_output_directory={tmp_path}",
    "run_name=mt",
  ]
  proc = run_train_cli(*args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "warning:" not in proc.stderr
  assert sorted(os.listdir(tmp_path / "mt" / "checkpoints")) == ["3"]
  assert "MiB per device" in proc.stdout  # the debug_sharding report


@pytest.mark.parametrize("recipe", sorted(glob.glob(os.path.join(REPO, "configs", "tpu", "*", "*.yml"))))
def test_shipped_maxtext_recipes_load_for_their_slice(recipe):
  from MaxLite.parallel import topologies

  raw = load_raw([recipe])
  target = topologies.parse(raw["compile_topology"])
  config = load_config([recipe], num_devices=target.num_devices, num_slices=1, process_count=1)
  assert config.model_name.startswith("maxtext-") and config.max_target_length == 2048
  with open(recipe) as f:
    assert re.search(r"^# published_mfu: \d+\.\d+$", f.read(), re.M)


@pytest.mark.parametrize(
  "overrides, message",
  [
    # seeds: JAX keeps 32 bits of a seed (2**32 is seed 0 again, 2**63 overflows) and numpy refuses a negative one
    (["seed=1e30"], "seed must be in [0, 2**32), got 1e30"),
    (["seed=4294967296"], "seed must be in [0, 2**32), got 4294967296"),
    (["init_weights_seed=-1"], "init_weights_seed must be in [0, 2**32), got -1"),
    (["data_shuffle_seed=-1"], "data_shuffle_seed must be in [0, 2**32), got -1"),
    # numbers are decimal: YAML 1.1 and Python read these forms differently
    (
      ["steps=0x10"],
      "config key 'steps' (from command line) takes a decimal number (e.g. 16, -3, 2.5, 1e-4), got '0x10'",
    ),
    (["steps=010"], "got '010': a leading 0 (octal in YAML 1.1) is not read"),
    (["steps=0o10"], "got '0o10': octal is not read"),
    (["steps=0b10"], "got '0b10': binary is not read"),
    (["eval_interval=12:30"], "got '12:30': base 60 (YAML 1.1's h:m:s) is not read"),
    # an rl. spelling sets only an RL key
    (
      ["rl.steps=5"],
      "rl.steps=5 (from command line) is not an RL key: the rl group holds only its own (--describe Grpo)",
    ),
    (["rl.learning_rate=0.1"], "learning_rate is a top-level key: write learning_rate=0.1"),
    # finite, positive where the math needs it
    (["normalization_layer_epsilon=nan"], "normalization_layer_epsilon must be in (0, inf), got nan"),
    (["normalization_layer_epsilon=-1"], "normalization_layer_epsilon must be in (0, inf), got -1.0"),
    (["normalization_layer_epsilon=0"], "normalization_layer_epsilon must be in (0, inf), got 0.0"),
    (["rope_max_timescale=nan"], "rope_max_timescale must be in (0, inf), got nan"),
    (["rope_max_timescale=inf"], "rope_max_timescale must be in (0, inf), got inf"),
    (["dense_init_scale=nan"], "dense_init_scale must be in [0, inf), got nan"),
    (["dense_init_scale=-0.5"], "dense_init_scale must be in [0, inf), got -0.5"),
    # NaN means nothing for any key, bounds or not
    (["mscale=nan"], "mscale must be a number, got nan"),
    (["capacity_factor=nan"], "capacity_factor must be a number, got nan"),
    # null is not the text "null": a string key whose unset value is "" takes it as that, others refuse it
    (["tokenizer_path=null"], "config key 'tokenizer_path' (from command line) is a string and got null"),
  ],
)
def test_a_value_a_key_cannot_take_is_one_line(overrides, message):
  with pytest.raises(ConfigError) as e:
    make_config(*overrides)
  assert message in str(e.value) and "\n" not in str(e.value)


def test_string_keys_keep_the_text_as_written(tmp_path):
  """YAML 1.1 reads 2024_01_15 as 20240115, 12:30 as 750, 010 as 8, 0x1F as 31 and 3.10 as 3.1: a string key takes
  the text, from a file and from the command line alike."""
  yml = tmp_path / "c.yml"
  yml.write_text(
    f"base_config: {BASE_YML}\nrun_name: 2024_01_15\nbase_output_directory: 12:30\nchat_template_path: 010\n"
    "tokenizer_path: 0x1F\nprompt: 3.10\ncoordinator_address: yes\ntrain_data_columns: [010, 3.10]\n"
  )
  raw = load_raw([str(yml)])
  got = {k: raw[k] for k in ("run_name", "base_output_directory", "chat_template_path", "tokenizer_path", "prompt")}
  assert got == {
    "run_name": "2024_01_15",
    "base_output_directory": "12:30",
    "chat_template_path": "010",
    "tokenizer_path": "0x1F",
    "prompt": "3.10",
  }
  assert raw["coordinator_address"] == "yes" and raw["train_data_columns"] == ["010", "3.10"]
  raw = load_raw([BASE_YML, "run_name=2024_01_15", "tokenizer_path=0x1F", "prompt=3.10", "train_data_columns=[010]"])
  assert (raw["run_name"], raw["tokenizer_path"], raw["prompt"], raw["train_data_columns"]) == (
    "2024_01_15",
    "0x1F",
    "3.10",
    ["010"],
  )


def test_number_keys_in_a_yaml_file_take_decimal_numbers(tmp_path):
  yml = tmp_path / "c.yml"
  yml.write_text(f"base_config: {BASE_YML}\nsteps: 1_000\nlearning_rate: 3e-4\nadam_eps: 1E-7\nseed: '12'\n")
  raw = load_raw([str(yml)])
  assert (raw["steps"], raw["learning_rate"], raw["adam_eps"], raw["seed"]) == (1000, 3e-4, 1e-7, 12)
  assert {"steps", "learning_rate", "adam_eps", "seed"} <= set(raw["explicit_keys"])
  yml.write_text(f"base_config: {BASE_YML}\nsteps: 200\n")  # base.yml's own value: not set explicitly
  assert "steps" not in load_raw([str(yml)])["explicit_keys"]
  for body, message in [
    ("steps: 0x10", f"config key 'steps' (from {yml}) takes a decimal number (e.g. 16, -3, 2.5, 1e-4), got '0x10'"),
    ("steps: 010", "got '010': a leading 0 (octal in YAML 1.1) is not read"),
    ("eval_interval: 1:30", "got '1:30': base 60 (YAML 1.1's h:m:s) is not read"),
    ("seed: 1e30", "seed must be in [0, 2**32), got 1e30"),
    ("normalization_layer_epsilon: .nan", "normalization_layer_epsilon must be in (0, inf), got nan"),
    ("rl: {steps: 7}", f"rl.steps=7 (from {yml}) is not an RL key"),
    ("rl:\n  learning_rate: 0.1", "learning_rate is a top-level key: write learning_rate=0.1"),
  ]:
    yml.write_text(f"base_config: {BASE_YML}\n{body}\n")
    with pytest.raises(ConfigError) as e:
      load_config([str(yml)], num_devices=1, num_slices=1, process_count=1)
    assert message in str(e.value) and "\n" not in str(e.value), body


def test_null_is_a_keys_unset_value_never_the_text_null(tmp_path):
  """run_name's unset value is "" (a maxlite_<timestamp> name); quoted, "null" is the text."""
  assert make_config("run_name=null").run_name.startswith("maxlite_")
  assert make_config("run_name=~").run_name.startswith("maxlite_")
  yml = tmp_path / "c.yml"
  yml.write_text(f"base_config: {BASE_YML}\nrun_name: null\n")
  assert load_raw([str(yml)])["run_name"] == ""
  yml.write_text(f"base_config: {BASE_YML}\nrun_name: 'null'\n")
  assert load_raw([str(yml)])["run_name"] == "null"


def test_a_bad_seed_on_the_command_line_is_one_line_and_writes_nothing(tmp_path):
  """seed=1e30 went through to jax.random.key: an OverflowError traceback after the run directory was made."""
  proc = run_train_cli("seed=1e30", f"base_output_directory={tmp_path}", "run_name=r", timeout=120)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert errors == ["error: seed must be in [0, 2**32), got 1e30"], proc.stderr
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("key", ["attention_sink=true", "mlp_bias=true", "mlp_activations_limit=7.0"])
def test_a_family_s_own_key_under_another_family_is_one_line(key):
  """GPT-OSS's keys (models/gpt_oss_keys.py) were taken and silently not computed by llama2 or gemma3."""
  name = key.split("=")[0]
  for family in ("llama2", "gemma3"):
    with pytest.raises(ConfigError, match=rf"^{name}=\S+ is a key of decoder_block=gpt_oss; decoder_block={family} "):
      make_config(f"decoder_block={family}", key)

"""AOT compilation of the real train step for cpu-N and TPU topologies (libtpu, no TPU), fit verdicts."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from support.config import BASE_YML, REPO

from MaxLite.aot import compile_step
from MaxLite.cli.errors import ConfigError
from MaxLite.parallel import topologies

SCRIPT = os.path.join(REPO, "MaxLite", "train_compile.py")
HAVE_LIBTPU = topologies.find_libtpu(REPO) is not None
needs_libtpu = pytest.mark.skipif(
  not HAVE_LIBTPU, reason="libtpu not installed (bash setup.sh puts it in .deps/libtpu)"
)


# 64-token rows: the TPU compiler takes about half as long as for the tiny model's 256, and what these tests check
# (placement, flags, the report) does not depend on the length.
TINY_TPU = ("model_name=tiny", "max_target_length=64")


def _compile(*overrides, env=None):
  env = dict(os.environ if env is None else env)
  env.pop("XLA_FLAGS", None)  # train_compile sets the device count itself
  return subprocess.run(
    [sys.executable, SCRIPT, BASE_YML, "jax_cache_dir=", *overrides],
    capture_output=True,
    text=True,
    timeout=600,
    env=env,
  )


def _value(text, label):
  return float(re.search(rf"{label}\s+([\d.]+) (MiB|GiB)", text).group(1))


@pytest.fixture(scope="module")
def tiny_on_cpu_8(tmp_path_factory):
  """One compile of the tiny model for cpu-8, the executable saved: (the process, the executable's path), read by the
  two tests below."""
  out = tmp_path_factory.mktemp("cpu_8") / "step.bin"
  proc = _compile("model_name=tiny", "compile_topology=cpu-8", f"compiled_trainstep_file={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc, out


@pytest.mark.slow
def test_tiny_on_cpu_8_reports_memory_flops_and_saves_the_executable(tiny_on_cpu_8):
  proc, out = tiny_on_cpu_8
  text = proc.stdout
  assert "compiled train step for cpu-8 x 1 slice(s) (8 devices, mesh fsdp=8)" in text
  # 1.15M float32 params over 8 devices = 0.55 MiB each; Adam keeps two moments of the same size.
  assert _value(text, "params") == pytest.approx(1151616 * 4 / 8 / 2**20, abs=0.06)
  assert _value(text, "optimizer state") == pytest.approx(2 * _value(text, "params"), abs=0.11)
  # tiny scans its layers: XLA's count (one layer's) is left out, the model's is printed
  assert "FLOPs per device per step: model " in text and "HBM" not in text
  assert "XLA's compiled count is left out" in text and "compiled 0." not in text
  # The total is the compiler's own allocation, read from this compile's dump, and the lines add up to it.
  assert "of device memory (the compiler's buffer assignment)" in text
  parts = _value(text, "arguments") + _value(text, "outputs") - _aliased(text) + _value(text, "temporaries")
  assert _value(text, "total needed") == pytest.approx(parts, abs=0.2)
  assert out.stat().st_size > 10_000
  assert "live at the memory peak, per device" in text  # (what it says: the next test)


def test_compiled_flops_are_printed_only_for_a_program_without_loops():
  """XLA's cost_analysis() counts a while loop's body once: a scan over 8 layers costs one layer. The report printed
  that figure beside the model's (0.2371 s against 15.29 s of roofline time on v5p); now only where no loop runs."""
  import jax
  import jax.numpy as jnp

  x, w = jnp.ones((64, 64)), jnp.ones((8, 64, 64))

  def scanned(x):
    return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

  def unrolled(x):
    for i in range(8):
      x = jnp.tanh(x @ w[i])
    return x

  def counted(fn):
    compiled = jax.jit(fn).lower(x).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"]), len(compile_step._WHILE.findall(compiled.as_text()))

  (scan_flops, scan_loops), (flat_flops, flat_loops) = counted(scanned), counted(unrolled)
  work = 8 * 2 * 64**3
  assert flat_loops == 0 and flat_flops >= work and scan_loops == 1 and scan_flops < work / 4
  line = compile_step.flops_line(scan_flops, work, scan_loops, scan_layers=True)
  assert line.startswith("FLOPs per device per step: model 0.00 GFLOP (XLA's compiled count is left out")
  assert not re.search(r"compiled \d", line) and "runs 1 loop, the scanned layers among them" in line
  line = compile_step.flops_line(flat_flops, work, flat_loops, scan_layers=False)
  assert line.startswith(f"FLOPs per device per step: compiled {flat_flops / 1e9:.2f} GFLOP, model 0.00 GFLOP")


@pytest.mark.slow
def test_tiny_on_cpu_8_names_each_buffer_at_the_peak_with_its_role_and_size(tiny_on_cpu_8):
  """The weights and the optimizer state live at the peak are named as such, at the bytes one device holds of them
  (the parameters' and Adam moments' shards on fsdp=8, counted here from the shardings), one buffer per line."""
  import jax
  from flax.linen import partitioning as nn_partitioning
  from support.config import first_devices, make_config

  from MaxLite.aot.buffer_report import size_text
  from MaxLite.models.transformer import Transformer
  from MaxLite.parallel import sharding
  from MaxLite.parallel.mesh import create_mesh
  from MaxLite.training.optimizer import create_optimizer
  from MaxLite.training.train_state import abstract_state

  proc, _ = tiny_on_cpu_8
  config = make_config("model_name=tiny", num_devices=8)
  mesh = create_mesh(config, first_devices(8))
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(sharding.axis_rules(config)):
    abstract, _, shardings = abstract_state(Transformer(config), create_optimizer(config), config, mesh)
  params = sharding.sharded_bytes(abstract.params, shardings.params)
  optimizer = sharding.sharded_bytes(abstract.opt_state, shardings.opt_state)
  section = proc.stdout.split("live at the memory peak, per device: ")[1].split("FLOPs per device")[0]
  roles = {
    m.group(1): (m.group(2), int(m.group(3)))
    for m in re.finditer(r"^  (\S.*?)\s+([\d.]+ (?:B|KiB|MiB|GiB))  \((\d+) buffers?\)$", section, re.M)
  }
  assert roles["weights"] == (size_text(params), len(jax.tree.leaves(abstract.params))), section  # 561.2 KiB
  assert roles["optimizer state"][0] == size_text(optimizer), section  # 1.10 MiB: Adam's two moments and counts
  assert list(roles)[0] == "logits"  # [tokens, vocab] in float32: the peak's bulk
  # One buffer a line: size, role, its shape on one device, which parameter (or op) it is.
  rows = section.split("the 10 largest")[1].splitlines()[1:]
  found = [re.match(r"^\s+([\d.]+ (?:B|KiB|MiB|GiB))  (.+?)\s+(\w+\[[\d,]*\]): (.+)$", r) for r in rows if r.strip()]
  assert len(found) == 10 and all(found), rows
  assert ("256.0 KiB", "optimizer state", "f32[8,8192]", "mu of logits_dense/kernel") in [f.groups() for f in found]


def _aliased(text):
  return float(re.search(r"donated: ([\d.]+) (MiB|GiB) reused", text).group(1))


def test_allocated_bytes_sums_the_default_memory_spaces_allocations(tmp_path):
  """Lines as libtpu writes them (llama2-7b on v5p-8): parameters, a fresh output, the temporaries block, and
  on-chip / host allocations (colors), which are not device HBM."""
  from MaxLite.aot.buffer_report import allocated_bytes

  (tmp_path / "m.after_optimizations-buffer-assignment.txt").write_text(
    "allocation 0: size 512, thread-local:\n"
    " value: <1 x @0> (size=512,offset=0): f32[128]\n"
    "allocation 1: size 1442840576, parameter 26, shape |f32[32,1024,11008]| at ShapeIndex {}, maybe-live-out:\n"
    "allocation 3: size 1442840576, maybe-live-out:\n"
    "allocation 231: size 7940817024, preallocated-temp:\n"
    "allocation 232: size 76, color 2, preallocated-temp:\n"
    "allocation 235: size 47857664, color 1, preallocated-temp:\n"
  )
  assert allocated_bytes(str(tmp_path)) == 512 + 2 * 1442840576 + 7940817024
  assert allocated_bytes(str(tmp_path / "missing")) is None


def _host_mib(report):
  """(arguments, temporaries) in host memory, MiB, from train_compile's report."""
  found = re.search(r"\(arguments ([\d.]+) (MiB|GiB), temporaries ([\d.]+) (MiB|GiB): host-offloaded", report)
  mib = lambda value, unit: float(value) * (1024 if unit == "GiB" else 1)
  return mib(*found.group(1, 2)), mib(*found.group(3, 4))


@pytest.mark.slow
@needs_libtpu
def test_offload_options_move_activations_and_state_to_host_memory_on_tpu():
  """All three offloads in one compile (a compile without them, test_tiny_on_v5p_8_fits, has nothing on the host)."""
  proc = _compile(
    *TINY_TPU,
    "compile_topology=v5p-8",
    "remat_policy=minimal_offloaded",
    "parameter_memory_host_offload=true",
    "optimizer_memory_host_offload=true",
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  arguments, temporaries = _host_mib(proc.stdout)
  # (On llama2-7b minimal_offloaded takes the device from 81.9 to 42.0 GiB; the tiny model's activations are too
  # small for the copies' staging buffers to pay off, so only the move itself is checked here.)
  assert temporaries > 0  # saved activations: host temporaries
  # Params (0.27 MiB per device) and AdamW's two moments arrive as host-memory arguments (TPU tiling pads them).
  assert arguments >= 3 * 1151616 * 4 / 4 / 2**20


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize(
  "slices, mesh, users_flags",
  [(1, "mesh fsdp=4", None), (2, "mesh data=2 x fsdp=4", "--xla_enable_async_all_gather=false")],
  ids=["1_slice", "2_slices_users_libtpu_init_args"],
)
def test_tiny_on_v5p_8_fits(slices, mesh, users_flags):
  """MaxLite's v5p flags, or the user's own LIBTPU_INIT_ARGS, which win; the report names the ones used."""
  env = dict(os.environ, **({"LIBTPU_INIT_ARGS": users_flags} if users_flags else {}))
  proc = _compile(*TINY_TPU, "compile_topology=v5p-8", f"compile_topology_num_slices={slices}", env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"compiled train step for v5p-8 x {slices} slice(s) ({4 * slices} devices, {mesh})" in proc.stdout
  assert "HBM per device: 95.74 GiB -> fits" in proc.stdout
  # libtpu's memory_analysis() counts more temporaries than its buffer assignment allocates (tiny: 15.7 vs 12.5
  # MiB), so the sum MaxText prints is above what the chip holds; the report's total is the allocation.
  allocated = re.search(
    r"total needed\s+([\d.]+) MiB of device memory \(the compiler's buffer assignment\)", proc.stdout
  )
  summed = re.search(r"memory_analysis\(\) sum ([\d.]+) MiB", proc.stdout)
  assert allocated and summed and float(allocated.group(1)) < float(summed.group(1)), proc.stdout
  assert _host_mib(proc.stdout) == (0, 0)  # no offload asked for
  assert "roofline step time at the v5p bf16 peak (459 TFLOP/s)" in proc.stdout
  assert "s for model FLOPs -> at most" in proc.stdout and "for compiled FLOPs" not in proc.stdout  # scanned layers
  if users_flags:
    assert f"XLA flags (LIBTPU_INIT_ARGS from the environment): {users_flags}" in proc.stdout
  else:
    flags = " ".join(topologies.LIBTPU_FLAGS["v5p"])
    assert f"XLA flags (MaxLite's v5p defaults (topologies.LIBTPU_FLAGS)): {flags}" in proc.stdout


def test_v5p_defaults_do_not_fuse_all_gathers_which_newer_libtpu_refuses_on_v5p():
  # jax 0.11's libtpu fails every v5p compile that fuses all-gathers into the async collective fusion (it allows that
  # only on v5e); the tiny v5p-8 compile above runs under jax 0.10's libtpu here, which accepts it, so it cannot tell.
  v5p = topologies.LIBTPU_FLAGS["v5p"]
  assert "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false" in v5p
  assert not any(flag.endswith("fuse_all_gather=true") for flag in v5p)
  assert "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true" in topologies.LIBTPU_FLAGS["v5e"]


def test_libtpu_flags_are_set_only_on_a_tpu_host_and_by_its_chip():
  assert topologies.set_libtpu_flags({"TPU_ACCELERATOR_TYPE": "v5p-128"}, tpu_present=False) is None
  env = {"TPU_ACCELERATOR_TYPE": "v5litepod-256"}
  assert "v5e defaults" in topologies.set_libtpu_flags(env, tpu_present=True)
  assert env["LIBTPU_INIT_ARGS"] == " ".join(topologies.LIBTPU_FLAGS["v5e"])
  own = {"TPU_ACCELERATOR_TYPE": "v5p-8", "LIBTPU_INIT_ARGS": "--mine=1"}
  topologies.set_libtpu_flags(own, tpu_present=True)
  assert own["LIBTPU_INIT_ARGS"] == "--mine=1"
  unknown = {}
  assert "unknown" in topologies.set_libtpu_flags(unknown, tpu_present=True) and "LIBTPU_INIT_ARGS" not in unknown


@pytest.mark.slow
@needs_libtpu
def test_oversized_config_on_v5p_8_exits_non_zero_with_the_shortfall():
  # ~9B parameters replicated on every chip (data parallelism only): weights and Adam alone exceed 95 GiB.
  proc = _compile(
    "model_name=tiny",
    "base_emb_dim=16384",
    "base_mlp_dim=65536",
    "base_num_query_heads=128",
    "base_num_kv_heads=128",
    "head_dim=128",
    "ici_data_parallelism=4",
    "ici_fsdp_parallelism=1",
    "per_device_batch_size=1",
    "max_target_length=128",
    "compile_topology=v5p-8",
  )
  assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
  assert re.search(
    r"DOES NOT FIT: needs [\d.]+ GiB per device, [\d.]+ GiB available; short by [\d.]+ GiB", proc.stdout
  ), proc.stdout
  # the weights and Adam state are what does not fit, so the keys that split or move them are named
  assert "keys that would shrink it: more ici_fsdp_parallelism, parameter_memory_host_offload" in proc.stdout


def test_shrink_hints_name_the_keys_for_each_kind_of_large_buffer():
  """Buffers as train_compile names them for llama2-7b on v5e-16 (4 x 4096, remat full): one hint per kind, the
  largest kind first."""
  from MaxLite.aot.buffer_report import Buffer, shrink_hints

  saved = Buffer(4 << 30, "saved activations", "kept by the 32 scanned layers", "bf16[32,4,4096,4096]")
  logits = Buffer(2 << 30, "logits", "logits", "f32[4,4096,32000]")
  grads = Buffer(344 << 20, "gradients", "decoder/layers/mlp/wi_0/kernel", "f32[32,11008,256]")
  weights = Buffer(344 << 20, "weights", "decoder/layers/mlp/wi_1/kernel", "f32[32,11008,256]")
  scores = Buffer(1 << 30, "attention scores", "scores", "f32[4,8,4,4096,4096]")
  hints = shrink_hints([saved, logits, grads, weights, scores], attention="dot_product")
  assert [h.split(" ")[0] for h in hints] == ["remat_policy=full,", "num_vocab_tiling=N", "attention=splash", "more"]
  assert not any("attention" in h for h in shrink_hints([saved, scores], "splash"))  # splash never holds scores


def test_a_full_scalar_memory_names_the_splash_block_keys_not_remat():
  """libtpu's words when the splash kernel's block map outgrows SMEM (Llama 3.1 8B, 524,288 tokens, Ulysses over 8
  v5p chips): HBM keys would not help, larger blocks do."""
  error = (
    "RESOURCE_EXHAUSTED: Allocation (size=2097152) would exceed memory (size=1048576) :: #allocation3 [shape = "
    "'u8[2097152]{0}', space=smem, size = 0x200000, scoped, tag = 'prefetched SMEM operand 0'] :: "
    "splash_mha_fwd_segmented_residuals.3"
  )
  oom = compile_step.out_of_memory(error)
  assert oom.startswith("DOES NOT FIT: RESOURCE_EXHAUSTED: Allocation (size=2097152)")
  hint = compile_step.shrink_hint(oom, 1 << 30, 95 << 30)
  assert hint.startswith("larger splash blocks (sa_block_q / sa_block_kv") and "sa_block_kv_dq" in hint
  assert "remat" not in hint
  hbm = compile_step.out_of_memory("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm (691.23G) (95.74G)")
  assert compile_step.shrink_hint(hbm, 1 << 30, 95 << 30).startswith("remat_policy")
  assert compile_step.shrink_hint(hbm, 60 << 30, 95 << 30).startswith("more ici_fsdp_parallelism")


@pytest.mark.parametrize(
  "args, fragment",
  [
    (("compile_topology=v9-8",), "compile_topology='v9-8' is not one of v4-N, v5p-N, v5e-N, v6e-N"),
    (("compile_topology=v5p-7",), "v5p-N counts 2 cores per chip"),
    ((), "compile_topology is empty"),
  ],
)
def test_bad_topology_is_one_line(args, fragment):
  proc = _compile("model_name=tiny", *args)
  assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr
  assert "Traceback" not in proc.stderr


def test_missing_libtpu_says_how_to_get_it(tmp_path, monkeypatch):
  if importlib.util.find_spec("libtpu") is not None:
    pytest.skip("a libtpu package is importable here, so it would be found")
  monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
  with pytest.raises(ConfigError, match=r"compile_topology=v5p-8 needs libtpu .* run `bash setup.sh`"):
    compile_step.prepare_backend(topologies.parse("v5p-8"), repo=str(tmp_path))  # a root without .deps/


def test_slice_shapes_follow_cloud_tpu():
  shapes = {
    n: topologies.parse(n).topology_name
    for n in ("v4-8", "v5p-8", "v5p-16", "v5p-128", "v5p-256", "v5e-16", "v5e-32", "v6e-256")
  }
  assert shapes == {
    "v4-8": "v4:2x2x1",
    "v5p-8": "v5p:2x2x1",
    "v5p-16": "v5p:2x2x2",
    "v5p-128": "v5p:4x4x4",
    "v5p-256": "v5p:4x4x8",
    "v5e-16": "v5e:4x4",
    "v5e-32": "v5e:4x8",
    "v6e-256": "v6e:16x16",
  }
  assert topologies.parse("v5p-128").num_devices == 64 and topologies.parse("v5e-16").num_devices == 16

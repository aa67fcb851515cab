"""plan.py: the compiled-HLO cost reader, the performance model's order against measured steps, the search
(pins kept, plans that do not fit never ranked, the cache), and one-line errors for impossible requests."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.config import BASE_YML, FAST_COMPILE, REPO, first_devices, make_config

from MaxLite.models import flops
from MaxLite.parallel import topologies
from MaxLite.planning import candidates, hlo_costs, hlo_text, perf_model, planner, search

MESH_AXES = ("data", "stage", "fsdp", "sequence", "tensor", "expert")


def test_loop_trip_counts_multiply_the_matmul_flops_of_their_body():
  """A scan of 6 matmuls: the reader counts 6, where XLA's own cost analysis counts the loop body once."""

  def f(x, w):
    return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=6)[0]

  x, w = jnp.ones((32, 64)), jnp.ones((64, 64))
  text = jax.jit(f).lower(x, w).compile().as_text()
  ops = hlo_costs.device_ops(text, ("data",), (1,))
  assert hlo_costs.summary(ops)["flops"] == 6 * 2 * 32 * 64 * 64


def test_collectives_name_the_mesh_axes_they_run_over():
  devices = np.asarray(first_devices(8)).reshape(1, 1, 2, 1, 4, 1)
  mesh = jax.sharding.Mesh(devices, MESH_AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 6)
  spec = jax.sharding.PartitionSpec

  def f(x):  # a sum over tensor, then an all-gather over fsdp
    y = jax.lax.psum(x, "tensor")
    return jax.lax.all_gather(y, "fsdp", tiled=True)

  g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec("fsdp", "tensor"), out_specs=spec(), check_vma=False))
  x = jax.device_put(jnp.ones((256, 512), jnp.float32), jax.sharding.NamedSharding(mesh, spec("fsdp", "tensor")))
  ops = hlo_costs.device_ops(g.lower(x).compile().as_text(), MESH_AXES, (1, 1, 2, 1, 4, 1))
  found = {(o.collective, o.axes, o.group_size) for o in ops if o.collective}
  assert ("all-reduce", ("tensor",), 4) in found and ("all-gather", ("fsdp",), 2) in found
  local = 128 * 128 * 4  # each device's [128, 128] float32 block
  reduce = next(o for o in ops if o.collective == "all-reduce")
  gather = next(o for o in ops if o.collective == "all-gather")
  assert reduce.moved_bytes == 2 * local * 3 / 4 and gather.moved_bytes == 2 * local / 2


def test_replica_group_spellings_agree():
  """XLA writes the same groups as iota lists, explicit lists or named meshes with a device order."""
  shape = (1, 1, 4, 1, 2, 1)
  spellings = [
    "replica_groups=[4,2]<=[8]",
    "replica_groups={{0,1},{2,3},{4,5},{6,7}}",
    "replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}",
    "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}",
  ]
  for attrs in spellings:
    assert hlo_costs._group_axes(attrs, MESH_AXES, shape) == (("tensor",), 2, ""), attrs  # pylint: disable=protected-access
  transposed = "replica_groups=[2,4]<=[4,2]T(1,0)"
  assert hlo_costs._group_axes(transposed, MESH_AXES, shape) == (("fsdp",), 4, "")  # pylint: disable=protected-access


def test_empty_or_unreadable_replica_groups_are_never_free():
  """`replica_groups={}` on a cross-partition collective is every device (XLA's meaning); a spelling the reader
  does not know is costed as every device too, and says so, instead of as a group of one that moves nothing."""
  shape = (1, 1, 4, 1, 2, 1)
  everyone = (("fsdp", "tensor"), 8)
  empty = hlo_costs._group_axes("channel_id=3, replica_groups={}, use_global_device_ids=true", MESH_AXES, shape)
  assert empty == (*everyone, "")
  axes, size, assumed = hlo_costs._group_axes("replica_groups=<a future spelling>", MESH_AXES, shape)
  assert (axes, size) == everyone and "unreadable" in assumed
  line = (
    "  %ar = f32[1024]{0} all-reduce(f32[1024]{0} %p), channel_id=1, replica_groups=<a future spelling>, to_apply=%add"
  )
  text = "\n".join(
    ["%add (a: f32[], b: f32[]) -> f32[] {", "  %a = f32[] parameter(0)", "  %b = f32[] parameter(1)",
     "  ROOT %s = f32[] add(f32[] %a, f32[] %b)", "}", "ENTRY %main (p: f32[1024]) -> f32[1024] {",
     "  %p = f32[1024]{0} parameter(0)", line, "}"]
  )  # fmt: skip
  ops = hlo_costs.device_ops(text, MESH_AXES, shape)
  reduce = next(o for o in ops if o.collective == "all-reduce")
  assert reduce.moved_bytes == 2 * 4096 * 7 / 8 and reduce.group_size == 8
  assert hlo_costs.assumptions(ops) == [f"all-reduce ar: {assumed}"]


def test_a_loop_whose_trip_count_cannot_be_read_counts_as_the_longest_loop_read():
  """Loops around the same matmul: one with XLA's known trip count (5), one bounded by a value the reader cannot see,
  one XLA knows never runs. The unread one counts 5 trips, not 1, and the ops say so; the empty one counts none."""

  def body(name: str) -> list[str]:
    return [
      f"%{name}_body (t: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {{",
      "  %t = (s32[], f32[8,8]{1,0}) parameter(0)",
      "  %i = s32[] get-tuple-element((s32[], f32[8,8]{1,0}) %t), index=0",
      "  %x = f32[8,8]{1,0} get-tuple-element((s32[], f32[8,8]{1,0}) %t), index=1",
      "  %y = f32[8,8]{1,0} dot(f32[8,8]{1,0} %x, f32[8,8]{1,0} %x), lhs_contracting_dims={1}, "
      "rhs_contracting_dims={0}",
      "  ROOT %r = (s32[], f32[8,8]{1,0}) tuple(s32[] %i, f32[8,8]{1,0} %y)",
      "}",
    ]

  text = "\n".join(
    body("known")
    + body("unknown")
    + body("never")
    + [
      "%cond (c: (s32[], f32[8,8])) -> pred[] {",
      "  %c = (s32[], f32[8,8]{1,0}) parameter(0)",
      "  %k = s32[] get-tuple-element((s32[], f32[8,8]{1,0}) %c), index=0",
      '  %n = s32[] custom-call(), custom_call_target="limit"',
      "  ROOT %lt = pred[] compare(s32[] %k, s32[] %n), direction=LT",
      "}",
      "ENTRY %main (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {",
      "  %p = (s32[], f32[8,8]{1,0}) parameter(0)",
      "  %w1 = (s32[], f32[8,8]{1,0}) while((s32[], f32[8,8]{1,0}) %p), condition=%cond, body=%known_body, "
      'backend_config={"known_trip_count":{"n":"5"}}',
      "  %w2 = (s32[], f32[8,8]{1,0}) while((s32[], f32[8,8]{1,0}) %w1), condition=%cond, body=%unknown_body",
      "  ROOT %w0 = (s32[], f32[8,8]{1,0}) while((s32[], f32[8,8]{1,0}) %w2), condition=%cond, body=%never_body, "
      'backend_config={"known_trip_count":{"n":"0"}}',
      "}",
    ]
  )
  ops = hlo_costs.device_ops(text, ("data",), (1,))
  matmul = 2 * 8 * 8 * 8
  assert hlo_costs.summary(ops)["flops"] == 2 * 5 * matmul
  assert hlo_costs.assumptions(ops) == ["while w2: trip count unreadable: counted as 5, the largest in the program"]
  prediction = perf_model.predict(ops, perf_model.Interconnect(perf_model.CPU_CHIP, (1,), {}, {}), matmul, 1.0)
  result = search.Result(candidates.Candidate({}), True, prediction=dataclasses.asdict(prediction))
  result.assumed = hlo_costs.assumptions(ops)
  shown = planner.explain(result, perf_model.planning_target("cpu-1"))
  assert "costed on an assumption (1):\n    while w2: trip count unreadable" in shown


def _matmul_rate(chip: topologies.Chip) -> float:
  return chip.peak_bf16_tflops * 1e12 * perf_model.MATMUL_EFFICIENCY


def test_an_async_collective_is_hidden_by_the_work_scheduled_inside_it():
  chip = perf_model.CPU_CHIP
  net = perf_model.Interconnect(chip, (8,), {"fsdp": 8}, {})
  big = 1e10  # bytes: longer than the matmul below
  start = hlo_costs.Op("ag", "all-gather-start", "main", 1, collective="all-gather", moved_bytes=big, axes=("fsdp",))
  start.done = "ag-done"
  work = hlo_costs.Op("dot", "fusion", "main", 1, flops=_matmul_rate(chip) * 0.5)  # 0.5 s of compute
  done = hlo_costs.Op("ag-done", "all-gather-done", "main", 1)
  collective_s = net.seconds(start)
  hidden = perf_model.predict([start, work, done], net, 1.0, 1.0)
  exposed = perf_model.predict([start, done, work], net, 1.0, 1.0)
  assert hidden.exposed_ici_s == pytest.approx(collective_s - 0.5)
  assert exposed.exposed_ici_s == pytest.approx(collective_s)
  assert hidden.step_s == pytest.approx(collective_s) and exposed.step_s == pytest.approx(collective_s + 0.5)


def _plan(*args, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
  command = [sys.executable, "MaxLite/plan.py", "configs/base.yml", *args]
  return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _ranked_rows(stdout):
  return re.findall(r"^\s*\d+\s{2}(.+?)\s+(\d+\.\d)%\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)\s+(-?\d+)%", stdout, re.M)


@pytest.mark.slow
def test_search_keeps_pins_ranks_only_fitting_plans_and_reuses_its_cache(tmp_path):
  hbm_gib = 0.03  # small enough that the largest batches do not fit
  args = ["model_name=tiny", "compile_topology=cpu-8", "max_target_length=64", "ici_tensor_parallelism=2"]
  args += ["ici_data_parallelism=1", "ici_sequence_parallelism=1", "ici_pipeline_parallelism=1"]  # batch is searched
  args += ["remat_policy=full", f"plan_hbm_gib={hbm_gib}", "plan_time_budget_s=300", "plan_workers=1"]
  args += [f"plan_cache_dir={tmp_path / 'cache'}", f"--plan_output={tmp_path / 'best.yml'}"]
  first = _plan(*args)
  assert first.returncode == 0, first.stderr[-3000:]
  rows = _ranked_rows(first.stdout)
  assert rows, first.stdout
  for plan, *_, free in rows:
    assert "tensor2" in plan and "| full |" in plan, plan  # the pinned keys
    assert int(free) >= 0  # headroom from the exact bytes (the GiB column rounds these tiny plans to 0.0)
  assert "compiled but did not fit" in first.stdout, first.stdout  # there were some, and none is in the table
  compiled = int(re.search(r"search: (\d+) plans evaluated \(0 from the cache\)", first.stdout).group(1))

  again = _plan(*args, "--explain=1")
  assert again.returncode == 0, again.stderr[-3000:]
  assert f"search: {compiled} plans evaluated ({compiled} from the cache)" in again.stdout
  # remat_policy=full runs each layer's forward again in the backward pass (all but the matmuls whose outputs the
  # backward does not use): the tiny model's layers are a fifth of its FLOPs, the rest is its 8192-word output head
  config = make_config("model_name=tiny", "max_target_length=64")
  counted = flops.training_flops_per_step(config)
  head = 3 * 2 * config.global_batch_size_to_train_on * 64 * config.base_emb_dim * config.vocab_size
  layers_forward = (counted["total"] - head) / 3 / counted["total"]
  recomputed = float(re.search(r"matmul FLOPs as compiled: ([\d.]+)x the model's", again.stdout).group(1))
  assert 1 + 0.5 * layers_forward < recomputed < 1 + 1.5 * layers_forward, again.stdout
  assert "compiled," not in again.stderr  # no progress line: nothing was compiled
  assert "costed on an assumption" not in again.stdout  # every loop and group of a real program was read
  assert _ranked_rows(again.stdout) == rows

  # train_compile.py on the best plan keeps its compile in the plan cache, under the key the search gave that plan
  # and with the search's own entry: a plan.py on the same keys compiles it no more. Checked on an emptied cache.
  cache = tmp_path / "cache"
  searched = {path.name: json.loads(path.read_text()) for path in cache.iterdir()}
  shutil.rmtree(cache)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
  check = subprocess.run(
    [
      sys.executable,
      "MaxLite/train_compile.py",
      str(tmp_path / "best.yml"),
      f"plan_hbm_gib={hbm_gib}",
      f"plan_cache_dir={cache}",
    ],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert check.returncode == 0 and "mesh fsdp=4 x tensor=2" in check.stdout, check.stdout + check.stderr[-2000:]
  (kept,) = cache.iterdir()
  assert kept.name in searched
  entry, original = json.loads(kept.read_text()), searched[kept.name]
  assert {**entry, "compile_s": 0} == {**original, "compile_s": 0}
  # plan.py and train_compile.py measure a plan's memory the same way (the compiler's allocation): what fits one
  needed = re.search(r"total needed\s+([\d.]+) (MiB|GiB) of device memory \(the compiler's", check.stdout)
  assert needed and float(needed.group(1)) * (1024 if needed.group(2) == "GiB" else 1) <= hbm_gib * 1024, check.stdout


@pytest.mark.parametrize(
  "args, message",
  [
    (["model_name=tiny", "compile_topology=v9-8"], r"compile_topology='v9-8' is not one of v4-N, v5p-N"),
    (
      ["model_name=llama2-70b", "compile_topology=v5e-4"],
      r"model llama2-70b cannot fit on v5e-4: every plan needs at least [\d.]+ GiB per device .* it needs at least "
      r"\d+ chips \(v5e-\d+\)",
    ),
    (
      ["model_name=tiny", "compile_topology=cpu-8", "plan_time_budget_s=0", "plan_cache_dir={tmp}"],
      r"plan_time_budget_s=0 compiles nothing and the plan cache \(.+\) holds none of these \d+ plans: give the "
      r"search a budget, or compile the config first with train_compile.py",
    ),
  ],
)
def test_impossible_requests_are_one_line(args, message, tmp_path):
  done = _plan(*[a.format(tmp=tmp_path) for a in args], timeout=120)
  errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
  assert done.returncode == 2 and len(errors) == 1 and re.search(message, errors[0]), done.stderr[-2000:]
  assert "Traceback" not in done.stderr


def test_a_plan_that_does_not_compile_is_one_line_in_its_result_not_a_crash_of_the_search():
  """A compile that fails for another reason than memory (here: the plan's config was resolved for 4 devices and
  the target has 8) is that plan's `error`, with its type; the search goes on with the other plans."""
  from support.config import make_config

  from MaxLite.planning import search

  config = make_config("model_name=tiny", "ici_fsdp_parallelism=4", "dataset_type=synthetic", num_devices=4)
  result = search.evaluate(config.to_dict(), "cpu-8", 1)
  assert result["fits"] is False and result["compile_s"] >= 0
  assert result["error"] == "ValueError: config was resolved for 4 devices but 8 were given", result


@pytest.mark.slow
def test_the_model_predicts_tensor_8_slower_than_fsdp_8(tmp_path):
  """Two plans for the same model, batch and remat policy on the 8 simulated devices, differing only in layout: the
  weights sharded over all 8 (fsdp), or every projection split 8 ways (tensor: an all-reduce after each output
  projection, the norms and residuals on every device). The model predicts tensor 8 slower (here 1.16x: more
  memory-bound work and collectives, the same FLOPs). Measured, it is (1.5x on this machine): the timing is
  end_to_end/bench_layouts.py's to print, not a test's to assert."""
  from support.config import make_config

  from MaxLite.planning import search

  model = ["model_name=tiny", "base_emb_dim=256", "base_mlp_dim=1024", "vocab_size=1024", "max_target_length=256"]
  model += ["base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=32"]
  run = ["per_device_batch_size=2", "remat_policy=none", f"base_output_directory={tmp_path}", "dataset_type=synthetic"]
  plans = {"fsdp": ["ici_fsdp_parallelism=8"], "tensor": ["ici_fsdp_parallelism=1", "ici_tensor_parallelism=8"]}
  predicted = {}
  for name, keys in plans.items():
    config = make_config(*model, *run, *keys, f"run_name={name}", num_devices=8)
    predicted[name] = search.evaluate(config.to_dict(), "cpu-8", 1)["prediction"]["step_s"]
  print(f"predicted {predicted}")
  assert predicted["tensor"] > 1.1 * predicted["fsdp"]


@pytest.mark.parametrize("opcode", ["all-gather", "all-gather-start"])
def test_a_combined_all_gather_moves_every_array_it_gathers(opcode):
  """Two arrays gathered in one op over 4 devices: each device sends 3/4 of both results, not of the larger one."""
  shapes = {"a": "bf16[256,128]", "b": "f32[64,64]"}
  result = "(bf16[1024,128], f32[256,64])"
  if opcode.endswith("-start"):
    result = f"((bf16[256,128], f32[64,64]), {result})"
  instr = hlo_text.Instr("ag", result, opcode, ["a", "b"], "")
  gathered = 1024 * 128 * 2 + 256 * 64 * 4
  assert hlo_costs._moved_bytes("all-gather", instr, shapes, 4) == pytest.approx(gathered * 3 / 4)
  reduce = hlo_text.Instr("rs", "(bf16[64,128], f32[16,64])", "reduce-scatter", ["a", "b"], "")
  operands = 256 * 128 * 2 + 64 * 64 * 4
  assert hlo_costs._moved_bytes("reduce-scatter", reduce, shapes, 4) == pytest.approx(operands * 3 / 4)


def test_a_collective_without_named_axes_is_costed_by_its_group():
  chip = topologies.CHIPS["v5p"]  # a 3D torus: a group spanning all three dimensions gets three times the links
  net = perf_model.Interconnect(chip, (4, 4, 4), {"fsdp": 64}, {})
  named = hlo_costs.Op("a", "all-gather", "main", 1.0, collective="all-gather", moved_bytes=1e9, group_size=64)
  unnamed = dataclasses.replace(named, axes=())
  named = dataclasses.replace(named, axes=("fsdp",))
  assert net.seconds(unnamed) == pytest.approx(net.seconds(named))


# Two grouped matmuls as XLA's TPU lowering of ragged_dot and the megablox kernel write them (the kernel body and
# most attributes cut), next to another Pallas kernel.
_KERNEL = (
  '  %{name} = f32[1024,96]{{1,0}} custom-call(%p0, %p1), custom_call_target="tpu_custom_call", '
  'metadata={{op_name="jit(step)/{op}"}}, '
  'backend_config={{"custom_call_config":{{"cost_estimate":{{"flops":"12582912","transcendentals":"0"}}}}}}'
)
_GROUPED_HLO = "\n".join(
  [
    "ENTRY %main (p0: f32[1024,64], p1: f32[2,64,96]) -> (f32[1024,96], f32[1024,96], f32[1024,96]) {",
    "  %p0 = f32[1024,64]{1,0} parameter(0)",
    "  %p1 = f32[2,64,96]{2,1,0} parameter(1)",
    _KERNEL.format(name="ragged-dot-none.7", op="moe/shard_map/ragged_dot_general/ragged-dot-none"),
    _KERNEL.format(name="gmm", op="moe/shard_map/jit(tgmm)/pallas_call"),
    _KERNEL.format(name="splash", op="attention/splash_mha_fwd"),
    "  ROOT %t = (f32[1024,96]{1,0}, f32[1024,96]{1,0}, f32[1024,96]{1,0}) tuple(%ragged-dot-none.7, %gmm, %splash)",
    "}",
  ]
)


def test_grouped_matmul_kernels_are_told_apart_with_their_cost_estimates():
  """The planner replaces grouped-matmul kernels' buffer-sized costs by the routed rows' FLOPs; it must find them
  (and only them) and read their estimates."""
  ops = {o.name: o for o in hlo_costs.device_ops(_GROUPED_HLO, ("data",), (1,))}
  assert {n for n, o in ops.items() if o.grouped_matmul} == {"ragged-dot-none.7", "gmm"}
  assert all(o.flops == 2 * 1024 * 64 * 96 for o in ops.values() if o.opcode == "custom-call")


_OFFLOAD_HLO = "\n".join(
  [
    "ENTRY %main (stack: bf16[64,16,128], update: bf16[1,16,128], i: s32[]) -> bf16[1,16,128] {",
    "  %stack = bf16[64,16,128]{2,1,0:S(5)} parameter(0)",
    "  %update = bf16[1,16,128]{2,1,0} parameter(1)",
    "  %i = s32[] parameter(2)",
    "  %dus-start = ((bf16[64,16,128]{2,1,0:S(5)}, bf16[1,16,128]{2,1,0}, s32[], s32[], s32[]), "
    "bf16[64,16,128]{2,1,0:S(5)}, u32[]) dynamic-update-slice-start(%stack, %update, %i, %i, %i)",
    "  %dus-done = bf16[64,16,128]{2,1,0:S(5)} dynamic-update-slice-done(%dus-start)",
    "  %ds-start = ((bf16[64,16,128]{2,1,0:S(5)}, s32[], s32[], s32[]), bf16[1,16,128]{2,1,0}, u32[]) "
    "dynamic-slice-start(%dus-done, %i, %i, %i), dynamic_slice_sizes={1,16,128}",
    "  ROOT %ds-done = bf16[1,16,128]{2,1,0} dynamic-slice-done(%ds-start)",
    "}",
  ]
)


def test_async_slices_of_a_host_offloaded_stack_are_transfers_of_the_slice_over_pcie():
  """remat offloading to host stacks each layer's tensors with async dynamic-(update-)slices; counting the whole
  stack per layer put 5 s of phantom HBM traffic into MaxText's v5e 128B recipe. They are DMAs to and from host
  memory: the slice moves, at the PCIe bandwidth, while the core works until the done."""
  ops = {o.name: o for o in hlo_costs.device_ops(_OFFLOAD_HLO, ("data",), (1,))}
  layer_slice = 16 * 128 * 2
  for name in ("dus-start", "ds-start"):
    assert (ops[name].transfer, ops[name].moved_bytes, ops[name].hbm_bytes) == ("host", layer_slice, 0.0), name
  assert ops["dus-start"].done == "dus-done" and ops["ds-start"].done == "ds-done"
  net = perf_model.Interconnect(topologies.CHIPS["v5e"], (16, 16), {"data": 1}, {})
  assert net.seconds(ops["ds-start"]) == pytest.approx(layer_slice / 15e9)


_COPIES_HLO = "\n".join(
  [
    "ENTRY %main (a: bf16[1024,1024], w: bf16[1024,1024]) -> bf16[1024,1024] {",
    "  %a = bf16[1024,1024]{1,0} parameter(0)",
    "  %w = bf16[1024,1024]{1,0} parameter(1)",
    "  %prefetch = (bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0:S(1)}, u32[]{:S(2)}) copy-start(%w)",
    "  %mm = bf16[1024,1024]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
    "  %near = bf16[1024,1024]{1,0:S(1)} copy-done(%prefetch)",
    "  %out = (bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0:S(5)}, u32[]{:S(2)}) copy-start(%mm)",
    "  %away = bf16[1024,1024]{1,0:S(5)} copy-done(%out)",
    "  ROOT %mm2 = bf16[1024,1024]{1,0} dot(%mm, %near), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
    "}",
  ]
)


def test_an_async_copy_is_a_transfer_hidden_by_the_work_before_its_done():
  """Memory-space assignment's prefetches (into VMEM, S(1)) and evictions to host memory (S(5)) are copy-start /
  copy-done pairs the DMA engines run; counting them as the core's HBM traffic added a second of MaxText's v5e 128B
  recipe to the step."""
  ops = {o.name: o for o in hlo_costs.device_ops(_COPIES_HLO, ("data",), (1,))}
  buffer = 1024 * 1024 * 2
  assert (ops["prefetch"].transfer, ops["prefetch"].moved_bytes, ops["prefetch"].done) == ("hbm", buffer, "near")
  assert (ops["out"].transfer, ops["out"].moved_bytes, ops["out"].done) == ("host", buffer, "away")
  assert hlo_costs.summary(ops.values())["collective_bytes"] == 0  # copies are not collectives
  chip = topologies.CHIPS["v5e"]
  net = perf_model.Interconnect(chip, (16, 16), {"data": 1}, {})
  prediction = perf_model.predict(list(ops.values()), net, 1.0, 1.0)
  matmul_s = ops["mm"].flops / _matmul_rate(chip)
  assert net.seconds(ops["prefetch"]) < matmul_s  # the prefetch hides under the matmul
  # the eviction (over PCIe) has nothing between its start and done: the step waits for all of it
  assert prediction.exposed_copy_s == pytest.approx(net.seconds(ops["out"]))
  assert prediction.step_s == pytest.approx(2 * matmul_s + net.seconds(ops["out"]))


def test_transfers_over_the_same_links_go_one_after_another():
  chip = perf_model.CPU_CHIP
  net = perf_model.Interconnect(chip, (16,), {"fsdp": 4, "tensor": 4}, {})

  def gather(name: str, axis: str) -> hlo_costs.Op:
    return hlo_costs.Op(
      name, "all-gather-start", "main", 1, collective="all-gather", moved_bytes=1e9, axes=(axis,), done=f"{name}-done"
    )

  def step(*axes: str) -> perf_model.Prediction:
    starts = [gather(f"ag{k}", axis) for k, axis in enumerate(axes)]
    dones = [hlo_costs.Op(f"{o.name}-done", "all-gather-done", "main", 1) for o in starts]
    return perf_model.predict([*starts, work, *dones], net, 1.0, 1.0)

  each = net.seconds(gather("probe", "fsdp"))
  work = hlo_costs.Op("dot", "fusion", "main", 1, flops=_matmul_rate(chip) * each)  # as long as one gather
  assert step("fsdp").exposed_ici_s == pytest.approx(0.0)
  assert step("fsdp", "fsdp").exposed_ici_s == pytest.approx(each)  # the second waits for the first's links
  assert net.seconds(gather("t", "tensor")) == pytest.approx(each)
  assert step("fsdp", "tensor").exposed_ici_s == pytest.approx(0.0)  # other links: both run during the matmul


# TPU's async collective fusions, as libtpu compiles MaxText's v5p 64B recipe (trimmed): a start fusion wraps the
# all-gather in an AsyncCollectiveStart call; the fusions up to its done carry a copy of the all-gather next to
# their own work (here a matmul stored into a layer stack in place, the stack read through a nested fusion's slice)
# and pass the collective's buffers through; the done fusion ends it. A reduce-scatter is an all-reduce and a slice.
_ASYNC_FUSION_HLO = "\n".join(
  [
    "%add (a: f32[], b: f32[]) -> f32[] {",
    "  %a = f32[] parameter(0)",
    "  %b = f32[] parameter(1)",
    "  ROOT %sum = f32[] add(%a, %b)",
    "}",
    "%start_body (s0: bf16[4,8]) -> (bf16[4,8], bf16[16,8], u32[]) {",
    "  %s0 = bf16[4,8]{1,0} parameter(0)",
    "  %ag.0 = bf16[16,8]{1,0} all-gather(%s0), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}",
    "  ROOT %cc.0 = (bf16[4,8]{1,0}, bf16[16,8]{1,0}, u32[]) custom-call(%ag.0), "
    'custom_call_target="AsyncCollectiveStart"',
    "}",
    "%slice_body (d0: bf16[64,32,8], d1: s32[]) -> bf16[1,32,8] {",
    "  %d0 = bf16[64,32,8]{2,1,0} parameter(0)",
    "  %d1 = s32[] parameter(1)",
    "  %z = s32[] constant(0)",
    "  ROOT %piece = bf16[1,32,8]{2,1,0} dynamic-slice(%d0, %d1, %z, %z), dynamic_slice_sizes={1,32,8}",
    "}",
    "%work_body (c0: bf16[4,8], c1: bf16[16,8], c2: u32[], c3: bf16[64,32,8], c4: bf16[64,32,8], c5: bf16[8,8], "
    "c6: s32[]) -> (bf16[64,32,8], bf16[4,8], bf16[16,8], u32[]) {",
    "  %c0 = bf16[4,8]{1,0} parameter(0)",
    "  %c1 = bf16[16,8]{1,0} parameter(1)",
    "  %c2 = u32[] parameter(2)",
    "  %c3 = bf16[64,32,8]{2,1,0} parameter(3)",
    "  %c4 = bf16[64,32,8]{2,1,0} parameter(4)",
    "  %c5 = bf16[8,8]{1,0} parameter(5)",
    "  %c6 = s32[] parameter(6)",
    "  %ag.1 = bf16[16,8]{1,0} all-gather(%c0), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}",
    "  %layer = bf16[1,32,8]{2,1,0} fusion(%c4, %c6), kind=kLoop, calls=%slice_body",
    "  %x = bf16[32,8]{1,0} bitcast(%layer)",
    "  %dot = bf16[32,8]{1,0} dot(%x, %c5), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
    "  %row = bf16[1,32,8]{2,1,0} bitcast(%dot)",
    "  %zero = s32[] constant(0)",
    "  %dus = bf16[64,32,8]{2,1,0} dynamic-update-slice(%c3, %row, %c6, %zero, %zero)",
    "  ROOT %out = (bf16[64,32,8]{2,1,0}, bf16[4,8]{1,0}, bf16[16,8]{1,0}, u32[]) tuple(%dus, %c0, %ag.1, %c2)",
    "}",
    "%done_body (e0: bf16[4,8], e1: bf16[16,8], e2: u32[]) -> bf16[16,8] {",
    "  %e0 = bf16[4,8]{1,0} parameter(0)",
    "  %e1 = bf16[16,8]{1,0} parameter(1)",
    "  %e2 = u32[] parameter(2)",
    "  %ag.2 = bf16[16,8]{1,0} all-gather(%e0), channel_id=7, replica_groups=[1,4]<=[4], dimensions={0}",
    '  ROOT %cc.2 = bf16[16,8]{1,0} custom-call(%e0, %e1, %ag.2, %e2), custom_call_target="AsyncCollectiveDone"',
    "}",
    "%rs_body (r0: f32[32,8]) -> f32[8,8] {",
    "  %r0 = f32[32,8]{1,0} parameter(0)",
    "  %ar = f32[32,8]{1,0} all-reduce(%r0), channel_id=9, replica_groups=[1,4]<=[4], to_apply=%add",
    "  %k = u32[] constant(0)",
    "  ROOT %mine = f32[8,8]{1,0} dynamic-slice(%ar, %k, %k), dynamic_slice_sizes={8,8}",
    "}",
    "ENTRY %main (w: bf16[4,8], stack: bf16[64,32,8], saved: bf16[64,32,8], v: bf16[8,8], i: s32[], g: f32[32,8]) "
    "-> (bf16[16,8], f32[8,8]) {",
    "  %w = bf16[4,8]{1,0} parameter(0)",
    "  %stack = bf16[64,32,8]{2,1,0} parameter(1)",
    "  %saved = bf16[64,32,8]{2,1,0} parameter(2)",
    "  %v = bf16[8,8]{1,0} parameter(3)",
    "  %i = s32[] parameter(4)",
    "  %g = f32[32,8]{1,0} parameter(5)",
    "  %start = (bf16[4,8]{1,0}, bf16[16,8]{1,0}, u32[]) fusion(%w), kind=kCustom, calls=%start_body",
    "  %t0 = bf16[4,8]{1,0} get-tuple-element(%start), index=0",
    "  %t1 = bf16[16,8]{1,0} get-tuple-element(%start), index=1",
    "  %t2 = u32[] get-tuple-element(%start), index=2",
    "  %work = (bf16[64,32,8]{2,1,0}, bf16[4,8]{1,0}, bf16[16,8]{1,0}, u32[]) fusion(%t0, %t1, %t2, %stack, "
    "%saved, %v, %i), kind=kOutput, output_to_operand_aliasing={{1}: (0, {}), {2}: (1, {}), {3}: (2, {})}, "
    "calls=%work_body",
    "  %u0 = bf16[4,8]{1,0} get-tuple-element(%work), index=1",
    "  %u1 = bf16[16,8]{1,0} get-tuple-element(%work), index=2",
    "  %u2 = u32[] get-tuple-element(%work), index=3",
    "  %done = bf16[16,8]{1,0} fusion(%u0, %u1, %u2), kind=kCustom, calls=%done_body",
    "  %rs = f32[8,8]{1,0} fusion(%g), kind=kCustom, calls=%rs_body",
    "  ROOT %result = (bf16[16,8]{1,0}, f32[8,8]{1,0}) tuple(%done, %rs)",
    "}",
  ]
)


def test_tpu_async_collective_fusions_are_collectives_and_their_passed_through_buffers_cost_nothing():
  """libtpu wraps collectives in fusions (an async start/done pair with the work between carrying a copy, and an
  all-reduce-scatter): read as plain fusions, MaxText's v5p 64B recipe had no link time for its weight all-gathers
  and 0.9 s per step of phantom HBM traffic from whole saved-activation stacks 'written' where one layer was."""
  ops = {o.name: o for o in hlo_costs.device_ops(_ASYNC_FUSION_HLO, ("fsdp",), (4,))}
  start, work, gather_bytes = ops["start"], ops["work"], 16 * 8 * 2
  assert (start.collective, start.axes, start.group_size, start.done) == ("all-gather", ("fsdp",), 4, "done")
  assert start.moved_bytes == gather_bytes * 3 / 4 and start.hbm_bytes == 0
  layer = 32 * 8 * 2
  assert work.collective == "" and work.flops == 2 * 32 * 8 * 8
  # read: the saved layer's slice, v and the layer index; written: the new layer
  assert work.hbm_bytes == layer + 8 * 8 * 2 + 4 + layer
  assert (ops["rs"].collective, ops["rs"].moved_bytes) == ("reduce-scatter", 32 * 8 * 4 * 3 / 4)
  net = perf_model.Interconnect(perf_model.CPU_CHIP, (4,), {"fsdp": 4}, {})
  prediction = perf_model.predict(list(ops.values()), net, 1.0, 1.0)
  assert prediction.ici_s == pytest.approx(net.seconds(start) + net.seconds(ops["rs"]))


_STATE = "(bf16[4,8]{1,0}, bf16[16,8]{1,0}, u32[], bf16[64,32,8]{2,1,0}, bf16[64,32,8]{2,1,0}, bf16[8,8]{1,0}, s32[])"
# The same collective with its work in a loop between start and done (the windowed-einsum loops of MaxText's v5p
# 128B recipe): the copy inside the loop body is work, not a second collective.
_ASYNC_ACROSS_A_LOOP_HLO = "\n".join(
  _ASYNC_FUSION_HLO.split("\n")[: _ASYNC_FUSION_HLO.split("\n").index("%rs_body (r0: f32[32,8]) -> f32[8,8] {")]
  + [
    f"%loop_cond (lc: {_STATE}) -> pred[] {{",
    f"  %lc = {_STATE} parameter(0)",
    "  ROOT %always = pred[] constant(true)",
    "}",
    f"%loop_body (lb: {_STATE}) -> {_STATE} {{",
    f"  %lb = {_STATE} parameter(0)",
    *[f"  %b{k} = {t} get-tuple-element(%lb), index={k}" for k, t in enumerate(_STATE[1:-1].split(", "))],
    "  %work = (bf16[64,32,8]{2,1,0}, bf16[4,8]{1,0}, bf16[16,8]{1,0}, u32[]) fusion(%b0, %b1, %b2, %b3, %b4, %b5, "
    "%b6), kind=kOutput, calls=%work_body",
    *[f"  %n{k} = {t} get-tuple-element(%work), index={k}" for k, t in enumerate(_STATE[1:-1].split(", ")[:4])],
    f"  ROOT %next = {_STATE} tuple(%n1, %n2, %n3, %n0, %b4, %b5, %b6)",
    "}",
    "ENTRY %main (w: bf16[4,8], stack: bf16[64,32,8], saved: bf16[64,32,8], v: bf16[8,8], i: s32[]) -> bf16[16,8] {",
    "  %w = bf16[4,8]{1,0} parameter(0)",
    "  %stack = bf16[64,32,8]{2,1,0} parameter(1)",
    "  %saved = bf16[64,32,8]{2,1,0} parameter(2)",
    "  %v = bf16[8,8]{1,0} parameter(3)",
    "  %i = s32[] parameter(4)",
    "  %start = (bf16[4,8]{1,0}, bf16[16,8]{1,0}, u32[]) fusion(%w), kind=kCustom, calls=%start_body",
    "  %t0 = bf16[4,8]{1,0} get-tuple-element(%start), index=0",
    "  %t1 = bf16[16,8]{1,0} get-tuple-element(%start), index=1",
    "  %t2 = u32[] get-tuple-element(%start), index=2",
    f"  %init = {_STATE} tuple(%t0, %t1, %t2, %stack, %saved, %v, %i)",
    f'  %loop = {_STATE} while(%init), condition=%loop_cond, body=%loop_body, backend_config={{"known_trip_count":'
    '{"n":"3"}}',
    "  %u0 = bf16[4,8]{1,0} get-tuple-element(%loop), index=0",
    "  %u1 = bf16[16,8]{1,0} get-tuple-element(%loop), index=1",
    "  %u2 = u32[] get-tuple-element(%loop), index=2",
    "  ROOT %done = bf16[16,8]{1,0} fusion(%u0, %u1, %u2), kind=kCustom, calls=%done_body",
    "}",
  ]
)


def test_an_async_collective_fusions_work_inside_a_loop_is_work_and_the_loop_hides_the_collective():
  ops = hlo_costs.device_ops(_ASYNC_ACROSS_A_LOOP_HLO, ("fsdp",), (4,))
  by_name = {o.name: o for o in ops}
  assert [o.name for o in ops if o.collective] == ["start"] and by_name["start"].done == "done"
  assert by_name["work"].runs == 3 and by_name["work"].flops == 2 * 32 * 8 * 8
  assert by_name["loop"].runs_inside == ("loop_body",)
  # The model: a loop's time (its body's ops, every trip) hides a collective in flight across it.
  chip = perf_model.CPU_CHIP
  net = perf_model.Interconnect(chip, (8,), {"fsdp": 8}, {})
  start = hlo_costs.Op("ag", "fusion", "main", 1, collective="all-gather", moved_bytes=1e10, axes=("fsdp",), done="d")
  loop = hlo_costs.Op("loop", "while", "main", 1, runs_inside=("body",))
  matmul = hlo_costs.Op("dot", "fusion", "body", 4, flops=_matmul_rate(chip) * 0.25)  # 4 x 0.25 s
  done = hlo_costs.Op("d", "fusion", "main", 1)
  prediction = perf_model.predict([start, loop, done, matmul], net, 1.0, 1.0)
  assert prediction.exposed_ici_s == pytest.approx(net.seconds(start) - 1.0)
  assert prediction.step_s == pytest.approx(net.seconds(start))


# One trip of a windowed einsum loop as libtpu schedules it (MaxText's v5e 128B recipe, trimmed): the permutes
# are synchronous instructions, placed after the matmul on the shard this trip holds; the next trip's shard is
# sent on from what arrived.
_WINDOWED_HLO = "\n".join(
  [
    "%window_body (p: (bf16[256,128], bf16[128,128], bf16[256,128])) -> (bf16[256,128], bf16[128,128], "
    "bf16[256,128]) {",
    "  %p = (bf16[256,128]{1,0}, bf16[128,128]{1,0}, bf16[256,128]{1,0}) parameter(0)",
    "  %x = bf16[256,128]{1,0} get-tuple-element(%p), index=0",
    "  %w = bf16[128,128]{1,0} get-tuple-element(%p), index=1",
    "  %acc = bf16[256,128]{1,0} get-tuple-element(%p), index=2",
    "  %mine = bf16[256,128]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
    "  %sent = bf16[256,128]{1,0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}",
    "  %theirs = bf16[256,128]{1,0} dot(%sent, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
    "  %again = bf16[256,128]{1,0} collective-permute(%sent), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},"
    "{3,0}}",
    "  %sum = bf16[256,128]{1,0} add(%mine, %theirs)",
    "  ROOT %next = (bf16[256,128]{1,0}, bf16[128,128]{1,0}, bf16[256,128]{1,0}) tuple(%again, %w, %sum)",
    "}",
    "%window_cond (c: (bf16[256,128], bf16[128,128], bf16[256,128])) -> pred[] {",
    "  %c = (bf16[256,128]{1,0}, bf16[128,128]{1,0}, bf16[256,128]{1,0}) parameter(0)",
    "  ROOT %go = pred[] constant(true)",
    "}",
    "ENTRY %main (a: bf16[256,128], b: bf16[128,128], z: bf16[256,128]) -> (bf16[256,128], bf16[128,128], "
    "bf16[256,128]) {",
    "  %a = bf16[256,128]{1,0} parameter(0)",
    "  %b = bf16[128,128]{1,0} parameter(1)",
    "  %z = bf16[256,128]{1,0} parameter(2)",
    "  %init = (bf16[256,128]{1,0}, bf16[128,128]{1,0}, bf16[256,128]{1,0}) tuple(%a, %b, %z)",
    "  ROOT %loop = (bf16[256,128]{1,0}, bf16[128,128]{1,0}, bf16[256,128]{1,0}) while(%init), "
    'condition=%window_cond, body=%window_body, backend_config={"known_trip_count":{"n":"2"}}',
    "}",
  ]
)


def test_a_synchronous_permute_is_a_transfer_from_when_its_input_is_ready_to_its_first_use():
  ops = hlo_costs.device_ops(_WINDOWED_HLO, ("tensor",), (4,))
  body = [o.name for o in ops if o.computation == "window_body"]
  # sent from the start of the trip (its input is the loop's), waited for before the matmul that needs it; the
  # shard it brought is sent on as soon as it has arrived, and waited for at the end of the trip
  assert body == ["sent", "mine", "sent.wait", "again", "theirs", "sum"], body
  by_name = {o.name: o for o in ops}
  assert by_name["sent"].done == "sent.wait" and by_name["sent"].collective == "collective-permute"
  assert by_name["sent.wait"].flops == 0 and by_name["sent.wait"].hbm_bytes == 0
  # The model: the matmul on this trip's shard hides the transfer of the next one.
  chip = topologies.CHIPS["v5e"]
  net = perf_model.Interconnect(chip, (4, 4), {"tensor": 4}, {})

  def op_s(name: str) -> float:
    return max(by_name[name].flops / _matmul_rate(chip), by_name[name].hbm_bytes / (chip.hbm_gbytes_per_s * 1e9))

  permute_s = net.seconds(by_name["sent"])
  assert permute_s > op_s("mine")  # so part of it shows: exactly what the matmul does not cover
  sent_shows = permute_s - op_s("mine")
  again_shows = net.seconds(by_name["again"]) - op_s("theirs") - op_s("sum")  # sent on while the core works
  prediction = perf_model.predict(ops, net, 1.0, 1.0)
  assert prediction.exposed_ici_s == pytest.approx(2 * (sent_shows + again_shows))  # 2 trips


def test_links_carry_the_rate_payloads_reach_one_way():
  """A link carries what a collective's payload reaches on it, one way: 86.3 GB/s on v5p (measured with
  lax.ppermute), 45 GB/s on v5e (the scaling book's table), not Cloud TPU's nominal 100 / 50 GB/s; a chip sends over
  two links per torus dimension at once; each hop costs about 1 us."""
  for family, one_way in (("v5e", 45e9), ("v5p", 86.3e9)):
    chip = topologies.CHIPS[family]
    net = perf_model.Interconnect(chip, (4,) * chip.dims, {"tensor": 4}, {})
    size = 1e9
    permute = hlo_costs.Op("p", "collective-permute", "main", 1, collective="collective-permute", moved_bytes=size)
    permute.axes = ("tensor",)
    gather = hlo_costs.Op("g", "all-gather", "main", 1, collective="all-gather", moved_bytes=size, axes=("tensor",))
    hop = perf_model.HOP_LATENCY_S
    assert net.seconds(permute) == pytest.approx(hop + size / one_way)  # one link, one way, one hop
    # a ring in one dimension: both ways, 3 hops around 4 chips
    assert net.seconds(gather) == pytest.approx(3 * hop + size / (2 * one_way))
    # over the whole slice: a ring in every dimension, each at its share of the links
    whole = dataclasses.replace(gather, axes=("fsdp",))
    wide = perf_model.Interconnect(chip, (4,) * chip.dims, {"fsdp": 4**chip.dims}, {})
    assert wide.seconds(whole) == pytest.approx(3 * chip.dims * hop + size / (2 * chip.dims * one_way))


_WINDOW_HLO = "\n".join(
  [
    "%window (w0: bf16[64,128], w1: s32[]) -> bf16[16,128] {",
    "  %w0 = bf16[64,128]{1,0} parameter(0)",
    "  %w1 = s32[] parameter(1)",
    "  %lowest = bf16[] constant(-inf)",
    "  %padded = bf16[128,128]{1,0} pad(%w0, %lowest), padding=0_64x0_0",
    "  %zero = s32[] constant(0)",
    "  ROOT %cut = bf16[16,128]{1,0} dynamic-slice(%padded, %w1, %zero), dynamic_slice_sizes={16,128}",
    "}",
    "ENTRY %main (x: bf16[64,128], i: s32[]) -> bf16[16,128] {",
    "  %x = bf16[64,128]{1,0} parameter(0)",
    "  %i = s32[] parameter(1)",
    "  ROOT %take = bf16[16,128]{1,0} fusion(%x, %i), kind=kLoop, calls=%window",
    "}",
  ]
)


def test_a_window_cut_from_a_padded_operand_reads_the_window():
  """The windowed-einsum loops (tensor parallelism on TPU) pad an operand and slice one window per trip."""
  (take,) = hlo_costs.device_ops(_WINDOW_HLO, ("data",), (1,))
  window = 16 * 128 * 2
  assert take.hbm_bytes == window + 4 + window  # the window and the index read, the window written


def test_bench_plan_compares_with_maxtexts_published_mfu_on_maxtexts_flop_count():
  """MaxText's 2024 MFU counted the attention score matmuls without the causal mask; MaxLite counts half of them."""
  from support.end_to_end import bench_plan

  emb, mlp, heads, d, layers, vocab, seq = 8192, 28672, 64, 128, 64, 32000, 2048  # configs/models/maxtext-64b.yml
  per_token_weights = (2 * emb * mlp * 3 + 2 * emb * 3 * heads * d + 2 * emb * heads * d) * layers + 2 * emb * vocab
  maxtext = 3 * per_token_weights + 3 * layers * 4 * seq * heads * d  # calculate_tflops_training_per_device
  maxlite = 3 * per_token_weights + 3 * layers * 2 * seq * heads * d
  assert bench_plan.maxtext_count("maxtext-64b", seq) == pytest.approx(maxtext / maxlite, rel=1e-12)


# A layer's splash kernels as libtpu's program names them (MaxText's v5p 64B recipe, trimmed): the forward, its
# rerun under remat, and the two backward kernels, on [batch 2, heads 4, 1024 tokens, 128] per device.
_SPLASH_HLO = "\n".join(
  [
    "ENTRY %main (q: bf16[2,4,1024,128], k: bf16[2,2,1024,128], info: s32[4,2,2]) -> bf16[2,4,1024,128] {",
    "  %q = bf16[2,4,1024,128]{3,2,1,0} parameter(0)",
    "  %k = bf16[2,2,1024,128]{3,2,1,0} parameter(1)",
    "  %info = s32[4,2,2]{2,1,0} parameter(2)",
    *[
      f"  %splash_mha_{name} = bf16[2,4,1024,128]{{3,2,1,0}} custom-call(%info, %q, %k, %k), "
      'custom_call_target="tpu_custom_call"'
      for name in ("fwd_segmented_residuals.1", "fwd_segmented_residuals.2", "dq_segmented_no_residuals.1")
    ],
    "  ROOT %splash_mha_dkv_segmented_no_residuals.1 = bf16[2,2,1024,128]{3,2,1,0} custom-call(%info, %q, %k, %k), "
    'custom_call_target="tpu_custom_call"',
    "}",
  ]
)


def test_splash_kernels_in_the_program_are_costed_by_the_blocks_they_compute():
  """Each kernel run counts: the forward rerun under remat too, and the diagonal blocks whole (the model's FLOP count
  has neither: one forward, and exactly half of the scores)."""
  kernels = [o for o in hlo_costs.device_ops(_SPLASH_HLO, ("fsdp",), (1,)) if o.attention]
  assert [o.attention for o in kernels] == [(p, 2, 4, 1024, 1024, 128) for p in ("fwd", "fwd", "dq", "dkv")]
  # blocks of 512: rows 0-511 see one key block, rows 512-1023 two: 3 blocks of 512 x 512 query-key pairs
  pairs = 3 * 512 * 512
  per_matmul = 2 * 2 * 4 * pairs * 128
  flops = [hlo_costs.splash_kernel_flops(o.attention, 512, 512) for o in kernels]
  assert flops == [2 * per_matmul, 2 * per_matmul, 3 * per_matmul, 4 * per_matmul]
  assert hlo_costs.splash_kernel_flops(kernels[3].attention, 512, 512, fused_backward=True) == 5 * per_matmul
  # smaller blocks waste less on the diagonal: 128 x 128 blocks cover 36 of the 64 pairs of 128-blocks
  assert hlo_costs.splash_kernel_flops(kernels[0].attention, 128, 128) == 2 * 2 * 2 * 4 * 36 * 128 * 128 * 128
  # the last of two sequence shards (queries 1024-2047 of 2048 keys) sees every earlier key: 3 + 4 blocks of 512
  sharded = ("fwd", 2, 4, 1024, 2048, 128)
  assert hlo_costs.splash_kernel_flops(sharded, 512, 512) == 2 * 2 * 2 * 4 * 7 * 512 * 512 * 128
  # load-balanced (context_parallel_reorder): each shard holds chunks 0+3 or 1+2 of 4, 1 + 4 = 2 + 3 = 5 blocks
  balanced = hlo_costs.splash_kernel_flops(sharded, 512, 512, reorder="dual_chunk_swap")
  assert balanced == 2 * 2 * 2 * 4 * 5 * 512 * 512 * 128


def test_a_splash_kernel_is_read_as_attention_over_its_query_and_key_shapes():
  """Pallas kernels show only their operands (mask blocks, queries, keys, values, segment ids padded to 128 lanes).
  A sequence shard's queries (512 of 1024 positions) see every key; with grouped-query attention the keys have fewer
  heads."""
  mask, segments = "s8[9,512,512]{2,1,0}", "s32[2,1024,128]{2,1,0}"
  for q, kv, shape in [
    ("bf16[2,8,512,128]{3,2,1,0}", "bf16[2,8,1024,128]{3,2,1,0}", (2, 8, 512, 1024, 128)),
    ("bf16[2,16,1024,64]{3,2,1,0}", "bf16[2,4,1024,64]{3,2,1,0}", (2, 16, 1024, 1024, 64)),
  ]:
    text = "\n".join(
      [
        f"ENTRY %main (m: {mask}, q: {q}, k: {kv}, v: {kv}, s: {segments}) -> {q} {{",
        f"  %m = {mask} parameter(0)",
        f"  %q = {q} parameter(1)",
        f"  %k = {kv} parameter(2)",
        f"  %v = {kv} parameter(3)",
        f"  %s = {segments} parameter(4)",
        f"  ROOT %splash_mha_fwd.3 = {q} custom-call({mask} %m, {q} %q, {kv} %k, {kv} %v, {segments} %s), "
        'custom_call_target="tpu_custom_call"',
        "}",
      ]
    )
    (kernel,) = [o for o in hlo_costs.device_ops(text, ("data",), (1,)) if o.attention]
    assert kernel.attention == ("fwd", *shape)


@pytest.fixture(scope="module")
def compiled_matmul_flops():
  """Matmul FLOPs of the tiny model's compiled train step (one device, plain attention) per remat policy."""
  from MaxLite.aot import compile_step

  found = {}

  def count(policy: str) -> tuple[float, dict]:
    if policy not in found:
      config = make_config("model_name=tiny", "max_target_length=64", "attention=dot_product", f"remat_policy={policy}")
      text = compile_step.lower_train_step(config, first_devices(1))[0].compile().as_text()
      found[policy] = hlo_costs.summary(hlo_costs.device_ops(text, ("data",), (1,)))["flops"], config.to_dict()
    return found[policy]

  return count


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "minimal", "save_qkv_proj", "save_dot_except_mlp", "save_out_proj"])
def test_the_recomputation_the_planner_counts_is_at_most_what_the_compiled_step_recomputes(
  compiled_matmul_flops, policy
):
  """The optimistic time adds the policy's recomputation, derived from the names it keeps, to the model's FLOPs. It
  must not exceed what the compiled step really runs again (or the search could stop before the fastest plan), and
  it must count most of it (else the bound says little): plain attention computes every score where the count takes
  the causal half, so `minimal`, which recomputes only the attention, is counted at half of it."""
  baseline, _ = compiled_matmul_flops("none")
  compiled, config = compiled_matmul_flops(policy)
  counted = candidates.recomputed_flops(config)
  print(f"{policy}: recomputed as compiled {compiled - baseline:.4g}, counted {counted:.4g}")
  assert 0.45 * (compiled - baseline) <= counted <= compiled - baseline


_TWO_SLICES = """
import json
from MaxLite.aot import compile_step
from MaxLite.config import Config, choices, loader, validation
from MaxLite.parallel import topologies
from MaxLite.planning import hlo_costs, perf_model
target = perf_model.planning_target("v5p-8")
compile_step.prepare_backend(target)
raw = loader.load_raw(["configs/base.yml", "model_name=tiny", "compile_topology=v5p-8", "compile_topology_num_slices=2",
                       "per_device_batch_size=2", "max_target_length=256", "jax_cache_dir="])
c = Config(validation.validate_and_derive(raw, num_devices=8, num_slices=2, process_count=1, platform="tpu"))
text = compile_step.lower_train_step(c, compile_step.target_devices(target, 2))[0].compile().as_text()
ops = hlo_costs.device_ops(text, choices.MESH_AXES, c.mesh_shape, c.dcn_mesh_shape)
net = perf_model.Interconnect(target.chip, perf_model.torus(target), dict(zip(choices.MESH_AXES, c.ici_mesh_shape)),
                              dict(zip(choices.MESH_AXES, c.dcn_mesh_shape)))
across = [o for o in ops if o.across_slices]
print(json.dumps({"ops": sorted({(o.collective, o.axes, o.group_size, net.kind(o), bool(o.done)) for o in across}),
                  "moved": sum(o.moved_bytes for o in across), "params": c.num_params,
                  "fsdp": c.ici_mesh_shape[choices.MESH_AXES.index("fsdp")], "assumed": hlo_costs.assumptions(ops)}))
"""


@pytest.mark.slow
@pytest.mark.skipif(topologies.find_libtpu(REPO) is None, reason="libtpu not installed (bash setup.sh)")
def test_collectives_across_slices_are_read_from_the_megascale_transfers():
  """libtpu compiles a multi-slice program per slice: the gradient all-reduce across the two slices is no all-reduce
  in the HLO but sends to the megascale runtime. Read as asynchronous all-reduces over the data axis at the DCN rate,
  they move every float32 gradient of the chip's fsdp shard (2 x 1/2 of it over 2 slices); before, they were free."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
    [sys.executable, "-c", _TWO_SLICES], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  found = json.loads(proc.stdout.strip().splitlines()[-1])
  assert found["ops"] == [["all-reduce", ["data"], 2, "dcn", True]] and found["assumed"] == []
  gradients = found["params"] * 4 / found["fsdp"]
  assert gradients <= found["moved"] <= 1.1 * gradients, found


def test_the_progress_bar_fills_with_the_budget_when_the_queue_cannot_be_finished():
  """1,473 queued plans against a budget that allows dozens: the bar stayed empty to the end; it now shows the larger
  share done of the two limits, and the time spent."""
  from MaxLite.planning import search

  half_time = search._progress_line([], 1473, elapsed=300, budget=600)
  assert half_time.startswith("plan: [" + "#" * 10 + " " * 10 + "] 0 compiled, 1473 queued, 300/600 s"), half_time
  assert search._progress_line([], 3, elapsed=0, budget=600).startswith("plan: [" + " " * 20 + "]")


def test_a_plan_cache_that_cannot_be_kept_costs_one_warning_not_the_compile(tmp_path, capsys):
  """train_compile.py's report is its answer; a plan cache it cannot write (a file where the folder would be) only
  means plan.py compiles that config again."""
  (tmp_path / "file").write_text("")
  config = make_config("compile_topology=cpu-8", f"plan_cache_dir={tmp_path / 'file' / 'plans'}", num_devices=8)
  assert search.remember_compile(config, 1, compiled=None, allocated=None, compile_s=1.0) == ""
  (warning,) = capsys.readouterr().out.splitlines()
  assert warning.startswith(f"warning: plan.py's cache ({tmp_path / 'file' / 'plans'}) did not keep this compile: ")


_PREDICTION = dict.fromkeys(
  ("compute_s", "memory_s", "exposed_ici_s", "ici_s", "exposed_dcn_s", "dcn_s", "exposed_copy_s", "copy_s"), 0.01
) | {"step_s": 0.05, "mfu": 0.5, "tokens_per_s_per_chip": 1000.0}


def test_the_rejection_counts_add_up_to_the_plans_searched_and_the_plan_names_no_local_path(
  tmp_path, monkeypatch, capsys
):
  """Every plan searched is ranked or rejected once: the counts printed add up to the plans searched (they did not:
  the smaller batches of a family and the plans left when the search stopped were in none). --explain prints each
  distinct line once, and the plan written names the checkout's config by its path in the checkout, not this
  machine's absolute path, and loads from another directory."""

  def fake_search(kept, target, num_slices, **_):
    fitting = search.Result(kept[0], True, device_bytes=1.0, prediction=dict(_PREDICTION), bottleneck="compute")
    same = {"kind": "all-reduce", "axes": ["fsdp"], "bytes": 2**20, "runs": 1, "seconds": 0.001}
    fitting.collectives = [same, dict(same), dict(same, kind="all-gather")]
    too_big = search.Result(kept[1], False, device_bytes=2.0**40, error="")
    failed = search.Result(kept[2], False, error="XlaRuntimeError: something")
    return [fitting, too_big, failed], "the time budget plan_time_budget_s=1 ran out; 1 s spent"

  monkeypatch.setattr(search, "run_search", fake_search)
  out_file = tmp_path / "plans" / "best.yml"
  args = ["configs/base.yml", "model_name=tiny", "compile_topology=cpu-8", "max_target_length=64"]
  assert planner.run([*args, "plan_hbm_gib=0.03"], explain_plan=1, plan_output=str(out_file)) == 0
  captured = capsys.readouterr()
  enumerated = int(re.search(r"^plan: (\d+) plans, (\d+) left", captured.err, re.M).group(1))
  total, parts = re.search(r"^plans searched[^:]*: (\d+) = (.+)$", captured.out, re.M).groups()
  counts = {what: int(n) for n, what in re.findall(r"(\d+) ([a-z ]+?)(?: \+ |$)", parts)}
  assert int(total) == enumerated + 1 == sum(counts.values()), captured.out  # + the config as given
  assert counts["ranked"] == counts["did not fit"] == counts["failed"] == 1 and counts["not compiled"] > 0
  assert {"invalid", "smaller batches"} <= set(counts)
  # the rejected lines say the same counts
  assert f"  {counts['not compiled']} not compiled" in captured.out
  assert f"  {counts['smaller batches']} smaller batches of a layout" in captured.out
  # --explain: the two identical all-reduces are one line
  collectives = captured.out.split("largest collectives (per step):\n")[1].splitlines()[:2]
  assert collectives[0].startswith("    all-reduce") and collectives[0].endswith("(2 collectives alike, each)")
  assert collectives[1].startswith("    all-gather") and "alike" not in collectives[1]
  written = out_file.read_text()
  assert "\nbase_config: configs/base.yml\n" in written and REPO not in written
  monkeypatch.chdir(tmp_path)  # another directory, as on a TPU worker whose checkout lies elsewhere
  assert planner.config_lib.load_raw([str(out_file)])["model_name"] == "tiny"
  # a config of the user's own, outside the checkout: named relative to the plan
  own = tmp_path / "mine" / "my.yml"
  own.parent.mkdir()
  own.write_text("base_config: configs/base.yml\n")
  assert planner.base_config_for(str(own), str(out_file)) == os.path.join("..", "mine", "my.yml")


class _Threads(__import__("concurrent.futures").futures.ThreadPoolExecutor):
  """run_search's worker pool, as threads running a fake compile (no jax, no spawn)."""

  def __init__(self, max_workers, mp_context=None, initializer=None, initargs=()):
    super().__init__(max_workers)


def test_the_search_starts_no_compile_the_budget_cannot_finish(tmp_path, monkeypatch):
  """plan_time_budget_s=240 ran 366 s: a compile started with a second of the budget left ran on for two minutes.
  No compile starts with less budget left than the slowest so far took, and the time spent is reported."""
  import time as time_

  def compile_for_a_second(config, *_):
    time_.sleep(1.0)
    return {"fits": True, "device_bytes": 1.0, "prediction": dict(_PREDICTION), "compile_s": 1.0}

  monkeypatch.setattr(search, "evaluate", compile_for_a_second)
  monkeypatch.setattr(search.concurrent.futures, "ProcessPoolExecutor", _Threads)
  monkeypatch.setattr(search, "_best_seconds_per_token", lambda results: None)  # no frontier: only the budget stops
  monkeypatch.setattr(search, "PROGRESS_EVERY_S", 0.4)  # a line at least this often while a compile runs
  plans = [candidates.Candidate({"i": i}, config={"i": i}) for i in range(6)]
  target = perf_model.planning_target("cpu-1")
  started, lines = time_.monotonic(), []
  results, stopped = search.run_search(
    plans, target, 1, budget_s=2.5, workers=1, cache=str(tmp_path), progress=lines.append
  )
  spent = time_.monotonic() - started
  # compiles end at 1 s and 2 s; the third would end at 3 s, past the budget: it is not started
  assert len(results) == 2 and spent < 2.5, (spent, stopped)
  # the bar moves while the first compile runs, with nothing answered yet: the time spent fills it
  waiting = [line for line in lines if line.startswith("plan: [") and " 0 compiled, " in line]
  assert waiting and all(re.search(r"0 compiled, 6 queued, \d/2.5 s$", line) for line in waiting), lines
  assert re.search(r"had \d s left, less than the slowest compile \(1 s\), with 4 plans not compiled", stopped), stopped
  assert re.search(r"; [12] s spent$", stopped), stopped


def test_compiles_in_flight_at_the_end_of_the_budget_are_stopped():
  """A compile cannot be interrupted: its worker process is ended, and the pool shuts down at once."""
  import concurrent.futures
  import multiprocessing
  import time as time_

  pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
  future = pool.submit(time_.sleep, 120)
  time_.sleep(0.5)
  started = time_.monotonic()
  search._stop_workers(pool)
  pool.shutdown(wait=True, cancel_futures=True)
  assert time_.monotonic() - started < 30 and future.done()


def test_long_sequences_search_context_parallelism_and_its_strategies_by_maxtexts_key():
  """From 32k tokens a row the search splits the sequence over up to 16 devices, by ici_context_parallelism, with
  all_gather and (where the query heads split over tensor x context) ulysses; a config that sets the sequence axis by
  its other name keeps that key."""
  from MaxLite import config as config_lib

  target = perf_model.planning_target("v5p-16")
  raw = config_lib.load_raw([BASE_YML, "model_name=llama3.1-8b", "max_target_length=131072"])
  plans = candidates.enumerate_plans(raw, target, 1, {"remat_policy", "attention", "per_device_batch_size"})
  split = {(p.overrides["ici_context_parallelism"], p.overrides.get("context_parallel_strategy")) for p in plans}
  assert {(8, "all_gather"), (8, "ulysses"), (1, None)} <= split
  assert all("ici_sequence_parallelism" not in p.overrides for p in plans)
  # 32 query heads: tensor 8 x context 8 would leave half a head per device, so no ulysses there
  assert not any(
    p.overrides["ici_tensor_parallelism"] * p.overrides["ici_context_parallelism"] > 32
    and p.overrides.get("context_parallel_strategy") == "ulysses"
    for p in plans
  )
  short = config_lib.load_raw([BASE_YML, "model_name=llama3.1-8b", "ici_sequence_parallelism=2"])
  pinned = {"ici_sequence_parallelism", "remat_policy", "attention", "per_device_batch_size"}
  kept = candidates.enumerate_plans(short, target, 1, pinned)
  assert {p.overrides["ici_sequence_parallelism"] for p in kept} == {2}

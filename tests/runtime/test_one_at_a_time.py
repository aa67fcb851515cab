"""Simulated CPU devices run a program's calls one at a time (runtime/one_at_a_time.py): a program whose collectives
sit in loops, called back to back as the train loop calls its step, finishes instead of deadlocking XLA:CPU."""

import os
import subprocess
import sys

import jax
import pytest
from support.config import REPO, first_devices
from support.fast_compile import flags_this_xla_knows

from MaxLite.runtime import one_at_a_time

# Ring attention's shape in miniature: per microbatch (a scan), blocks passed around 4 sequence shards (a loop of
# ppermutes) with chunks skipped where a device-dependent condition says so (the mask), then an all-gather over the
# other axis. Called 300 times without waiting, XLA:CPU's device threads meet at different collectives within seconds
# (jax 0.10.2: 3 runs of 3 without the wait); the short rendezvous timeouts make that deadlock an abort in 5 s, not 60.
_LOOPED_COLLECTIVES = """
import sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from MaxLite.runtime import one_at_a_time

mesh = jax.make_mesh((2, 4), ("f", "s"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)

def program(x, w):
  me = jax.lax.axis_index("s")

  def step(i, x):
    chunk = lambda j, x: jax.lax.cond((me + i + j) % 3 == 0, lambda x: jnp.tanh(x @ w), lambda x: x, x)
    return jax.lax.ppermute(jax.lax.fori_loop(0, 2, chunk, x), "s", [(j, (j + 1) % 4) for j in range(4)])

  def microbatch(total, x):
    return total + jax.lax.all_gather(jax.lax.fori_loop(0, 4, step, x), "f", tiled=True).sum(), None

  return jax.lax.scan(microbatch, 0.0, jnp.stack([x, 2 * x]))[0]

jitted = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=(P("f", "s"), P()), out_specs=P(), check_vma=False))
call = one_at_a_time.calls(jitted, jax.devices()) if sys.argv[1] == "waited" else jitted
x = jax.device_put(jnp.ones((16, 256)), NamedSharding(mesh, P("f", "s")))
w = jnp.eye(64) * 0.5
for _ in range(300):
  out = call(x, w)
print("done", float(out))
"""


@pytest.mark.slow
def test_back_to_back_calls_of_looped_collectives_finish_on_simulated_devices():
  timeouts = flags_this_xla_knows(
    ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=3", "--xla_cpu_collective_call_terminate_timeout_seconds=5"),
    "MAXLITE_TEST_SHORT_RENDEZVOUS",
  )
  flags = f"--xla_force_host_platform_device_count=8 {timeouts}"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  done = subprocess.run(
    [sys.executable, "-c", _LOOPED_COLLECTIVES, "waited"],
    env=env,
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0 and "done" in done.stdout, done.stderr[-3000:]


def test_only_several_cpu_devices_wait():
  assert one_at_a_time.needed(first_devices(8)) and not one_at_a_time.needed(first_devices(1))
  jitted = jax.jit(lambda x: x + 1)
  assert one_at_a_time.calls(jitted, first_devices(1)) is jitted
  assert int(one_at_a_time.calls(jitted, first_devices(8))(1)) == 2

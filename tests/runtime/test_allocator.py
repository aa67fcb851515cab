"""tcmalloc for training processes: the re-exec decision and the re-exec itself."""

import os
import subprocess
import sys

import pytest
from support.config import REPO

from MaxLite.runtime import allocator


def test_preload_env_adds_tcmalloc_once_and_respects_the_switch(tmp_path):
  lib = "/usr/lib/libtcmalloc_minimal.so.4"
  quiet = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(2**40)}  # no stderr line per buffer over 1 GiB
  assert allocator.preload_env({"PATH": "/bin"}, lib) == {**quiet, "PATH": "/bin", "LD_PRELOAD": lib}
  assert allocator.preload_env({"LD_PRELOAD": "/x/libfoo.so"}, lib)["LD_PRELOAD"] == f"{lib} /x/libfoo.so"
  assert allocator.preload_env({"LD_PRELOAD": lib}, lib) is None  # after the re-exec: no second one
  assert allocator.preload_env({"MAXLITE_TCMALLOC": "0"}, lib) is None
  for own in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/opt/mimalloc/libmimalloc.so /x/libfoo.so"):
    assert allocator.preload_env({"LD_PRELOAD": own}, lib) is None  # the user's allocator stays the allocator
  assert allocator.preload_env({}, None) is None  # not installed: the system allocator
  present = tmp_path / "libtcmalloc.so.4"
  present.write_bytes(b"")
  assert allocator.tcmalloc_path((str(tmp_path / "missing.so"), str(present))) == str(present)


_SHOW_ALLOCATOR = """
import os, sys
from MaxLite.runtime import allocator
allocator.reexec_with_tcmalloc()
print(os.getpid(), "tcmalloc" in open("/proc/self/maps").read(), sys.argv[1:])
"""


@pytest.mark.skipif(allocator.tcmalloc_path() is None, reason="no tcmalloc on this system (libtcmalloc-minimal4)")
def test_reexec_keeps_pid_and_arguments_and_loads_tcmalloc(tmp_path):
  script = tmp_path / "entry.py"  # an entry point, as train.py is
  script.write_text(_SHOW_ALLOCATOR)
  env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MAXLITE_TCMALLOC")}
  proc = subprocess.Popen(
    [sys.executable, str(script), "a=1", "b c"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
  )
  out, _ = proc.communicate(timeout=120)
  assert out.strip().split(maxsplit=2) == [str(proc.pid), "True", "['a=1', 'b c']"]
  as_module = subprocess.run(  # python -m and interpreter options come back as they were
    [sys.executable, "-X", "utf8", "-c", _SHOW_ALLOCATOR + "print(sys.flags.utf8_mode)", "x"],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert as_module.stdout.split()[1:] == ["True", "['x']", "1"], as_module.stderr[-2000:]
  off = subprocess.run(
    [sys.executable, str(script)],
    cwd=REPO,
    env={**env, "MAXLITE_TCMALLOC": "0"},
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert off.stdout.split()[1] == "False"


def test_only_the_script_entry_reexecs_never_main_called_from_another_program(monkeypatch):
  from MaxLite import cli, train

  calls = []
  monkeypatch.setattr(allocator, "reexec_with_tcmalloc", lambda: calls.append("reexec"))
  monkeypatch.setattr(cli, "run_config_tool", lambda run, doc, **_: calls.append("train"))
  train.main()
  assert calls == ["train"]
  train.script()  # the maxlite-train console script
  assert calls == ["train", "reexec", "train"]


def test_the_process_a_launch_replaces_imports_neither_jax_nor_the_models():
  """train.py's first process only decides to re-exec itself under tcmalloc: whatever it imports, every launch pays
  for twice (jax, flax and the models were 0.6 s of each). The families still load at their first lookup."""
  probe = (
    "import sys; from MaxLite.runtime import allocator; "
    "print(sorted(m for m in ('jax', 'flax', 'MaxLite.models') if m in sys.modules)); "
    "from MaxLite.config import families; print(families.decoder_blocks())"
  )
  out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True).stdout
  assert out.splitlines() == ["[]", "('deepseek', 'gemma3', 'gpt_oss', 'llama2', 'mistral')"], out

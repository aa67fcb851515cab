"""When a process joins jax.distributed, and the preflight checks that stop a mis-started pod job."""

import os
import subprocess

import pytest
from support.config import make_config

from MaxLite.cli.errors import ConfigError
from MaxLite.runtime import preflight
from MaxLite.runtime.distributed import join_reason

RAW = {"skip_jax_distributed_system": False, "coordinator_address": ""}


@pytest.mark.parametrize(
  "raw, environ, tpu, expected",
  [
    ({}, {}, False, None),  # a laptop: single process
    ({}, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, False, None),  # one SLURM task
    ({}, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, False, "SLURM job 7 with 4 tasks"),
    ({}, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2"}, False, "SLURM job 7 with 2 tasks"),
    ({}, {}, True, "TPU VM"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234"}, False, "JAX_COORDINATOR_ADDRESS=10.0.0.2:1234"),
    ({"coordinator_address": "h:1"}, {}, False, "coordinator_address=h:1"),
    ({"skip_jax_distributed_system": True}, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, True, None),
  ],
)
def test_join_only_where_the_environment_has_several_hosts(raw, environ, tpu, expected):
  reason = join_reason({**RAW, **raw}, environ, tpu)
  assert reason == expected or (expected is not None and reason is not None and reason.startswith(expected))


def test_a_tpu_vm_never_falls_back_to_cpu_silently():
  preflight.check_backend({}, tpu_present=False, backend="cpu")  # a CPU machine
  preflight.check_backend({}, tpu_present=True, backend="tpu")
  preflight.check_backend({"JAX_PLATFORMS": "cpu"}, tpu_present=True, backend="cpu")  # asked for
  with pytest.raises(ConfigError, match="TPU chips but jax is running on the CPU"):
    preflight.check_backend({}, tpu_present=True, backend="cpu")


def test_process_and_device_counts_must_match_the_job():
  preflight.check_devices({0: 4, 1: 4}, expected_processes=2)
  preflight.check_devices({0: 4, 1: 4}, expected_processes=-1)
  with pytest.raises(ConfigError, match="num_processes=4 but 2 processes joined"):
    preflight.check_devices({0: 4, 1: 4}, expected_processes=4)
  with pytest.raises(ConfigError, match=r"different numbers of devices \(process 0: 4, process 1: 2\)"):
    preflight.check_devices({0: 4, 1: 2}, expected_processes=2)


def test_config_digest_ignores_only_per_process_keys():
  # A fixed run_name: the default is the start time, which differs when two configs straddle a second.
  a = make_config("run_name=r", "process_id=0").to_dict()
  assert preflight.config_digest(a) == preflight.config_digest(make_config("run_name=r", "process_id=1").to_dict())
  b = make_config("run_name=r", "steps=7").to_dict()
  assert preflight.config_digest(a) != preflight.config_digest(b)
  assert preflight.differing_keys(b, a) == ["learning_rate_schedule_steps", "steps"]


def test_a_cpu_only_jax_on_a_tpu_host_stops_before_jax_starts(monkeypatch):
  from MaxLite.runtime import install_check

  with pytest.raises(ConfigError, match="this machine has TPU chips but jax has no TPU support installed"):
    preflight.check_tpu_support({}, tpu_present=True)  # this machine's jax has no libtpu
  preflight.check_tpu_support({"JAX_PLATFORMS": "cpu"}, tpu_present=True)
  with pytest.raises(ConfigError, match=r"DEVICE=tpu but jax .* has no TPU support \(libtpu is missing\)"):
    install_check.check("tpu", tpu_present=True, gpu_present=False)
  monkeypatch.setattr(install_check, "_installed", lambda *modules: True)  # as after `pip install jax[tpu]`
  with pytest.raises(ConfigError, match="DEVICE=tpu but this machine has no TPU chips"):
    install_check.check("tpu", tpu_present=False, gpu_present=False)
  assert install_check.check("tpu", tpu_present=True, gpu_present=False).startswith("MaxLite set-up done")
  assert install_check.check("cpu", tpu_present=False, gpu_present=False).endswith("DEVICE=cpu")


def _setup(*args, **env):
  import os
  import subprocess

  from support.config import REPO

  return subprocess.run(
    ["bash", os.path.join(REPO, "setup.sh"), *args],
    env={**os.environ, **env},
    capture_output=True,
    text=True,
    timeout=60,
  )


@pytest.mark.parametrize(
  "args, fragment",
  [
    (["FOO=1"], "unknown argument 'FOO=1'"),
    (["DEVICE=quantum"], "DEVICE=quantum is not one of cpu, tpu, gpu"),
    (["MODE=latest"], "MODE=latest is not one of pinned, stable, nightly"),
    (["TEST=yes"], "AOT and TEST take 0 or 1"),
    (["PYTHON=/nonexistent/python3"], "PYTHON=/nonexistent/python3 is not a command"),
  ],
)
def test_setup_sh_bad_arguments_are_one_line(args, fragment):
  proc = _setup(*args)
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.count("\n") == 1 and fragment in proc.stderr, proc.stderr


def test_setup_sh_refuses_an_old_python_with_how_to_get_a_new_one(tmp_path):
  old = tmp_path / "python3.9"  # stands in for an old interpreter: answers the version probes as 3.9 would
  old.write_text('#!/bin/bash\n[ "$1" = -V ] && { echo "Python 3.9.18"; exit 0; }\nexit 1\n')
  old.chmod(0o755)
  proc = _setup(f"PYTHON={old}")
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1
  assert "Python 3.9.18 is too old: jax 0.10.2 needs Python 3.11 or newer" in proc.stderr
  assert "PYTHON=~/venv/bin/python bash setup.sh" in proc.stderr


def _fake_gpu_machine(tmp_path, driver_line: str | None):
  """A PATH whose nvidia-smi prints `driver_line`, and a python that answers the version probes as 3.12 and logs every
  other call (pip's included) instead of running it."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  if driver_line is not None:
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/bash\necho '| NVIDIA-SMI 580.65.06   Driver Version: 580.65.06   {driver_line}   |'\n")
    smi.chmod(0o755)
  python = bin_dir / "python3.12"
  log = tmp_path / "calls.log"
  python.write_text(f'#!/bin/bash\n[ "$1" = -V ] && {{ echo "Python 3.12.3"; exit 0; }}\necho "$@" >> {log}\nexit 0\n')
  python.chmod(0o755)
  return {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": str(python)}, log


@pytest.mark.parametrize(
  "driver_line, args, requirements",
  [
    ("CUDA Version: 13.0", [], "requirements/gpu.txt"),
    ("CUDA Version: 12.8", [], "requirements/gpu-cuda12.txt"),
    (None, [], "requirements/gpu.txt"),
    ("CUDA Version: 13.0", ["CUDA=12"], "requirements/gpu-cuda12.txt"),
  ],
  ids=["driver13", "driver12", "no_nvidia_smi", "asked_for_12"],
)
def test_setup_sh_gpu_installs_the_plugin_the_driver_runs(tmp_path, driver_line, args, requirements):
  env, log = _fake_gpu_machine(tmp_path, driver_line)
  proc = _setup("DEVICE=gpu", "AOT=0", *args, **env)
  assert proc.returncode == 0, proc.stderr
  installs = [line for line in log.read_text().splitlines() if line.startswith("-m pip install") and "-r" in line]
  assert f"-r{requirements}" in installs[0].split() and "requirements/gpu" not in installs[0].replace(requirements, "")
  assert log.read_text().splitlines()[-1] == "-m MaxLite.runtime.install_check"


def test_setup_sh_refuses_a_driver_older_than_cuda_12(tmp_path):
  env, log = _fake_gpu_machine(tmp_path, "CUDA Version: 11.8")
  proc = _setup("DEVICE=gpu", **env)
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1
  assert "the NVIDIA driver runs CUDA 11; jax 0.10.2 needs a driver for CUDA 12 or 13: update the driver" in proc.stderr
  assert not log.exists() or "pip" not in log.read_text()


def test_install_check_takes_either_cuda_plugin_and_checks_versions_and_driver(monkeypatch):
  from MaxLite.runtime import install_check

  with pytest.raises(ConfigError, match=r"has no CUDA plugin \(jax-cuda12 or jax-cuda13\)"):
    install_check.check("gpu", tpu_present=False, gpu_present=True)
  versions = {"jaxlib": "0.11.2", "jax-cuda13-plugin": "0.11.2", "jax-cuda13-pjrt": "0.11.2"}
  monkeypatch.setattr(install_check, "_installed", lambda *modules: "jax_cuda13_plugin" in modules)
  monkeypatch.setattr(install_check, "_version", versions.get)
  done = install_check.check("gpu", tpu_present=False, gpu_present=True, driver=13)
  assert done.endswith("with its CUDA 13 plugin for DEVICE=gpu")  # the H200 machine: jax-cuda13 only
  with pytest.raises(ConfigError, match=r"driver runs CUDA 12 at most; run `bash setup.sh DEVICE=gpu CUDA=12`"):
    install_check.check("gpu", tpu_present=False, gpu_present=True, driver=12)
  versions["jax-cuda13-pjrt"] = "0.10.2"
  with pytest.raises(ConfigError, match="jax-cuda13-pjrt 0.10.2 does not match jaxlib 0.11.2"):
    install_check.check("gpu", tpu_present=False, gpu_present=True, driver=13)
  versions["jax-cuda13-pjrt"] = "0.11.2"
  with pytest.raises(ConfigError, match="this machine has no NVIDIA GPU"):
    install_check.check("gpu", tpu_present=False, gpu_present=False)


def _checkout_with_a_fake_python(tmp_path, venv_fails: bool = False):
  """setup.sh and its requirement files in a directory of their own (setup.sh works where it lies), and a PATH whose
  python3 answers the version probes as 3.12, makes a directory for `-m venv DIR` (with itself as DIR/bin/python) and
  logs every call with the interpreter that got it."""
  import shutil

  from support.config import REPO

  checkout = tmp_path / "maxlite"
  checkout.mkdir()
  shutil.copy(f"{REPO}/setup.sh", checkout)
  shutil.copy(f"{REPO}/requirements.txt", checkout)
  shutil.copytree(f"{REPO}/requirements", checkout / "requirements")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  log = tmp_path / "calls.log"
  venv = (
    'echo "Error: ensurepip is not available"; exit 1' if venv_fails else 'mkdir -p "$3/bin"; cp "$0" "$3/bin/python"'
  )
  python = bin_dir / "python3"
  python.write_text(
    f'#!/bin/bash\n[ "$1" = -V ] && {{ echo "Python 3.12.3"; exit 0; }}\necho "$0 $*" >> {log}\n'
    f'[ "$1 $2" = "-m venv" ] && {{ {venv}; }}\nexit 0\n'
  )
  python.chmod(0o755)
  env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHON")}
  return checkout, dict(env, PATH=f"{bin_dir}:/usr/bin:/bin"), log


def _run_setup(checkout, env, *args):
  return subprocess.run(
    ["bash", str(checkout / "setup.sh"), "AOT=0", *args], env=env, capture_output=True, text=True, timeout=60
  )


def test_setup_sh_outside_any_environment_installs_into_a_new_dot_venv(tmp_path):
  """A new user's plain `bash setup.sh` (no venv active, no PYTHON): MaxLite goes into .venv in the checkout, which the
  last line says how to enter; a second run reuses it."""
  checkout, env, log = _checkout_with_a_fake_python(tmp_path)
  for _ in range(2):
    proc = _run_setup(checkout, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
      "installed into .venv, this checkout's virtual environment: `source .venv/bin/activate` enters it "
      "(in each new shell)"
    )
  calls = log.read_text().splitlines()
  assert [c for c in calls if " -m venv " in c] == [f"{tmp_path}/bin/python3 -m venv .venv"]  # made once
  installs = [c.split()[0] for c in calls if " -m pip install" in c or "install_check" in c]
  assert len(installs) == 6 and set(installs) == {f"{checkout}/.venv/bin/python"}


@pytest.mark.parametrize(
  "env_var", [{"VIRTUAL_ENV": "/home/u/venv"}, {"CONDA_PREFIX": "/opt/conda"}, {"PYTHON": "python3"}]
)
def test_setup_sh_installs_into_the_active_environment_or_the_named_python(tmp_path, env_var):
  checkout, env, log = _checkout_with_a_fake_python(tmp_path)
  proc = _run_setup(checkout, {**env, **env_var})
  assert proc.returncode == 0, proc.stderr
  assert "installed into .venv" not in proc.stdout and not (checkout / ".venv" / "bin" / "python").exists()
  assert {c.split()[0] for c in log.read_text().splitlines()} == {f"{tmp_path}/bin/python3"}


def test_the_readmes_two_commands_work_with_a_venv_already_active(tmp_path):
  """`bash setup.sh && source .venv/bin/activate` in a shell whose venv is active installs there, and the `source`
  enters that same environment (it failed: no .venv was made)."""
  checkout, env, log = _checkout_with_a_fake_python(tmp_path)
  active = tmp_path / "myvenv"
  (active / "bin").mkdir(parents=True)
  (active / "bin" / "activate").write_text(f'export VIRTUAL_ENV="{active}"\n')
  script = 'bash setup.sh AOT=0 && source .venv/bin/activate && echo "in $VIRTUAL_ENV"'
  proc = subprocess.run(
    ["bash", "-c", script], cwd=checkout, env={**env, "VIRTUAL_ENV": str(active)}, capture_output=True, text=True
  )
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines()[-1] == f"in {active}" and (checkout / ".venv").resolve() == active
  (tmp_path / "conda").mkdir()
  conda = _checkout_with_a_fake_python(tmp_path / "conda")[0]
  proc = _run_setup(conda, {**env, "CONDA_PREFIX": "/opt/conda/envs/x"})
  assert proc.returncode == 0, proc.stderr
  assert (conda / ".venv" / "bin" / "activate").read_text() == "conda activate /opt/conda/envs/x\n"


def test_setup_sh_says_in_one_line_what_to_do_when_no_venv_can_be_made(tmp_path):
  checkout, env, _ = _checkout_with_a_fake_python(tmp_path, venv_fails=True)
  proc = _run_setup(checkout, env)
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
  assert "(Error: ensurepip is not available); on Debian/Ubuntu `apt install python3-venv`" in proc.stderr
  assert not (checkout / ".venv").exists()

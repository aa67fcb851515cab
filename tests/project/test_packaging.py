"""The package around the code: installable, no sys.path edits, one command-line convention, MaxText key names."""

import ast
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest
from support.config import BASE_YML, FAST_COMPILE, REPO

PACKAGE = pathlib.Path(REPO) / "MaxLite"
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)


def _pyproject() -> dict:
  with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    return tomllib.load(f)


def _run(*args, cwd=REPO, env=None, timeout=300):
  return subprocess.run(
    [*args], cwd=cwd, env=env or ENV, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
  )


def test_no_sys_path_manipulation_in_the_package():
  offenders = []
  for path in PACKAGE.rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
        offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
  assert not offenders, offenders


def test_every_package_folder_is_listed_for_installation():
  listed = set(_pyproject()["tool"]["setuptools"]["packages"])
  folders = {".".join(p.parent.relative_to(REPO).parts) for p in PACKAGE.rglob("__init__.py")}
  assert folders <= listed, folders - listed


def test_one_pinned_source_of_dependencies():
  dynamic = _pyproject()["tool"]["setuptools"]["dynamic"]
  assert dynamic["dependencies"]["file"] == ["requirements.txt"]
  extras = dynamic["optional-dependencies"]
  assert set(extras) == {"tpu", "gpu", "gpu-cuda12", "gcs", "test"}
  pins = dict(line.split("==") for line in open(os.path.join(REPO, "requirements.txt")) if "==" in line)
  for extra in ("tpu", "gpu", "gpu-cuda12"):
    (requirement,) = [line.strip() for line in open(os.path.join(REPO, extras[extra]["file"][0])) if "==" in line]
    assert requirement.split("==")[1] == pins["jax"].strip(), f"{extra} extra pins another jax than requirements.txt"


SCRIPTS = _pyproject()["project"]["scripts"]


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_script_prints_usage_with_an_example(script):
  module = SCRIPTS[script].split(":")[0]
  proc = _run(sys.executable, "-m", module, "--help", timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "usage" in proc.stdout.lower() and "example" in proc.stdout.lower(), proc.stdout
  # The documented script form prints the same usage.
  script_path = PACKAGE / (module.split(".", 1)[1].replace(".", "/") + ".py")
  same = _run(sys.executable, str(script_path), "--help", timeout=120)
  assert same.returncode == 0 and same.stdout == proc.stdout


FLAG_TOOL_BAD_ARGS = {
  "MaxLite/checkpoint_info.py": ["--stepp=3", "x"],
  "MaxLite/convert_hf.py": ["to_maxlite", "--hf_pat=x"],
  "MaxLite/launch_local.py": ["--num_processes=two", BASE_YML],
  "MaxLite/multihost_runner.py": ["--COMMAND=echo"],
  "MaxLite/multihost_job.py": ["--TPU_TYPE=v5p-8"],
  "MaxLite/prepare_data.py": ["--output_dir=x"],
  "MaxLite/train_tokenizer.py": ["--input=x", "--vocab_size=many"],
  "MaxLite/train.py": [BASE_YML, "--stepz=3"],
  "MaxLite/decode.py": [BASE_YML, "--prompt=hi"],
  "MaxLite/train_compile.py": [BASE_YML, "--compile_topology=v5p-8"],
}


@pytest.mark.parametrize("tool", sorted(FLAG_TOOL_BAD_ARGS))
def test_a_bad_command_line_is_one_error_line_and_exit_2(tool):
  proc = _run(sys.executable, tool, *FLAG_TOOL_BAD_ARGS[tool], timeout=120)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
  assert "--help" in lines[0]


@pytest.mark.slow
def test_installed_package_trains_outside_the_checkout(tmp_path):
  """`pip install .` (not editable) ships configs, corpus and tokenizers inside the package, and the README's
  `maxlite-train configs/base.yml` finds the shipped config by that name in a directory that has none."""
  site = tmp_path / "site"
  install = _run(
    sys.executable,
    "-m",
    "pip",
    "install",
    "--quiet",
    "--no-deps",
    "--no-build-isolation",
    "--target",
    str(site),
    REPO,
    timeout=600,
  )
  assert install.returncode == 0, install.stderr[-3000:]
  config = site / "MaxLite" / "configs" / "base.yml"
  assert config.is_file() and (site / "MaxLite" / "assets" / "tokenizer" / "maxlite_sp8k.model").is_file()
  shipped = [
    "configs/tpu/v5p/32b.yml",
    "assets/tokenizer/chat/tokenizer.json",
    "assets/chat/chatml.jinja",
    "assets/post_training/chats-train.jsonl",
  ]
  assert all((site / "MaxLite" / path).is_file() for path in shipped), shipped
  env = dict(ENV, PYTHONPATH=str(site))
  where = _run(sys.executable, "-c", "import MaxLite; print(MaxLite.__file__)", cwd=tmp_path, env=env)
  assert where.stdout.strip() == str(site / "MaxLite" / "__init__.py"), where
  run = _run(
    sys.executable,
    "-m",
    "MaxLite.train",
    "configs/base.yml",
    "model_name=tiny",
    "steps=2",
    "max_target_length=64",
    "eval_interval=-1",
    "enable_tensorboard=false",
    "jax_cache_dir=",
    f"base_output_directory={tmp_path / 'out'}",
    "run_name=installed",
    cwd=tmp_path,
    env=env,
    timeout=600,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  assert (tmp_path / "out" / "installed" / "metrics.jsonl").read_text().count("\n") == 2

"""Each tool run without its config names its own usage (the documented first command, run as written, is
end_to_end/test_readme_first_steps.py's; .ci/run runs it for its full 200 steps and checks that it learns)."""

import os
import re
import subprocess
import sys

import pytest
from support.config import FAST_COMPILE, REPO

# (module, console script, its entry function, what its usage line starts with after the tool's name)
TOOLS_TAKING_A_CONFIG = [
  ("decode", "maxlite-decode", "main", "CONFIG.yml load_parameters_path=CKPT/STEP [key=value ...]"),
  ("train_compile", "maxlite-compile", "main", "CONFIG.yml compile_topology=TOPOLOGY [key=value ...]"),
  ("plan", "maxlite-plan", "main", "CONFIG.yml model_name=llama2-70b compile_topology=v5p-128 [key=value ...]"),
  ("train", "maxlite-train", "script", "CONFIG.yml [key=value ...]"),
  (
    "launch_local",
    "maxlite-launch-local",
    "main",
    "[--num_processes=N] [--devices_per_process=M] [--show_all_processes] CONFIG.yml",
  ),
]


def _forms(module: str, console: str, entry: str) -> list[tuple[list[str], str]]:
  """(command, the name it should call itself) for the script, `python -m` and console-script forms; the console
  script is run as its installed wrapper does (argv[0] its name, then the entry), so no install is needed."""
  wrapper = f"import sys; sys.argv[0] = {console!r}; from MaxLite.{module} import {entry}; sys.exit({entry}())"
  return [
    ([sys.executable, os.path.join("MaxLite", f"{module}.py")], f"{module}.py"),
    ([sys.executable, "-m", f"MaxLite.{module}"], f"{module}.py"),
    ([sys.executable, "-c", wrapper], console),
  ]


@pytest.mark.parametrize(
  "command, name, usage",
  [
    (cmd, name, usage)
    for module, console, entry, usage in TOOLS_TAKING_A_CONFIG
    for cmd, name in _forms(module, console, entry)
  ],
  ids=[f"{module}-{form}" for module, *_ in TOOLS_TAKING_A_CONFIG for form in ("script", "module", "console")],
)
def test_no_config_prints_the_usage_of_the_tool_that_was_run(command, name, usage):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
  proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
  assert errors[0].startswith(f"error: usage: {name} {usage}"), errors[0]
  assert errors[0].endswith(f"(see {name} --help)"), errors[0]


_HELP_WITHOUT_JAX = """
import importlib, sys
for tool in sys.argv[1:]:
  sys.argv = [tool + ".py", "--help"]
  try:
    importlib.import_module("MaxLite." + tool).main()
  except SystemExit:
    pass
  late = [name for name in ("jax", "flax", "orbax.checkpoint", "grain") if name in sys.modules]
  print(tool, *late, file=sys.stderr)
"""


def test_every_tool_answers_help_without_starting_jax():
  """--help reads a docstring and the schema: a command whose module imported its library at the top (train.py,
  decode.py, plan.py, checkpoint_info.py did) started jax and flax first, 1.1 s for `train.py --help` on 2 cores."""
  tools = sorted(name.removesuffix(".py") for name in os.listdir(os.path.join(REPO, "MaxLite")) if name.endswith(".py"))
  tools.remove("__init__")
  proc = subprocess.run(
    [sys.executable, "-c", _HELP_WITHOUT_JAX, *tools], cwd=REPO, capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stderr.split("\n")[:-1] == tools, proc.stderr[-2000:]


def test_convert_hf_help_names_every_architecture_it_reads():
  """--help listed Llama/Mistral/Qwen only while Gemma 3, DeepSeek-V3 and Mixtral converted too."""
  from MaxLite import convert_hf, models

  squeeze = lambda text: "".join(ch for ch in text.lower() if ch.isalnum())  # noqa: E731
  for architecture in models.architectures():
    assert squeeze(architecture.removesuffix("ForCausalLM")) in squeeze(convert_hf.__doc__), architecture


def test_setup_sh_says_what_it_installs_as_it_goes(tmp_path):
  """pip runs --quiet, so setup.sh said nothing for minutes: each step now names what it installs (each requirement
  file with its package count) before it starts, and the last line before the venv hint how long it took."""
  import shutil

  checkout = tmp_path / "maxlite"
  checkout.mkdir()
  for name in ("setup.sh", "requirements.txt"):
    shutil.copy(os.path.join(REPO, name), checkout)
  shutil.copytree(os.path.join(REPO, "requirements"), checkout / "requirements")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  log = tmp_path / "calls.log"
  python = bin_dir / "python3"  # answers the version probe as 3.12 and logs every other call instead of running it
  python.write_text(f'#!/bin/bash\n[ "$1" = -V ] && {{ echo "Python 3.12.3"; exit 0; }}\necho "$*" >> {log}\nexit 0\n')
  python.chmod(0o755)
  env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
  env |= {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": "python3"}
  proc = subprocess.run(
    ["bash", str(checkout / "setup.sh"), "AOT=0", "TEST=1"], env=env, capture_output=True, text=True, timeout=60
  )
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  packages = sum(1 for line in open(os.path.join(REPO, "requirements.txt")) if "==" in line and line[0] != "#")
  assert lines[0] == "setup.sh: installing into python3 (Python 3.12.3); DEVICE=cpu MODE=pinned AOT=0 TEST=1"
  assert lines[1].startswith("setup.sh: pip: the pinned dependencies")
  assert lines[2].startswith(f"  requirements.txt ({packages} packages: jax ")
  assert lines[3].startswith("  requirements/gcs.txt (") and lines[4].startswith("  requirements/test.txt (")
  assert lines[5].startswith("setup.sh: pip: MaxLite itself, editable")
  assert lines[6].startswith("setup.sh: checking the install")
  assert re.fullmatch(r"setup\.sh: done in 0m \d+s \(dependencies \d+ s, maxlite \d+ s, check \d+ s\)", lines[7])
  # the files listed are installed in one pip call, resolved together
  assert [c for c in log.read_text().splitlines() if c.startswith("-m pip install")][0].startswith(
    "-m pip install --disable-pip-version-check --quiet -r requirements.txt -rrequirements/gcs.txt"
  )

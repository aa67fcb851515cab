"""What MaxLite imports is what its requirement files install.

A module that arrives only through another package (jinja2 came with torch, a test-only dependency) works in every
developer's environment and fails on a fresh `bash setup.sh`. So the package's imports, at module level and inside
functions, are read from its syntax trees and each third-party one must belong to a distribution that
requirements.txt or requirements/*.txt names (an extra such as `jax[tpu]` counts with what that extra installs).
Import names map to distributions through `importlib.metadata`, so `yaml` is PyYAML's and `absl` absl-py's.
"""

import ast
import functools
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

import pytest
from support.config import BASE_YML, REPO
from support.fast_compile import FAST_COMPILE

PACKAGE = pathlib.Path(REPO) / "MaxLite"
RUNTIME = pathlib.Path(REPO) / "requirements.txt"
EXTRAS = sorted((pathlib.Path(REPO) / "requirements").glob("*.txt"))

# Runtime requirements that MaxLite does not import itself, and why each must still be installed. Removing one of
# these lines from requirements.txt fails the test as surely as removing an imported one.
NOT_IMPORTED = {
  "jaxlib": "jax's compiled runtime; jax names it without a pin",
  "tensorboard": "the viewer the README's `tensorboard --logdir outputs` runs on tensorboardX's files",
}

_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9_.\-]*)\s*(?:\[([^\]]*)\])?")


def normalized(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def requirement_lines(path: pathlib.Path) -> list[str]:
  """The requirement lines of a file, comments and blank lines left out."""
  return [line for line in path.read_text().splitlines() if line.split("#", 1)[0].strip()]


def declared_distributions(lines: list[str]) -> set[str]:
  """Distributions the lines install by name, plus what a named extra (`jax[tpu]`) adds to its package."""
  declared = set()
  for line in lines:
    name, extras = _REQUIREMENT.match(line).groups()
    declared.add(normalized(name))
    for extra in (extras or "").split(","):
      declared |= _extra_requirements(name, extra.strip())
  return declared


def _extra_requirements(name: str, extra: str) -> set[str]:
  if not extra:
    return set()
  try:
    requires = importlib.metadata.requires(name) or []
  except importlib.metadata.PackageNotFoundError:
    return set()
  marker = re.compile(rf"""extra\s*==\s*["']{re.escape(extra)}["']""")
  return {normalized(_REQUIREMENT.match(r).group(1)) for r in requires if marker.search(r)}


class _Imports(ast.NodeVisitor):
  """Absolute imports with where they are and whether they run only when a function is called."""

  def __init__(self, where: str):
    self.where, self.depth, self.found = where, 0, []

  def _nested(self, node: ast.AST) -> None:
    self.depth += 1
    self.generic_visit(node)
    self.depth -= 1

  visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _nested

  def visit_Import(self, node: ast.Import) -> None:
    self.found += [(alias.name, f"{self.where}:{node.lineno}", self.depth > 0) for alias in node.names]

  def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
    if node.level == 0 and node.module:
      self.found.append((node.module, f"{self.where}:{node.lineno}", self.depth > 0))


@functools.cache  # the package's files do not change during a test run; every removal case reads them
def third_party_imports(root: pathlib.Path) -> dict[str, list[tuple[str, bool]]]:
  """{top-level module: [('file:line', imported inside a function), ...]} of every absolute import under `root`."""
  found: dict[str, list[tuple[str, bool]]] = {}
  for path in sorted(root.rglob("*.py")):
    visitor = _Imports(str(path.relative_to(REPO)))
    visitor.visit(ast.parse(path.read_text(), str(path)))
    for module, where, lazy in visitor.found:
      top = module.split(".")[0]
      if top not in sys.stdlib_module_names and top not in ("MaxLite", "__future__"):
        found.setdefault(top, []).append((where, lazy))
  return found


@functools.cache
def _owners() -> dict[str, list[str]]:
  """{import name: [distributions]} of this environment (importlib.metadata reads every installed package's files)."""
  return importlib.metadata.packages_distributions()


def undeclared(imports: dict[str, list[tuple[str, bool]]], runtime: set[str], extras: set[str]) -> list[str]:
  """One line per import that a plain install would not satisfy, naming the module and where it is imported.

  A module of a runtime distribution may be imported anywhere. One that only an extra installs (libtpu, with
  jax[tpu]) may only be imported inside the function of its feature, so a plain install still imports MaxLite."""
  owners = _owners()
  problems = []
  for module, places in sorted(imports.items()):
    # Not installed here (libtpu): then the distribution must carry the module's name.
    distributions = {normalized(d) for d in owners.get(module, [])} or {normalized(module)}
    eager = [where for where, lazy in places if not lazy]
    if distributions & runtime:
      continue
    if not distributions & extras:
      problems.append(f"{module} (imported at {places[0][0]}) is in no requirements file ({sorted(distributions)[0]})")
    elif eager:
      problems.append(
        f"{module} (imported at {eager[0]}) comes only with an extra ({sorted(distributions)[0]}), yet is imported "
        "at module level, so a plain install cannot import that file"
      )
  return problems


def missing_unimported(runtime_lines: list[str]) -> list[str]:
  """The NOT_IMPORTED requirements that no line of requirements.txt installs."""
  declared = declared_distributions(runtime_lines)
  return [
    f"{name} ({why}) is in no line of requirements.txt" for name, why in NOT_IMPORTED.items() if name not in declared
  ]


def problems_with(runtime_lines: list[str]) -> list[str]:
  extras = declared_distributions([line for path in EXTRAS for line in requirement_lines(path)])
  imports = third_party_imports(PACKAGE)
  return undeclared(imports, declared_distributions(runtime_lines), extras) + missing_unimported(runtime_lines)


def test_every_third_party_import_is_declared():
  problems = problems_with(requirement_lines(RUNTIME))
  assert not problems, "\n".join(problems)


def test_every_runtime_requirement_is_used():
  """A line nobody imports and nobody explains is either dead or a reason nobody wrote down."""
  owners = _owners()
  imported = {normalized(d) for module in third_party_imports(PACKAGE) for d in owners.get(module, [module])}
  unused = [
    line
    for line in requirement_lines(RUNTIME)
    if (name := normalized(_REQUIREMENT.match(line).group(1))) not in imported and name not in NOT_IMPORTED
  ]
  assert not unused, f"requirements.txt lines that MaxLite never imports (explain them in NOT_IMPORTED): {unused}"


@pytest.mark.slow
@pytest.mark.parametrize("line", requirement_lines(RUNTIME))
def test_removing_a_runtime_requirement_is_caught(line):
  problems = problems_with([other for other in requirement_lines(RUNTIME) if other != line])
  name = normalized(_REQUIREMENT.match(line).group(1))
  owners = _owners()
  modules = {normalized(m) for m, dists in owners.items() if name in {normalized(d) for d in dists}} | {name}
  named = [p for p in problems if normalized(p.split()[0]) in modules]
  assert named, f"removing '{line}' from requirements.txt went unnoticed (or named something else: {problems})"


def test_an_undeclared_import_is_named():
  imports = {"jinja2": [("MaxLite/data/chat.py:28", False)], "not_a_real_module": [("MaxLite/x.py:3", True)]}
  problems = undeclared(imports, declared_distributions(["numpy==2.4.6"]), set())
  assert problems == [
    "jinja2 (imported at MaxLite/data/chat.py:28) is in no requirements file (jinja2)",
    "not_a_real_module (imported at MaxLite/x.py:3) is in no requirements file (not-a-real-module)",
  ]


def test_an_extra_counts_with_what_it_installs_inside_functions_only():
  extras = declared_distributions(["jax[tpu]==0.10.2"])
  assert {"jax", "libtpu"} <= extras
  inside = {"libtpu": [("MaxLite/parallel/topologies.py:171", True)]}
  assert not undeclared(inside, {"numpy"}, extras)
  at_top = {"libtpu": [("MaxLite/parallel/topologies.py:171", True), ("MaxLite/x.py:1", False)]}
  assert undeclared(at_top, {"numpy"}, extras) == [
    "libtpu (imported at MaxLite/x.py:1) comes only with an extra (libtpu), yet is imported at module level, so a "
    "plain install cannot import that file"
  ]


@pytest.mark.slow
def test_a_plain_training_run_loads_no_optional_library(tmp_path):
  """A run on local files (one step, tensorboard and a checkpoint written) loads the train loop and the input
  pipeline; the chat-template engine, the test-only packages and the cloud clients stay unloaded until a feature asks
  for them (tensorboardX imported google-cloud-storage for its gs:// writer: 0.15 s at every start)."""
  optional = ("jinja2", "torch", "transformers", "gcsfs", "google.cloud.storage", "fsspec")
  argv = [BASE_YML, "model_name=tiny", "steps=1", f"base_output_directory={tmp_path}", "run_name=r", "jax_cache_dir="]
  code = (
    "import sys; from MaxLite.training.start import run;"
    f"run({argv!r}); print('loaded:', *(m for m in {optional!r} if m in sys.modules))"
  )
  # One device, as a laptop run has (the suite's 8 simulated devices would only make the compile longer).
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert (tmp_path / "r" / "checkpoints" / "1").is_dir() and list((tmp_path / "r" / "tensorboard").iterdir())
  assert proc.stdout.splitlines()[-1] == "loaded:", f"a plain training run {proc.stdout.splitlines()[-1]}"


@pytest.mark.slow
def test_a_gs_tensorboard_writer_after_a_local_one_in_one_process_can_write_to_the_bucket():
  """The local writer's import left tensorboardX without google-cloud-storage; a gs:// writer later in the same
  process (a notebook, a test) gets it back instead of tensorboardX's "must be installed" ImportError."""
  code = (
    "import sys; from MaxLite.training import metrics;"
    "metrics._summary_writer(False); from tensorboardX import record_writer; print(record_writer.GCS_ENABLED);"
    "metrics._summary_writer(True); import google.cloud.storage as gcs;"
    "print(record_writer.GCS_ENABLED, record_writer.storage is gcs)"
  )
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.split() == ["False", "True", "True"]

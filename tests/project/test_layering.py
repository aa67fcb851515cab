"""Imports flow one way: commands -> planning -> aot -> inference, training -> objectives -> checkpoint -> models,
data -> layers -> parallel, runtime, launch -> config -> storage -> cli. Read from the source (every import statement,
those inside functions too, since a lazy import is still a dependency), so a circle or an import that runs back up
fails here instead of being found later in a drawing of the package.
"""

from __future__ import annotations

import ast
import os
import pathlib

from support.config import REPO

PACKAGE = pathlib.Path(REPO, "MaxLite")
# Higher imports lower, never the reverse; a top-level module of the package is a command (imported by nothing).
RANKS = {
  "cli": 0,
  "storage": 1,
  "config": 2,
  "parallel": 3,
  "runtime": 3,
  "launch": 3,
  "layers": 4,
  "data": 4,
  "models": 5,
  "checkpoint": 6,
  "objectives": 7,
  "training": 8,
  "inference": 9,
  "aot": 9,
  "planning": 10,
}
COMMANDS = 11


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
  parts = list(path.relative_to(root).with_suffix("").parts)
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_edges(root: pathlib.Path) -> list[tuple[str, str, str, int]]:
  """(importer, imported module, the name taken from it or "" for the module itself, line) for every MaxLite import
  under root/MaxLite."""
  files = {_module_name(p, root): p for p in (root / "MaxLite").rglob("*.py")}

  def known(name: str) -> str:
    while name not in files and "." in name:
      name = name.rsplit(".", 1)[0]
    return name

  edges = []
  for module, path in files.items():
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        edges += [(module, known(a.name), "", node.lineno) for a in node.names if a.name.startswith("MaxLite")]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = package.split(".")[: len(package.split(".")) - node.level + 1]
          base = ".".join(parts + ([base] if base else []))
        if base.startswith("MaxLite"):
          for alias in node.names:
            target = f"{base}.{alias.name}"
            if target in files:  # a module: `from MaxLite.x import y` with y a file of x
              edges.append((module, target, "", node.lineno))
            else:
              edges.append((module, known(base), alias.name, node.lineno))
  return [e for e in edges if e[0] != e[1]]


def _group(module: str) -> str:
  parts = module.split(".")
  if len(parts) == 1:
    return "MaxLite"  # the package's face
  return parts[1] if parts[1] in RANKS else "commands"


def _rank(group: str) -> int:
  return RANKS.get(group, COMMANDS)


def cycles(edges: list[tuple[str, str, str, int]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  graph: dict[str, set[str]] = {}
  for a, b, _, _ in edges:
    graph.setdefault(a, set()).add(b)
    graph.setdefault(b, set())
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def layering_faults(root: pathlib.Path) -> list[str]:
  edges = import_edges(root)
  faults = [f"circle: {' <-> '.join(c)}" for c in cycles(edges)]
  for a, b, name, line in edges:
    ga, gb = _group(a), _group(b)
    where = f"{a.replace('.', '/')}.py:{line} imports {b}{'.' + name if name else ''}"
    if gb == "commands":
      faults.append(f"{where}: a command, which nothing imports (move what it shares into a subpackage)")
    elif ga not in ("MaxLite", gb) and _rank(ga) <= _rank(gb):
      faults.append(f"{where}: {ga}/ may not import {gb}/ (the order is in this file's docstring)")
    if name.startswith("_") and b != a:
      faults.append(f"{where}: a private name imported across modules")
  return faults


def test_imports_flow_one_way_without_circles():
  faults = layering_faults(pathlib.Path(REPO))
  assert not faults, "\n".join(faults)


def test_the_top_level_holds_only_thin_commands():
  """A command is a shell around a library function: its body lives in a subpackage."""
  for path in sorted(PACKAGE.glob("*.py")):
    if path.name == "__init__.py":
      continue
    lines = len(path.read_text().splitlines())
    assert lines <= 80, f"MaxLite/{path.name} has {lines} lines: a command stays a thin shell (under ~80)"
    assert "def main" in path.read_text() or "__main__" in path.read_text(), f"MaxLite/{path.name} is not a command"


def test_the_check_finds_a_circle_an_upward_import_and_a_private_name(tmp_path):
  """The same check on a small package that breaks each rule once."""
  files = {
    "MaxLite/__init__.py": "",
    "MaxLite/train.py": "def main():\n  pass\n",
    "MaxLite/config/__init__.py": "",
    "MaxLite/config/a.py": "from MaxLite.config import b\n",
    "MaxLite/config/b.py": "def f():\n  from MaxLite.config import a\n",
    "MaxLite/storage/__init__.py": "from MaxLite.layers import x\n",
    "MaxLite/layers/__init__.py": "",
    "MaxLite/layers/x.py": "from MaxLite.layers.y import _hidden\nfrom MaxLite import train\n",
    "MaxLite/layers/y.py": "_hidden = 1\n",
  }
  for name, text in files.items():
    os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
    (tmp_path / name).write_text(text)
  faults = "\n".join(layering_faults(tmp_path))
  assert "circle: MaxLite.config.a <-> MaxLite.config.b" in faults
  assert "MaxLite/storage.py:1 imports MaxLite.layers.x: storage/ may not import layers/" in faults
  assert "imports MaxLite.layers.y._hidden: a private name" in faults
  assert "imports MaxLite.train: a command, which nothing imports" in faults

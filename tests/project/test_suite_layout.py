"""The tests' own layout: tests/ mirrors the package (a folder per MaxLite subpackage, plus commands/ for the
command-line tools run whole, project/ for repo-wide checks and support/ for what test files share), every test file's
name is unique (pytest's prepend import mode imports each by its bare name), and no file imports a test file or
conftest.py: what files share lives in tests/support/. Read from the source, imports inside functions included."""

import ast
import collections
import pathlib

from support.config import REPO

TESTS = pathlib.Path(REPO, "tests")
END_TO_END = pathlib.Path(REPO, "end_to_end")
NOT_SUBPACKAGES = {"commands", "project", "support"}


def test_no_file_imports_a_test_file_or_conftest():
  files = sorted(TESTS.rglob("*.py")) + sorted(END_TO_END.glob("test_*.py"))
  found = []
  for path in files:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
      else:
        continue
      top = [name.split(".")[0] for name in names]
      found += [
        f"{path.relative_to(REPO)}:{node.lineno} imports {t}" for t in top if t.startswith("test_") or t == "conftest"
      ]
  assert not found, "import it from tests/support/ instead:\n" + "\n".join(found)


def test_tests_mirror_the_package_with_unique_file_names():
  subpackages = {p.parent.name for p in pathlib.Path(REPO, "MaxLite").glob("*/__init__.py")}
  folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__" and not p.name.startswith(".")}
  assert folders - subpackages - NOT_SUBPACKAGES == set(), "a folder of tests/ is named for no MaxLite subpackage"
  assert [p.name for p in TESTS.glob("test_*.py")] == [], "a test file directly in tests/: it belongs in a folder"
  assert [str(p.relative_to(REPO)) for p in TESTS.rglob("__init__.py") if p.parent.name != "support"] == []
  names = collections.Counter(p.name for p in [*TESTS.rglob("test_*.py"), *END_TO_END.glob("test_*.py")])
  assert [name for name, count in names.items() if count > 1] == [], "two test files of one name"

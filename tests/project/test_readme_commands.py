"""Every command a new user copies: the README's fenced `python MaxLite/...` / `maxlite-...` command lines
and each tool's --help example, so a renamed tool, flag or config key fails CI.

What runs how, to stay well under a minute on 2 cores:
- every tool's `--help` runs once (all at once, cached for the module). Each README command's tool must exist (the
  script, or the console script in pyproject.toml), its `--flag`s must appear in that tool's --help, and its
  `key=value`s, where the tool takes them, must load through the config loader (keys of configs/base.yml, values of
  their type, no renamed-key warning). Commands nested in `--COMMAND="..."` are checked the same way.
- the "Your own data" commands `prepare_data.py` and `train_tokenizer.py` run for real, as written, in a temporary
  directory on a few documents (the tokenizer with --vocab_size 400: 8192 pieces need more text than a test has).
- everything else (train.py, decode.py, convert_hf.py, train_compile.py, plan.py, launch_local.py, checkpoint_info.py,
  the pod scripts) gets only the --help and key checks: it needs a TPU, gcloud, a download or a checkpoint, or
  compiles for longer than this file may take. `.ci/run` runs the README's first two commands for real, and
  the end_to_end/test_readme_*.py files run every command the README shows.
"""

from __future__ import annotations

import ast
import functools
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest
from support.config import BASE_YML, FAST_COMPILE, REPO

from MaxLite.config import loader

README = pathlib.Path(REPO, "README.md").read_text()
SCRIPTS: dict[str, str] = tomllib.loads(pathlib.Path(REPO, "pyproject.toml").read_text())["project"]["scripts"]
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FAST_COMPILE)
# Tokens that end one shell command and start the next.
SEPARATORS = {"&&", "||", ";", "|", ">", ">>", "2>&1"}


def _script_of(console_script: str) -> str:
  """`maxlite-train` -> `MaxLite/train.py`, the file the console script's module is."""
  module = SCRIPTS[console_script].split(":")[0]
  return module.replace(".", "/") + ".py"


TOOLS = sorted(_script_of(name) for name in SCRIPTS)


def fenced_lines(text: str) -> list[str]:
  """The lines of the fenced code blocks, `\\` continuations joined."""
  inside, lines, pending = False, [], ""
  for line in text.splitlines():
    if line.lstrip().startswith("```"):
      inside, pending = not inside, ""
      continue
    if not inside:
      continue
    if line.rstrip().endswith("\\"):
      pending += line.rstrip()[:-1] + " "
      continue
    lines.append(pending + line)
    pending = ""
  return lines


def commands_in(line: str) -> list[tuple[str, list[str]]]:
  """(tool as typed, its arguments) for each `python MaxLite/X.py` or `maxlite-X` command on a shell line, the ones
  inside a quoted `--COMMAND=...` included. `...` and `[`/`]` (the README's "and so on", "optional") are dropped."""
  tokens = shlex.split(line, comments=True)
  found = []
  for i, token in enumerate(tokens):
    script = re.fullmatch(r"(?:.*/)?(MaxLite/\w+\.py)", token)
    if script and i and pathlib.PurePath(tokens[i - 1]).name.startswith("python"):
      tool = script.group(1)
    elif re.fullmatch(r"maxlite-[\w-]+", token):
      tool = token
    else:
      continue
    args = []
    for arg in tokens[i + 1 :]:
      if arg in SEPARATORS:
        break
      arg = arg.removeprefix("[")
      if "=[" not in arg:  # key=[a,b] is a list value, not the end of an optional part
        arg = arg.removesuffix("]")
      if arg and arg != "...":
        args.append(arg)
    found.append((tool, args))
  for token in tokens:
    value = token.split("=", 1)[-1]
    if "=" in token and " " in value and ("MaxLite/" in value or "maxlite-" in value):
      found += commands_in(value)
  return found


README_COMMANDS = [command for line in fenced_lines(README) for command in commands_in(line)]


@functools.cache
def help_texts() -> dict[str, str]:
  """Each tool's --help output, the tools run all at once: most of their time is importing."""
  procs = {
    tool: subprocess.Popen(
      [sys.executable, tool, "--help"],
      cwd=REPO,
      env=ENV,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      stdin=subprocess.DEVNULL,
      text=True,
    )
    for tool in TOOLS
  }
  texts = {}
  for tool, proc in procs.items():
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"{tool} --help: {err[-2000:]}"
    texts[tool] = out
  return texts


def _mentions(text: str, word: str) -> bool:
  return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def test_the_readme_finds_commands_in_its_code_blocks():
  """The parser sees what a reader sees: every tool the README shows in a code block, and the nested pod commands."""
  tools = {tool for tool, _ in README_COMMANDS}
  assert {"MaxLite/train.py", "MaxLite/decode.py", "MaxLite/convert_hf.py", "MaxLite/multihost_job.py"} <= tools
  nested = [args for tool, args in README_COMMANDS if tool == "MaxLite/train.py" and "dcn_data_parallelism=2" in args]
  assert nested, "the train.py command inside multihost_job.py's --COMMAND was not found"


def test_every_tool_and_console_script_the_readme_names_exists():
  missing = [path for path in sorted(set(re.findall(r"MaxLite/[\w/]+\.py", README))) if not os.path.isfile(path)]
  scripts = sorted(set(re.findall(r"(?<![\w/.-])maxlite-[a-z][a-z-]*[a-z]", README)))
  unknown = [name for name in scripts if name not in SCRIPTS]
  assert not missing and not unknown, f"README names files {missing} and console scripts {unknown} that do not exist"
  assert all(os.path.isfile(os.path.join(REPO, _script_of(name))) for name in SCRIPTS)


def _check_command(tool: str, args: list[str], helps: dict[str, str], capsys: pytest.CaptureFixture) -> list[str]:
  """What is wrong with one README command: an unknown tool, a flag its --help lacks, a key the loader refuses."""
  script = _script_of(tool) if tool in SCRIPTS else tool
  if script not in helps:
    return [f"{tool}: no such tool (not a console script of pyproject.toml, or no {script})"]
  text, errors = helps[script], []
  for arg in args:
    if arg.startswith("--") and not _mentions(text, arg.split("=", 1)[0]):
      errors.append(f"{tool}: {arg.split('=', 1)[0]} is not in its --help")
  overrides = [a for a in args if re.match(r"[A-Za-z_][\w.]*=", a)]
  configs = [a for a in args if a.endswith((".yml", ".yaml")) and not a.startswith("-")]
  for config in configs:
    if not os.path.isfile(os.path.join(REPO, config)):
      errors.append(f"{tool}: {config} does not exist")
  if overrides and "key=value" not in text:
    errors.append(f"{tool} takes no key=value, but the README gives it {overrides}")
  elif overrides and not errors:
    capsys.readouterr()
    try:
      loader.load_raw([configs[0] if configs else BASE_YML, *overrides])
    except Exception as e:  # the loader's one-line ConfigError: the README's keys or values are wrong
      errors.append(f"{tool}: {e}")
    warned = capsys.readouterr().err.strip()
    if warned:
      errors.append(f"{tool}: {warned}")
  return errors


@pytest.mark.slow
def test_readme_commands_use_only_flags_and_keys_their_tools_accept(capsys):
  helps = help_texts()
  errors = [error for tool, args in README_COMMANDS for error in _check_command(tool, args, helps, capsys)]
  assert not errors, "\n".join(errors)


def test_the_checks_catch_a_renamed_flag_key_or_tool(capsys):
  """The command checks fail for what they are there to catch (the README itself has none of these)."""
  helps = help_texts()
  assert _check_command("MaxLite/prepare_data.py", ["--input_files=x"], helps, capsys)
  assert _check_command("MaxLite/train.py", ["configs/base.yml", "stepz=3"], helps, capsys)
  assert _check_command("MaxLite/train.py", ["configs/base.yml", "steps=many"], helps, capsys)
  assert _check_command("MaxLite/train.py", ["configs/base.yml", "max_prefill_length=8"], helps, capsys)  # renamed
  assert _check_command("maxlite-trainer", [], helps, capsys)
  assert _check_command("MaxLite/checkpoint_info.py", ["outputs/r1", "steps=3"], helps, capsys)
  assert not _check_command("MaxLite/train.py", ["configs/base.yml", "steps=3"], helps, capsys)


def test_the_readme_lists_every_model_config():
  """The model_name bullet names `default` and every configs/models/*.yml, and nothing else."""
  bullet = re.search(r"- `model_name=NAME` overlays(.*?)Command-line", README, re.S)
  assert bullet, "the README's model_name bullet is gone"
  listed = set(re.findall(r"`([\w.-]+)`", bullet.group(1)))
  shipped = {name.removesuffix(".yml") for name in os.listdir(os.path.join(REPO, "configs", "models"))}
  assert listed == shipped | {"default"}, (
    f"missing {sorted((shipped | {'default'}) - listed)}, extra {sorted(listed - shipped - {'default'})}"
  )


def _examples(help_text: str) -> list[str]:
  """The command lines of a --help text's Example paragraph, as printed (continuations not joined): the lines that
  start a command and the lines a `\\` continues."""
  lines, inside, continued = [], False, False
  for line in help_text.splitlines():
    head = re.match(r"\s*Example( \([^)]*\))?:", line)
    if head:
      inside, line = True, line[head.end() :]
    elif not line.strip():
      inside = False
    is_command = re.match(r"\s*(python3? |maxlite-)", line) is not None
    if inside and (is_command or continued):
      lines.append(line)
    elif inside and line.strip() and not head:
      inside = False
    continued = inside and line.rstrip().endswith("\\")
  return lines


# The arguments by which a tool writes: a file or folder there is created or replaced.
OUTPUT_ARG = re.compile(r"-*(\w*output\w*|\w*prefix|compiled_trainstep_file)$")


def test_help_examples_write_nothing_shipped_and_keep_their_line_breaks():
  """Pasting a --help example must not overwrite the shipped files (configs/, assets/), and an example over several
  lines is printed over several lines: a squashed `\\` leaves the next line's indent in the middle of the command."""
  problems = []
  for tool, text in help_texts().items():
    examples = _examples(text)
    if not examples:
      problems.append(f"{tool}: --help has no example")
    for line in examples:
      if re.search(r"\S {2,}(--|[A-Za-z_]\w*=)", line.split("#")[0]):
        problems.append(f"{tool}: a continuation was squashed into {line.strip()!r}")
    joined = re.sub(r"\\\n", " ", "\n".join(examples))
    for line in joined.splitlines():
      tokens = shlex.split(line)
      for i, token in enumerate(tokens):
        name, has_value, value = token.partition("=")
        if not OUTPUT_ARG.match(name):
          continue
        target = value if has_value else (tokens[i + 1] if i + 1 < len(tokens) else "")
        if re.match(r"(\./)?(assets|configs)(/|$)", target):
          problems.append(f"{tool}: its example writes {name} {target}, among the shipped files")
  assert not problems, "\n".join(problems)


def test_module_docstrings_with_a_line_continuation_are_raw():
  """A `\\` at a line's end in a plain docstring is Python's line continuation: --help would print the example on one
  line. Docstrings that show one must be r-strings."""
  squashed = []
  for path in sorted(pathlib.Path(REPO, "MaxLite").rglob("*.py")):
    source = path.read_text()
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
      segment = ast.get_source_segment(source, body[0]) or ""
      if "\\\n" in segment and not segment.lower().startswith("r"):
        squashed.append(str(path.relative_to(REPO)))
  assert not squashed, squashed

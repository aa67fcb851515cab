"""The files written from the schema: configs/base.yml, MaxLite/config/config_keys.py and the README's tables of keys.

A key is declared once, as its pydantic Field (keys_model.py, keys_train.py, keys_job.py, or the group a capability
declares through key_groups.py): its type, default, bounds, one-line description and whether a checkpoint saves it.
These three files repeat what the Fields say for a reader of YAML, an editor or type checker, and a reader of the
README, so they are written from the schema rather than by hand, and tests/config/test_schema.py fails, naming the
stale file and this command, when one differs from what would be written:

  python -m MaxLite.config.generate          # rewrite the stale files
  python -m MaxLite.config.generate --check  # name them and exit 1, change nothing

The output is final as written (config_keys.py is already as `ruff format` leaves it), so there is no second step.
Nothing here imports jax.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import sys
import textwrap
import types
import typing
from collections.abc import Sequence
from typing import Any

import pydantic

from MaxLite.config import schema
from MaxLite.config.keys_derived import Derived

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE_YML_PATH = os.path.join(REPO, "configs", "base.yml")
CONFIG_KEYS_PATH = os.path.join(REPO, "MaxLite", "config", "config_keys.py")
README_PATH = os.path.join(REPO, "README.md")
COMMAND = "python -m MaxLite.config.generate"
# The README's part that is written here; everything outside the markers is the README's own.
README_BEGIN = "<!-- keys:begin"
README_BEGIN_LINE = f"{README_BEGIN} (written from the schema by `{COMMAND}`: edit the Fields, not these tables) -->"
README_END = "<!-- keys:end -->"

_WIDTH = 120  # the repository's line length (pyproject.toml's ruff line-length)
_COMMENT_COLUMN = 34  # where base.yml's comments start, unless the key and value are longer
_FEWEST_FIRST_LINE = 30  # a comment with less room than this beside its value starts on the next line
_LONGEST_FLOW = 60  # a list written inline up to this long `key: [...]`, else one item a line


# ---------------------------------------------------------------- configs/base.yml


def yaml_value(value: Any) -> str:
  """A default as YAML writes it, read back (yaml.safe_load, and the loader's TextLoader with the key's type) as the
  same value of the same type: strings always quoted (YAML 1.1 would read `3.10` or `no` otherwise), floats with a
  dot and a signed exponent (YAML 1.1 reads `1e-05` as a string)."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, int):
    return str(value)
  if isinstance(value, float):
    if math.isnan(value):
      return ".nan"
    if math.isinf(value):
      return ".inf" if value > 0 else "-.inf"
    text = repr(value)
    if "e" in text:
      mantissa, exponent = text.split("e")
      text = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{int(exponent):+d}"
    return text
  if isinstance(value, str):
    return json.dumps(value, ensure_ascii=False)
  if isinstance(value, (list, tuple)):
    return "[" + ", ".join(yaml_value(v) for v in value) + "]"
  raise TypeError(f"no YAML spelling for a default of type {type(value).__name__}: {value!r}")


def _wrapped(text: str, first: int, rest: int) -> list[str]:
  """`text` in lines that fit _WIDTH after `first` columns (the first line) and `rest` (the others), joined back with
  single spaces to the same text (tests/config/test_schema.py reads base.yml's comments so)."""
  lines = textwrap.wrap(
    text,
    _WIDTH,
    initial_indent=" " * first,
    subsequent_indent=" " * rest,
    break_long_words=False,
    break_on_hyphens=False,
  )
  lines = [lines[0][first:], *(line[rest:] for line in lines[1:])]
  if " ".join(lines) != text:
    raise ValueError(f"a description or docstring must be single-spaced text (base.yml joins its lines so): {text!r}")
  return lines


def _commented(head: str, text: str) -> list[str]:
  """`head` (a `key: value` line) with `text` as its comment: beside it from column _COMMENT_COLUMN (or two spaces
  after a longer head), continued on lines of their own at that column."""
  column = max(_COMMENT_COLUMN, len(head) + 2)
  continuation = " " * _COMMENT_COLUMN + "# "
  if _WIDTH - column - 2 < _FEWEST_FIRST_LINE:  # too little room beside the value: the comment goes below it
    return [head, *(continuation + line for line in _wrapped(text, len(continuation), len(continuation)))]
  first, *rest = _wrapped(text, column + 2, len(continuation))
  return [f"{head.ljust(column)}# {first}", *(continuation + line for line in rest)]


def _key_lines(key: str) -> list[str]:
  field = schema.FIELDS[key]
  value = yaml_value(field.default)
  if " #" in value:
    raise ValueError(f"{key}: a default holding ' #' would read as a comment in base.yml")
  inline = f"{key}: {value}"
  if not isinstance(field.default, list) or not field.default or len(inline) <= _LONGEST_FLOW:
    return _commented(inline, field.description)
  # A long list: one item a line, each with its note where the Field gives one (json_schema_extra's row_notes, by the
  # item's first entry), so logical_axis_rules reads as the table it is.
  extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
  notes = extra.get("row_notes", {})
  lines = _commented(f"{key}: [", field.description)
  for item in field.default:
    note = notes.get(item[0]) if isinstance(item, list) and item else None
    row = f"    {yaml_value(item)},"
    lines += _commented(row, note) if note else [row]
  return [*lines, "  ]"]


def _group_header(group: type[pydantic.BaseModel]) -> list[str]:
  """A group's banner and its docstring, each paragraph as comment lines."""
  lines = [f"# {'-' * 64} {group.__name__}"]
  for paragraph in (group.__doc__ or "").strip().split("\n\n"):
    lines += ["# " + line for line in _wrapped(" ".join(paragraph.split()), 2, 2)]
  return lines


BASE_YML_INTRO = f"""\
# MaxLite base config: every key, its default, one line on what it does.
# Override any key on the command line as key=value (typed by the config schema), inherit with
# `base_config: other.yml`, and pick a model with model_name=NAME (overlays configs/models/NAME.yml). Key names follow
# MaxText where it has the concept. `--describe KEY` on any tool says the same, with the key's type and allowed values.
#
# Written from the schema (each key's Field in MaxLite/config/keys_*.py, or in its capability's key group): change the
# Field and run `{COMMAND}`, not this file; tests/config/test_schema.py fails when the two differ."""


def base_yml() -> str:
  """configs/base.yml as the schema says it: every settable key with its default and description, by group."""
  lines = BASE_YML_INTRO.splitlines()
  for group in schema.GROUPS:
    lines += ["", *_group_header(group)]
    for key in group.model_fields:
      lines += _key_lines(key)
  return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- MaxLite/config/config_keys.py


def _type_source(annotation: Any) -> str:
  """An annotation as Python source in the repository's style (double quotes, no `typing.`)."""
  origin = typing.get_origin(annotation)
  args = typing.get_args(annotation)
  if origin is typing.Union or origin is types.UnionType:
    return " | ".join("None" if a is type(None) else _type_source(a) for a in args)
  if origin is not None:
    name = "Literal" if origin is typing.Literal else origin.__name__
    return f"{name}[{', '.join(_arg_source(a, origin is typing.Literal) for a in args)}]"
  return "Any" if annotation is Any else annotation.__name__


def _arg_source(arg: Any, literal: bool) -> str:
  if literal:
    return json.dumps(arg) if isinstance(arg, str) else repr(arg)
  return "..." if arg is Ellipsis else _type_source(arg)


def _annotation_lines(key: str, annotation: Any) -> list[str]:
  """`key: type` in the class body, split as `ruff format` splits a line too long: the subscript's items on one line
  of their own if they fit, else one a line with a trailing comma."""
  source = _type_source(annotation)
  line = f"  {key}: {source}"
  if len(line) <= _WIDTH or typing.get_origin(annotation) is None:
    return [line]
  head = f"  {key}: {source.split('[', 1)[0]}["
  literal = typing.get_origin(annotation) is typing.Literal
  items = [_arg_source(a, literal) for a in typing.get_args(annotation)]
  if len("    " + ", ".join(items)) <= _WIDTH:
    return [head, "    " + ", ".join(items), "  ]"]
  return [head, *(f"    {item}," for item in items), "  ]"]


CONFIG_KEYS_INTRO = f'''\
"""Written from MaxLite/config/schema.py by `{COMMAND}`: do not edit.

The type of every key a Config holds (lists arrive as tuples), so that `config.steps` is an int to an editor and
a type checker. Declarations only: `Config.__getattr__` still serves every value. tests/config/test_schema.py fails
when this file and the schema differ.
"""

from __future__ import annotations

from typing import Any, Literal


class ConfigKeys:
  """The keys of `Config`, each with its type; schema.py describes each."""'''


def config_keys() -> str:
  """config_keys.py as the schema says it: every key a Config holds, set or derived, with the type it reads as."""
  lines = CONFIG_KEYS_INTRO.splitlines()
  annotations = schema.config_annotations()
  for group in (*schema.GROUPS, Derived):
    lines += ["", f"  # {group.__name__} (`--describe {group.__name__}`)"]
    for key in schema.group_keys(group):
      lines += _annotation_lines(key, annotations[key])
  return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- README.md's tables of keys


def _markdown(text: str) -> str:
  """Plain text as one Markdown table cell shows it: code spans kept; outside them `*`, a word-initial `_` and `<`
  escaped (emphasis, HTML); `|` escaped everywhere (a table's column separator, inside code spans too)."""
  parts = re.split(r"(`[^`]*`)", text)
  for i, part in enumerate(parts):
    if not part.startswith("`"):
      part = part.replace("\\", "\\\\").replace("*", "\\*").replace("<", "&lt;")
      part = re.sub(r"(?<![A-Za-z0-9])_", r"\\_", part)
    parts[i] = part.replace("|", "\\|")
  return "".join(parts)


def _html(text: str) -> str:
  """Plain text inside an HTML element (a <summary>), where Markdown is not read: code spans as <code>."""
  text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
  return re.sub(r"`([^`]*)`", r"<code>\1</code>", text)


def _default_cell(value: Any) -> str:
  text = yaml_value(value)
  if len(text) > _WIDTH:  # logical_axis_rules: its rows are in configs/base.yml
    return f"{len(value)} entries (configs/base.yml)"
  return f"`{text}`".replace("|", "\\|")


def _table(group: type[pydantic.BaseModel]) -> list[str]:
  lines = [
    f"<details><summary><b>{group.__name__}</b>: {_html(schema.group_summary(group))}</summary>",
    "",
    "| key | type | default | description |",
    "|---|---|---|---|",
  ]
  if group is Derived:
    for key, field in schema.DERIVED.items():
      kind = _type_source(field.return_type)
      lines.append(f"| `{key}` | {_markdown(kind)} | (derived) | {_markdown(field.description or '')} |")
  else:
    for key in group.model_fields:
      field = schema.FIELDS[key]
      name = f"`{key}` (saved)" if schema.saved(key) else f"`{key}`"
      kind = _markdown(schema.type_name(key))
      lines.append(f"| {name} | {kind} | {_default_cell(field.default)} | {_markdown(field.description or '')} |")
  return [*lines, "", "</details>", ""]


def readme_tables() -> str:
  """The README's part between its markers: one collapsed table a group, every key with its type, default and
  description (and "(saved)" where a checkpoint saves it), the derived keys last."""
  lines = [README_BEGIN_LINE, ""]
  for group in (*schema.GROUPS, Derived):
    lines += _table(group)
  return "\n".join([*lines, README_END])


def readme(text: str) -> str:
  """The README `text` with its tables of keys as the schema says them (the rest as it is)."""
  begin, end = text.find(README_BEGIN), text.find(README_END)
  if begin < 0 or end < begin:
    raise ValueError(f"README.md has no `{README_BEGIN} -->` ... `{README_END}` markers to write the tables between")
  return text[:begin] + readme_tables() + text[end + len(README_END) :]


# ---------------------------------------------------------------- the command


# Each written file and how its text follows from the schema (and, for the README, from its own text outside the
# markers).
_WRITERS = {
  BASE_YML_PATH: lambda current: base_yml(),
  CONFIG_KEYS_PATH: lambda current: config_keys(),
  README_PATH: lambda current: readme(current or ""),
}


def _read(path: str) -> str | None:
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return f.read()


def stale() -> dict[str, str]:
  """{path relative to the repository: what differs (the first lines of the diff)} for each written file that is not
  what the schema says."""
  out = {}
  for path, writer in _WRITERS.items():
    current = _read(path)
    try:
      text = writer(current)
    except ValueError as e:  # a README without its markers, a description base.yml cannot hold: named as it is
      out[os.path.relpath(path, REPO)] = str(e)
      continue
    if current != text:
      diff = difflib.unified_diff((current or "").splitlines(), text.splitlines(), "now", "written", lineterm="", n=0)
      out[os.path.relpath(path, REPO)] = "\n".join(list(diff)[:12])
  return out


def write() -> list[str]:
  """Rewrite every stale written file; returns their paths relative to the repository. ValueError (before anything
  is written) for a README without its markers."""
  texts = {path: (current, writer(current)) for path, writer in _WRITERS.items() for current in [_read(path)]}
  written = []
  for path, (current, text) in texts.items():
    if current != text:
      with open(path, "w", encoding="utf-8") as f:
        f.write(text)
      written.append(os.path.relpath(path, REPO))
  return written


def main(argv: Sequence[str]) -> int:
  """The command: rewrite the stale files (0), or with --check name them (1 if any)."""
  if any(a in ("-h", "--help") for a in argv):
    print(__doc__)
    return 0
  if "--check" in argv:
    problems = stale()
    for path, diff in problems.items():
      print(f"{path} is stale: run `{COMMAND}`\n{diff}")
    return 1 if problems else 0
  try:
    written = write()
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {', '.join(written)}" if written else "every file written from the schema is up to date")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

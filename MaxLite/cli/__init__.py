"""One command-line convention for every MaxLite tool.

Config tools (train, decode, train_compile) take `CONFIG.yml [key=value ...]` as MaxText's do and run
under absl (its logging and flag parsing). Flag tools (converters, launchers, data tools) take
`--name=value` flags through `FlagParser`. Every tool prints its usage with an example on `--help`,
turns input the user can fix into one `error: ...` line with exit code 2, and exits 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import gc
import logging as std_logging
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import NoReturn, Protocol

from MaxLite.cli.errors import MaxLiteError, UsageError

BAD_INPUT = 2
INTERRUPTED = 130
HELP_FLAGS = ("-h", "--help", "-help", "--helpfull", "--helpshort")

Entry = Callable[[Sequence[str]], "int | None"]


def run(entry: Entry, argv: Sequence[str]) -> int:
  """Calls `entry(argv)` and returns its exit code: a MaxLiteError becomes one `error:` line and 2."""
  try:
    result = entry(list(argv))
  except MaxLiteError as e:
    message = f"error: {e}"
  except KeyboardInterrupt:
    print("\ninterrupted (Ctrl-C): stopped at once; steps since the last checkpoint are not saved", file=sys.stderr)
    return INTERRUPTED
  else:
    return result if isinstance(result, int) else 0
  # Libraries' orphaned tasks and futures (a failed read's siblings) report themselves when collected: let
  # that happen now, so the error line is the last thing the run prints.
  gc.collect()
  print(message, file=sys.stderr, flush=True)
  return BAD_INPUT


class FlagParser(argparse.ArgumentParser):
  """argparse for the flag tools; a bad flag is one `error:` line (a UsageError), not usage + exit."""

  def __init__(self, doc: str, prog: str | None = None):
    super().__init__(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)

  def error(self, message: str) -> NoReturn:
    raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def add_bool_flag(parser: argparse.ArgumentParser, name: str, help_text: str) -> None:
  """`--NAME` alone means true; `--NAME=true|false` is MaxText's spelling."""
  parser.add_argument(name, nargs="?", const=True, default=False, type=_str2bool, help=help_text)


def _str2bool(value: str) -> bool:
  if value.lower() in ("true", "1", "yes"):
    return True
  if value.lower() in ("false", "0", "no"):
    return False
  raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


class KeyDocs(Protocol):
  """What a config tool's --help and --describe read: the config schema (MaxLite.config.schema), passed in by the
  tool because cli/ sits below config/ and may not import it."""

  def keys_help(self, program: str) -> str: ...

  def describe(self, name: str) -> str: ...


def run_config_tool(
  entry: Entry, doc: str, argv: Sequence[str] | None = None, *, keys: KeyDocs | None = None
) -> NoReturn:
  """Runs a `CONFIG.yml [key=value ...]` tool under absl and exits with its code. With `keys`, --help lists the
  config keys by concern and `--describe KEY` prints one."""
  # absl here, not at the top: every MaxLite process imports this package (its errors), the one that only re-execs
  # itself under tcmalloc included.
  from absl import app, flags, logging

  argv = list(sys.argv if argv is None else argv)
  program = os.path.basename(argv[0]) if argv else "maxlite"
  if any(arg in HELP_FLAGS for arg in argv[1:]):
    print(doc.strip())
    if keys is not None:
      print(keys.keys_help(program))
    sys.exit(0)
  describe = [i for i, arg in enumerate(argv) if arg == "--describe" or arg.startswith("--describe=")]
  if describe and keys is not None:
    sys.exit(_describe(keys, argv, describe[0], program))

  def parse_flags(args: list[str]) -> list[str]:
    try:
      return flags.FLAGS(args)
    except flags.Error as e:
      print(f"error: {e}; {os.path.basename(args[0])} takes CONFIG.yml [key=value ...] (see --help)", file=sys.stderr)
      sys.exit(BAD_INPUT)

  def absl_main(args: list[str]) -> None:
    if len(args) < 2:  # no CONFIG.yml (absl has taken its own --flags): this tool's usage, not another's
      program = os.path.basename(args[0])
      print(f"error: usage: {usage_line(doc, program)} (see {program} --help)", file=sys.stderr)
      sys.exit(BAD_INPUT)
    logging.get_absl_handler().addFilter(_quiet_orbax_info)
    logging.get_absl_handler().addFilter(_drop_sibling_read_failures)
    logging.get_absl_handler().setFormatter(ShortFormatter())
    sys.unraisablehook = _drop_closed_loop_noise
    sys.exit(run(entry, args[1:]))

  logging.set_verbosity(logging.INFO)
  app.run(absl_main, argv=argv, flags_parser=parse_flags)
  sys.exit(0)  # app.run exits itself; this only tells type checkers so


class ShortFormatter(std_logging.Formatter):
  """A log line as a user reads it: the time of day and the message (`12:31:07 step 17/200 | loss ...`), where absl's
  own prefix spends 55 characters on date, microseconds, thread id and source line; a warning or error says so."""

  def format(self, record: std_logging.LogRecord) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
    level = f"{record.levelname.lower()}: " if record.levelno >= std_logging.WARNING else ""
    return f"{stamp} {level}{super().format(record)}"


def _describe(keys: KeyDocs, argv: Sequence[str], at: int, program: str) -> int:
  """`--describe KEY` (or GROUP, or all): the schema's word on it; an unknown name is one error line naming the
  closest keys."""
  arg = argv[at]
  names = [arg.split("=", 1)[1]] if "=" in arg else argv[at + 1 : at + 2]
  if not names or not names[0]:
    print(f"error: --describe takes a config key, a group of keys or `all` (see {program} --help)", file=sys.stderr)
    return BAD_INPUT
  return run(lambda _: print(keys.describe(names[0])), [])


def usage_line(doc: str, program: str) -> str:
  """The `Usage:` paragraph of a tool's docstring on one line, named as the user ran it: the docstring spells the
  script form (`python MaxLite/decode.py`), the user may have typed `maxlite-decode` or `python -m`."""
  if "Usage:" not in doc:
    return f"{program} CONFIG.yml [key=value ...]"
  text = doc.split("Usage:", 1)[1].split("Example:", 1)[0]
  words = re.sub(r"\(or: [^)]*\)", "", text).split()
  while words and (words[0] == "python" or words[0].endswith(".py")):
    words.pop(0)
  return " ".join([program, *words])


def _quiet_orbax_info(record: std_logging.LogRecord) -> bool:
  """Orbax logs several INFO lines per save on every process; keep its warnings and errors only, without
  their tracebacks: a failure orbax logs (a background save, a read) reaches MaxLite, which reports it
  as one `error:` line with its cause."""
  if f"{os.sep}orbax{os.sep}" not in record.pathname:
    return True
  record.exc_info, record.exc_text = None, None
  return record.levelno >= std_logging.WARNING


def _drop_sibling_read_failures(record: std_logging.LogRecord) -> bool:
  """When one array of a checkpoint fails to read, orbax gives up on the restore and the other arrays'
  tensorstore reads end in futures nobody awaits; asyncio logs each one (with the whole tensorstore spec)
  when it is collected. The read that failed reaches MaxLite and is reported as one `error:` line."""
  message = record.getMessage()
  return not (record.name == "asyncio" and "exception was never retrieved" in message and "tensorstore_spec" in message)


def _drop_closed_loop_noise(unraisable: sys.UnraisableHookArgs) -> None:
  """After one read of a corrupt checkpoint fails, orbax closes its event loop while tensorstore is
  still finishing the sibling reads; their callbacks then fail harmlessly. Keep the error one line."""
  if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
    return
  sys.__unraisablehook__(unraisable)

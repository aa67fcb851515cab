"""Reading a checkpoint from storage that can fail for a moment: a transient error (a dropped connection, a
timeout, HTTP 429 or 5xx) is retried with backoff and never taken for corruption; only a definite one (a missing
or unparsable file, a step without its commit marker) lets a resume fall back to an earlier step. On a pod a
network blip seen by one host must not send that host back a step while the others go on.

Definite errors are named one by one; an error of any other kind (an I/O error, tensorstore's UNKNOWN, a type
nobody listed) says nothing about the step's files, so it is retried like a transient one and, if it persists,
stops the run instead of costing it the steps since an earlier checkpoint. A plain ValueError, KeyError or TypeError
with no storage error behind it is neither: orbax raises those for a target or sharding that does not fit the step,
which every step would hit alike (a config or code mistake), so it stops the run at once, with no retry and no
fallback.

`MAXLITE_TEST_CHECKPOINT_READ_FAULT=<process>:<step>:<transient|corrupt>:<times>` makes reads of that step fail
on that process the first `times` times (-1: always). It is a hook for tests, which cannot cut one process's
network, exposed on purpose; nothing sets it in a run.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
from absl import logging

from MaxLite.cli.errors import CheckpointError, first_line

T = TypeVar("T")

ATTEMPTS = 5
FIRST_DELAY_S = 0.5  # doubles after each attempt: 0.5 + 1 + 2 + 4 s before the last one
FAULT_ENV = "MAXLITE_TEST_CHECKPOINT_READ_FAULT"

# Status names (tensorstore, gRPC) and HTTP codes that say "try again", as libraries put them into messages.
_TRANSIENT_TEXT = re.compile(
  r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED)\b"
  r"|\b(HTTP|status|response code|code)\D{0,20}\b(408|429|5\d\d)\b"
  r"|\b(timed out|connection (reset|refused|aborted)|temporarily unavailable|service unavailable)\b",
  re.IGNORECASE,
)


# tensorstore's status names (gRPC's codes), as they head its messages: those that say the data itself is bad or
# absent, those that say access was refused, and the rest, which say nothing about the step's files.
_STATUS = re.compile(r"\b(?:[A-Z]+_)*[A-Z]+(?=: )")
_BAD_DATA_STATUS = frozenset({"NOT_FOUND", "DATA_LOSS", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE"})
_DENIED_STATUS = frozenset({"PERMISSION_DENIED", "UNAUTHENTICATED"})
_OTHER_STATUS = frozenset(
  {
    "CANCELLED",
    "UNKNOWN",
    "DEADLINE_EXCEEDED",
    "ALREADY_EXISTS",
    "RESOURCE_EXHAUSTED",
    "ABORTED",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
  }
)


class DamagedFileError(ValueError):
  """Raised by MaxLite's own readers of a step's small files (a record without a field it must have)."""


# A path that is not there (or not of its kind) and data that does not parse. Plain ValueError and KeyError are not
# here: orbax raises them for a restore target that does not fit the step as well as for bad files; tensorstore's
# complaints about bad data carry a status (_BAD_DATA_STATUS) and are recognised by it.
_DEFINITE_TYPES = (
  FileNotFoundError,
  NotADirectoryError,
  IsADirectoryError,
  json.JSONDecodeError,
  UnicodeDecodeError,
  DamagedFileError,
)
_PROGRAM_ERROR_TYPES = (ValueError, KeyError, TypeError, IndexError, AttributeError)


class UnreadableCheckpointError(CheckpointError):
  """A step's files are definitely bad (missing, unparsable, never committed): an earlier step may be good.
  A step that reads but does not fit the config is a plain CheckpointError."""


class CheckpointReadError(CheckpointError):
  """A step could not be read for a reason that is not the step's fault (the storage kept failing, or access
  was denied): resuming from an earlier step would be wrong, so the run stops."""


def _chain(error: BaseException) -> Iterator[BaseException]:
  seen: set[int] = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    yield error
    error = error.__cause__ or error.__context__


def is_transient(error: BaseException) -> bool:
  """Whether an exception (or one it was raised from) is a storage error that a retry may not see again."""
  for e in _chain(error):
    if isinstance(e, (ConnectionError, TimeoutError)):
      return True
    code = getattr(e, "code", None)
    if isinstance(code, int) and (code in (408, 429) or 500 <= code < 600):
      return True
    if type(e).__module__.split(".")[0] == "aiohttp":
      return True
    if _TRANSIENT_TEXT.search(str(e)):
      return True
  return False


def _statuses(error: BaseException) -> set[str]:
  return set(_STATUS.findall(str(error))) & (_BAD_DATA_STATUS | _DENIED_STATUS | _OTHER_STATUS)


def _denied(error: BaseException) -> bool:
  code = getattr(error, "code", None)
  return isinstance(error, PermissionError) or code in (401, 403) or bool(_statuses(error) & _DENIED_STATUS)


def _says_nothing_about_the_files(error: BaseException) -> bool:
  """An I/O error other than a missing path, an HTTP status other than 404/410, a status outside _BAD_DATA_STATUS:
  whatever else the chain holds, the files may be fine."""
  if isinstance(error, OSError) and not isinstance(error, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
    return True
  code = getattr(error, "code", None)
  return (isinstance(code, int) and code not in (404, 410)) or bool(_statuses(error) - _BAD_DATA_STATUS)


def _definite(error: BaseException) -> bool:
  return (
    isinstance(error, _DEFINITE_TYPES)
    or getattr(error, "code", None) in (404, 410)
    or bool(_statuses(error) & _BAD_DATA_STATUS)
    or type(error).__module__.split(".")[0] == "msgpack"  # orbax's small values, unparsable
  )


def is_program_error(error: BaseException) -> bool:
  """Whether an exception is a mistake of the restore itself (a target or sharding that does not fit the step):
  a ValueError/KeyError/TypeError/... with nothing in its chain from storage or from the step's files."""
  chain = list(_chain(error))
  if is_transient(error) or any(_denied(e) or _says_nothing_about_the_files(e) or _definite(e) for e in chain):
    return False
  return isinstance(error, _PROGRAM_ERROR_TYPES)


def is_unreadable(error: BaseException) -> bool:
  """Whether an exception says the step's files are bad: a definite error in its chain (a wrapper raised from one
  counts) and nothing there that could have failed with good files (an I/O error, a transient or access error)."""
  chain = list(_chain(error))
  if is_transient(error) or any(_denied(e) or _says_nothing_about_the_files(e) for e in chain):
    return False
  return any(_definite(e) for e in chain)


_injected: dict[str, int] = {}


def _inject_fault(where: str) -> None:
  spec = os.environ.get(FAULT_ENV)
  if not spec:
    return
  process, step, kind, times = spec.split(":")
  if int(process) != jax.process_index() or not re.search(rf"/{int(step)}(/|$)", where):
    return
  done = _injected.get(spec, 0)
  if int(times) >= 0 and done >= int(times):
    return
  _injected[spec] = done + 1
  if kind == "transient":
    raise ConnectionResetError(f"injected transient fault {done + 1} reading {where} ({FAULT_ENV})")
  raise ValueError(f"DATA_LOSS: injected corruption reading {where} ({FAULT_ENV})")


def read(where: str, fn: Callable[[], T], sleep: Callable[[float], Any] = time.sleep) -> T:
  """fn(), retried on any error but a definite one or denied access; failures become UnreadableCheckpointError
  (definite) or CheckpointReadError (errors that outlasted the retries, or access denied)."""
  delay = FIRST_DELAY_S
  for attempt in range(1, ATTEMPTS + 1):
    try:
      _inject_fault(where)
      return fn()
    except CheckpointError:
      raise
    except Exception as e:  # orbax, tensorstore and gcsfs raise many types
      cause = first_line(e, with_type=True)
      if is_unreadable(e):
        raise UnreadableCheckpointError(f"checkpoint {where} could not be read ({cause})") from e
      if is_program_error(e):
        raise CheckpointError(
          f"checkpoint {where} could not be restored into this run ({cause}); that is not a storage error or a "
          "damaged file (an earlier step would fail alike), so the run stops: check the run's config and mesh "
          "against the checkpoint's"
        ) from e
      # Refused access stays refused: retrying it would only delay the one line that says so.
      denied = any(_denied(c) for c in _chain(e)) and not is_transient(e)
      if not denied and attempt < ATTEMPTS:
        logging.warning(
          "reading checkpoint %s failed (%s); retry %d of %d in %.1fs", where, cause, attempt, ATTEMPTS - 1, delay
        )
        sleep(delay)
        delay *= 2
        continue
      raise CheckpointReadError(
        f"checkpoint {where} could not be read after {attempt} attempt(s) ({cause}); not falling back to an "
        "earlier step for an error that need not be the step's: check the storage and access to it, and start the "
        "run again"
      ) from e
  raise AssertionError("unreachable")

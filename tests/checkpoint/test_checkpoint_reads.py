"""Checkpoint reads: storage errors that pass are retried and never taken for a corrupt step."""

import errno
import json

import pytest

from MaxLite.checkpoint import reads
from MaxLite.checkpoint.reads import CheckpointReadError, UnreadableCheckpointError


class _HttpError(Exception):
  """Shaped like gcsfs's HttpError: the status is in `code`."""

  def __init__(self, code):
    super().__init__(f"{code}: backend says no")
    self.code = code


class _Unlisted(Exception):
  """A type nobody classified: a storage client's own, or one a new library version brings."""


def _raised_from(error, cause):
  error.__cause__ = cause
  return error


def _failing(errors):
  calls = []

  def fn():
    calls.append(1)
    if len(calls) <= len(errors):
      raise errors[len(calls) - 1]
    return "state"

  return fn, calls


@pytest.mark.parametrize(
  "error",
  [
    ConnectionResetError("peer reset"),
    TimeoutError("read timed out"),
    _HttpError(503),
    _HttpError(429),
    ValueError('UNAVAILABLE: Error reading "a/b" from GCS'),
    ValueError("DEADLINE_EXCEEDED: reading gs://bucket/run/checkpoints/6"),
  ],
)
def test_a_transient_error_is_retried_with_backoff_and_the_read_succeeds(error):
  fn, calls = _failing([error, error])
  slept = []
  assert reads.read("gs://b/c/6", fn, sleep=slept.append) == "state"
  assert len(calls) == 3 and slept == [0.5, 1.0]


def test_a_transient_error_wrapped_by_another_library_is_still_transient():
  try:
    try:
      raise ConnectionResetError("reset by peer")
    except ConnectionResetError as inner:
      raise RuntimeError("orbax: restore failed") from inner
  except RuntimeError as outer:
    assert reads.is_transient(outer)


def test_storage_that_keeps_failing_stops_the_run_instead_of_falling_back():
  fn, calls = _failing([_HttpError(500)] * 10)
  with pytest.raises(CheckpointReadError, match=r"gs://b/c/6 could not be read after 5 attempt\(s\) .*not falling"):
    reads.read("gs://b/c/6", fn, sleep=lambda s: None)
  assert len(calls) == reads.ATTEMPTS


@pytest.mark.parametrize(
  "error",
  [PermissionError("403 Forbidden"), _HttpError(403), ValueError('PERMISSION_DENIED: Error reading "a" from GCS')],
)
def test_denied_access_is_not_corruption_and_is_not_retried(error):
  fn, calls = _failing([error])
  with pytest.raises(CheckpointReadError):
    reads.read("gs://b/c/6", fn, sleep=lambda s: None)
  assert len(calls) == 1


# Errors that say nothing about the step's files: a failing disk or network, a type nobody listed, tensorstore's
# UNKNOWN status, a ValueError some library raised from an I/O error.
UNKNOWN_KIND = [
  OSError(errno.EIO, "Input/output error"),
  _Unlisted("the storage client gave up"),
  ValueError('UNKNOWN: Error reading local file "/r/checkpoints/6/state/d/1f": [os_error_code=5]'),
  _raised_from(ValueError("could not read the array"), OSError(errno.EIO, "Input/output error")),
]


@pytest.mark.parametrize("error", UNKNOWN_KIND)
def test_an_error_of_unknown_kind_is_retried_not_taken_for_corruption(error):
  fn, calls = _failing([error, error])
  slept = []
  assert reads.read("gs://b/c/6", fn, sleep=slept.append) == "state"
  assert len(calls) == 3 and slept == [0.5, 1.0]


@pytest.mark.parametrize("error", UNKNOWN_KIND)
def test_an_error_of_unknown_kind_that_outlasts_the_retries_stops_the_run(error):
  fn, calls = _failing([error] * 10)
  with pytest.raises(CheckpointReadError, match=r"gs://b/c/6 could not be read after 5 attempt\(s\) .*not falling"):
    reads.read("gs://b/c/6", fn, sleep=lambda s: None)
  assert len(calls) == reads.ATTEMPTS


@pytest.mark.parametrize(
  "error",
  [
    FileNotFoundError("no _METADATA"),
    json.JSONDecodeError("Expecting value", "", 0),
    _HttpError(404),
    reads.DamagedFileError("process_0-of-1.json has no process_index"),
    ValueError('DATA_LOSS: Error reading "params.w/0": checksum mismatch'),
    ValueError('OUT_OF_RANGE: Error opening "zarr" driver: Error reading "opt_state.1.0.count/.zarray"'),
    _raised_from(RuntimeError("restore failed"), FileNotFoundError("no _METADATA")),
  ],
)
def test_a_definite_error_is_unreadable_at_once(error):
  fn, calls = _failing([error])
  with pytest.raises(UnreadableCheckpointError, match=r"checkpoint /r/checkpoints/6 could not be read"):
    reads.read("/r/checkpoints/6", fn, sleep=lambda s: None)
  assert len(calls) == 1


def test_the_fault_hook_hits_one_process_and_step_the_given_number_of_times(monkeypatch):
  monkeypatch.setenv(reads.FAULT_ENV, "0:6:transient:2")
  monkeypatch.setattr(reads, "_injected", {})
  slept = []
  assert reads.read("/r/checkpoints/16", lambda: "other step", sleep=slept.append) == "other step"
  assert reads.read("/r/checkpoints/6/state", lambda: "six", sleep=slept.append) == "six"
  assert slept == [0.5, 1.0]
  monkeypatch.setenv(reads.FAULT_ENV, "0:6:corrupt:-1")
  with pytest.raises(UnreadableCheckpointError, match="injected corruption"):
    reads.read("/r/checkpoints/6", lambda: "six", sleep=slept.append)
  monkeypatch.setenv(reads.FAULT_ENV, "1:6:corrupt:-1")  # another process's fault
  assert reads.read("/r/checkpoints/6", lambda: "six") == "six"


def test_a_failed_reads_orphaned_sibling_futures_stay_out_of_the_output_and_before_the_error_line(capsys):
  """When one array of a restore fails, the other arrays' reads end in futures nobody awaits; asyncio logs each
  when it is collected, possibly after the error line and with the whole tensorstore spec. CI once saw those
  push the one `error:` line out of a run's last 50 lines."""
  import asyncio
  import logging
  import sys

  from MaxLite import cli
  from MaxLite.cli.errors import CheckpointError

  handler = logging.StreamHandler(sys.stderr)
  handler.addFilter(cli._drop_sibling_read_failures)
  asyncio_logger = logging.getLogger("asyncio")
  asyncio_logger.addHandler(handler)

  def entry(argv):
    loop = asyncio.new_event_loop()
    for text in ("OUT_OF_RANGE: reading x [tensorstore_spec='{}']", "a bug elsewhere"):
      future = loop.create_future()
      future.set_exception(ValueError(text))
      future.cycle = future  # only the garbage collector frees it, at a time nobody chooses
    loop.close()
    raise CheckpointError("checkpoint /r/2 could not be read")

  try:
    assert cli.run(entry, []) == cli.BAD_INPUT
  finally:
    asyncio_logger.removeHandler(handler)
  err = capsys.readouterr().err
  assert "tensorstore_spec" not in err
  assert "a bug elsewhere" in err  # other futures' errors still show
  assert err.rstrip().splitlines()[-1] == "error: checkpoint /r/2 could not be read"


def _orbax_mistakes(tmp_path):
  """What orbax raises for restores that do not fit a good step: a target tree without one of its arrays, and one
  with an array the step lacks (ValueErrors both, like a damaged file's)."""
  import numpy as np
  import orbax.checkpoint as ocp
  from etils import epath

  path = epath.Path(tmp_path) / "6"
  checkpointer = ocp.PyTreeCheckpointer()
  checkpointer.save(path, {"a": np.ones(4), "b": np.zeros(3)})
  targets = [{"a": np.ones(4)}, {"a": np.ones(4), "b": np.zeros(3), "c": np.zeros(2)}]
  return [lambda t=t: checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=t)) for t in targets]


def test_a_restore_that_does_not_fit_a_good_step_stops_at_once_without_falling_back(tmp_path):
  """orbax's ValueErrors for a wrong target or sharding are the run's mistake, not the step's: every earlier step
  would fail alike, so neither a retry nor a fallback (UnreadableCheckpointError), one line instead."""
  for restore in _orbax_mistakes(tmp_path):
    calls = []

    def fn(restore=restore, calls=calls):
      calls.append(1)
      return restore()

    with pytest.raises(reads.CheckpointError, match=r"could not be restored into this run \(ValueError: ") as error:
      reads.read(str(tmp_path / "6"), fn, sleep=lambda s: None)
    assert not isinstance(error.value, (UnreadableCheckpointError, CheckpointReadError)) and len(calls) == 1

"""One writer per run directory: `<run_dir>/run.lock` names the run using it (pid, host, start time).

Two runs on one run directory would interleave their metrics rows and checkpoints, and each would
resume from the other's steps. So process 0 of a job (it alone writes metrics and finalizes
checkpoints; every process joins the same run) takes the lock before training starts and releases it
when the run ends: normally, with an error, or on SIGTERM. A second run on the same directory stops
with one line naming the owner.

Local (or mounted shared) directories: the lock is an flock(2) held on the file for the whole run, so
the kernel drops it when the owner dies, however it dies. A lock file with no holder is what a killed
run left behind; the next run takes it over with a warning naming that run. (Linux NFS forwards flock
to the server, so runs on different hosts see each other's lock there too.)

gs:// has no locks, and no host can ask whether a process on another host still lives. There the lock
object is created only if absent (an upload with a does-not-exist precondition, read back, so of two starts at
once one wins) and its owner rewrites its `heartbeat` time every HEARTBEAT_S seconds, each write conditioned on
the object's generation from the owner's last write, so it never overwrites a new owner. A lock is stale, and
is replaced with a warning, when its owner ran on this host and that pid is gone, or when its heartbeat is older
than STALE_AFTER_S: a run killed on another host keeps its directory locked that long (delete the lock object
to start sooner). So the owner itself counts its lock as lost once its last successful heartbeat is older than
STALE_AFTER_S less one beat (the margin covers clock skew between hosts): a bucket that stops answering stops the
run before another run may take its directory. A run that finds its lock taken over or lost stops before it writes
again: every process together before its next save, and process 0 (the one that writes them) before its next metrics
row, with checkpointing off too.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from absl import logging

from MaxLite import storage
from MaxLite.checkpoint import agreement
from MaxLite.cli.errors import ConfigError, InputError, MaxLiteError, first_line
from MaxLite.config import Config

LOCK_FILE = "run.lock"
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0


def lock_path(config: Config) -> str:
  return storage.join(config.run_dir, LOCK_FILE)


def _record() -> dict[str, Any]:
  return {
    "pid": os.getpid(),
    "host": socket.gethostname(),
    "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    "heartbeat": time.time(),
    "token": uuid.uuid4().hex,  # tells this run's lock from a later one with a reused pid
  }


def _parse(text: str) -> dict[str, Any]:
  try:
    record = json.loads(text)
  except ValueError:
    return {}
  return record if isinstance(record, dict) else {}


def _owner(record: dict[str, Any]) -> str:
  return (
    f"pid {record.get('pid', '?')} on host {record.get('host', '?')} (started {record.get('started', '?')})"
    if record
    else "a run whose lock file is unreadable"
  )


def _pid_alive(pid: Any) -> bool:
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # alive, under another user
    return True
  return not _zombie(pid)


def _zombie(pid: int) -> bool:
  """Killed but not yet reaped: a run whose launcher was killed with it waits for init to reap it, seconds in a
  container, while os.kill(pid, 0) still finds it. It holds nothing: Linux shows it in state Z."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # the state follows the parenthesised command name
  except (OSError, IndexError):
    return False


def _unwritable(config: Config, path: str, error: BaseException) -> InputError:
  return InputError(
    f"base_output_directory={config.base_output_directory}: cannot write the run directory {config.run_dir} "
    f"({type(error).__name__}: {first_line(error)}; {path})"
  )


class _LocalLock:
  """flock on the lock file; the file's content only says who holds it."""

  def __init__(self, config: Config):
    self.path = lock_path(config)
    self._run_dir, self._made = config.run_dir, _outermost_missing(config.run_dir)
    try:
      storage.makedirs(config.run_dir)
      self._fd = self._open_locked(config)
      previous = _parse(os.pread(self._fd, 1 << 16, 0).decode("utf-8", "replace"))
      if previous:
        logging.warning("%s: taking over the lock of a run that is no longer running: %s", self.path, _owner(previous))
      data = json.dumps(_record()).encode()
      os.ftruncate(self._fd, 0)
      os.pwrite(self._fd, data, 0)
    except OSError as e:
      raise _unwritable(config, self.path, e) from None

  def _open_locked(self, config: Config) -> int:
    import fcntl

    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        owner = _parse(os.pread(fd, 1 << 16, 0).decode("utf-8", "replace"))
        os.close(fd)
        raise ConfigError(
          f"run directory {config.run_dir} is in use by {_owner(owner)}; wait for that run to end or use "
          f"another run_name (lock file {self.path})"
        ) from None
      # The previous owner may have released (deleted) the file between our open and our flock: then we
      # hold a lock on a file nobody else will open, and must lock the one now at the path.
      try:
        same = os.path.samestat(os.fstat(fd), os.stat(self.path))
      except FileNotFoundError:
        same = False
      if same:
        return fd
      os.close(fd)

  def lost(self, ask_store: bool = True) -> str | None:
    """Why this run no longer holds its lock (its file was deleted or replaced), or None while it does. A stat is
    cheap, so `ask_store` (the object lock's choice: a request, or what its heartbeat learned) changes nothing."""
    del ask_store
    try:
      if os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
        return None
    except FileNotFoundError:
      pass
    return f"this run's lock file {self.path} was deleted or replaced"

  def release(self) -> None:
    try:
      os.remove(self.path)  # while still held, so no other run is between our delete and our unlock
    except OSError as e:
      logging.warning("%s: could not remove the lock file (%s)", self.path, first_line(e))
    if self._made is not None:  # before the unlock: no other run can have started writing in them
      _remove_empty_dirs(self._run_dir, self._made)
    os.close(self._fd)


def _outermost_missing(path: str) -> str | None:
  """The outermost directory on the way to `path` that does not exist yet (None: `path` exists)."""
  missing = None
  while path and not os.path.exists(path):
    missing, parent = path, os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return missing


def _remove_empty_dirs(run_dir: str, outermost: str) -> None:
  """A run that stopped before it wrote anything (an input it could not read, a checkpoint that does not fit) leaves
  no run directory: the directories this run made that are still empty go, deepest first; never a file."""
  for root, _, _ in os.walk(run_dir, topdown=False):
    with contextlib.suppress(OSError):
      os.rmdir(root)
  path = os.path.dirname(run_dir)
  while len(path) >= len(outermost) and not os.path.exists(run_dir):
    try:
      os.rmdir(path)
    except OSError:
      return
    if path == outermost:
      return
    path = os.path.dirname(path)


def _bounded(call: Any, seconds: float) -> Any:
  """call() on a daemon thread, waited for `seconds` at most: TimeoutError if it has not returned by then (it may
  still finish later; nothing waits for it). A bucket request that hangs must not hold up a save or a metrics row
  past the time the lock counts as lost anyway."""
  done, result = threading.Event(), {}

  def run() -> None:
    try:
      result["value"] = call()
    except BaseException as e:  # handed to the caller
      result["error"] = e
    done.set()

  threading.Thread(target=run, name="run_lock_request", daemon=True).start()
  if not done.wait(max(seconds, 0.0)):
    raise TimeoutError(f"no answer from the bucket within {seconds:.0f}s")
  if "error" in result:
    raise result["error"]
  return result["value"]


class _ObjectLock:
  """A lock object in a bucket with an owner-refreshed heartbeat (see the module docstring). Every write after
  the first is conditioned on the generation this run last wrote, so a heartbeat never overwrites a new
  owner's lock: it finds it and marks this run's lock as lost. No bucket request is made while holding the mutex,
  and each is bounded by the time left before the lock would count as lost (_deadline_s)."""

  def __init__(self, config: Config):
    self.path = lock_path(config)
    # When the heartbeat the bucket holds was stamped (monotonic, read before the stamp, so never later than the time
    # other runs judge), and why the beats since then failed.
    self._beaten, self._failure = time.monotonic(), ""
    self._record = _record()
    self._mutex = threading.Lock()  # the heartbeat thread and lost() both read and write _generation/_lost
    self._lost: str | None = None
    try:
      self._generation = self._take(config)
    except (ConfigError, InputError):
      raise
    except Exception as e:  # gcsfs raises HTTP and auth errors of many types for a bucket it cannot write
      raise _unwritable(config, self.path, e) from None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._beat, name="run_lock_heartbeat", daemon=True)
    self._thread.start()

  def _take(self, config: Config) -> int:
    for _ in range(3):
      try:
        storage.create_new(self.path, json.dumps(self._record))
      except FileExistsError:
        pass
      found = storage.read_generation(self.path)
      if found is None:  # released between our two calls: try again
        continue
      owner, generation = _parse(found[0]), found[1]
      if owner.get("token") == self._record["token"]:
        return generation  # ours (two starts at once: the later upload wins, and the earlier one sees that)
      stale = self._stale_reason(owner)
      if stale is None:
        age = time.time() - owner.get("heartbeat", 0)
        raise ConfigError(
          f"run directory {config.run_dir} is in use by {_owner(owner)}, last heartbeat {age:.0f}s ago; wait for "
          f"that run to end or use another run_name (a lock with no heartbeat for {STALE_AFTER_S:.0f}s is taken "
          f"over; {self.path})"
        )
      logging.warning("%s: taking over the lock of %s: %s", self.path, _owner(owner), stale)
      storage.remove_generation(self.path, generation)
    raise ConfigError(f"run directory {config.run_dir}: another run keeps taking its lock ({self.path})")

  @staticmethod
  def _stale_reason(owner: dict[str, Any]) -> str | None:
    if owner.get("host") == socket.gethostname() and not _pid_alive(owner.get("pid")):
      return "that pid is no longer running on this host"
    age = time.time() - float(owner.get("heartbeat", 0))
    if age > STALE_AFTER_S:
      return f"no heartbeat for {age:.0f}s (more than {STALE_AFTER_S:.0f}s)"
    return None

  def _deadline_s(self) -> float:
    """Seconds until the lock counts as lost for want of a heartbeat (_silence); at least one beat, so a request
    made right after a failed beat still gets a fair chance."""
    return max(STALE_AFTER_S - HEARTBEAT_S - (time.monotonic() - self._beaten), HEARTBEAT_S)

  def _holder(self) -> tuple[str | None, int | None]:
    """(who holds the lock if not this run, else None; the lock object's generation), read within the deadline."""
    found = _bounded(lambda: storage.read_generation(self.path), self._deadline_s())
    if found is None:
      return "nothing (the lock object was deleted)", None
    owner = _parse(found[0])
    return (None if owner.get("token") == self._record["token"] else _owner(owner)), found[1]

  def _lose(self, by: str) -> None:
    self._lost = f"this run's lock {self.path} was taken over by {by}"
    logging.error("%s; this run stops before it writes again", self._lost)

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      with self._mutex:
        if self._lost is not None:
          return
        previous = self._generation
      stamped = time.monotonic()
      self._record["heartbeat"] = time.time()
      record = json.dumps(self._record)
      try:
        write = functools.partial(storage.replace_generation, self.path, record, previous)
        generation = _bounded(write, self._deadline_s())
        by = None
        if generation is None:  # someone wrote (or deleted) the lock since our last write
          by, generation = self._holder()
      except Exception as e:  # a network hiccup: the next beat tries again; _silence() bounds how long
        self._failure = first_line(e, with_type=True)
        logging.warning("%s: could not refresh the lock heartbeat (%s)", self.path, self._failure)
        continue
      with self._mutex:
        if self._lost is not None:
          return
        if by is not None:
          self._lose(by)
          return
        # Ours: this beat's write, or an earlier one that answered after its deadline (the object holds our token,
        # so it is still this run's lock; its generation is what the next write is conditioned on).
        self._generation, self._beaten, self._failure = generation, stamped, ""

  def _silence(self) -> str | None:
    """Why the lock counts as lost for want of a heartbeat, or None. Another run takes it over once the heartbeat
    it finds is STALE_AFTER_S old by that run's clock; one beat of margin covers skew between the two clocks."""
    age = time.monotonic() - self._beaten
    if age <= STALE_AFTER_S - HEARTBEAT_S:
      return None
    return (
      f"this run's lock {self.path} had no successful heartbeat for {age:.0f}s "
      f"({self._failure or 'the last request to the bucket has not returned'}); "
      f"another run may take over a lock with no heartbeat for {STALE_AFTER_S:.0f}s"
    )

  def lost(self, ask_store: bool = True) -> str | None:
    """Why this run no longer holds its lock, or None while it does. Without `ask_store` it only looks at what the
    heartbeat learned (no request: cheap enough for every metrics row); with it, it also reads the lock object.

    A read that fails is tolerated: while the last heartbeat is fresh no other run may take the lock, and once it
    is not, _silence() counts the lock as lost whatever the bucket answers."""
    silent = self._silence() if self._lost is None else None
    if silent is not None:  # never replace a takeover the heartbeat thread found meanwhile with None
      self._lost = silent
    if self._lost is not None or not ask_store:
      return self._lost
    try:
      by, _ = self._holder()
    except Exception as e:
      logging.warning("%s: could not read the lock (%s)", self.path, first_line(e, with_type=True))
      by = None
    with self._mutex:
      if self._lost is None and by is not None:
        self._lose(by)
      elif self._lost is None:
        self._lost = self._silence()  # a read that hung until the deadline: the lock counts as lost by now
      return self._lost

  def release(self) -> None:
    self._stop.set()
    self._thread.join()
    try:
      found = _bounded(lambda: storage.read_generation(self.path), HEARTBEAT_S)
      if found is not None and _parse(found[0]).get("token") == self._record["token"]:
        _bounded(lambda: storage.remove_generation(self.path, found[1]), HEARTBEAT_S)
    except Exception as e:
      logging.warning("%s: could not remove the lock (%s)", self.path, first_line(e, with_type=True))


def acquire(config: Config) -> _LocalLock | _ObjectLock:
  """Takes the run directory's lock (creating the directory), or raises naming the run that holds it."""
  return _ObjectLock(config) if storage.is_url(config.run_dir) else _LocalLock(config)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
  del frame
  raise SystemExit(128 + signum)


class LockLostError(MaxLiteError):
  """Another run took over this run's directory: this one must not write to it again."""


class Guard:
  """What the processes of a job know about process 0's lock. `before_save` is a collective (a one-number
  all-gather on a job of several processes), called by every process at each save, so all stop together or none
  does. `before_metrics` is process 0's alone: it alone writes metrics, and a collective there would make every
  host wait for the step in flight at every row."""

  def __init__(self, lock: _LocalLock | _ObjectLock | None):
    self._lock = lock  # process 0's; None elsewhere
    self.lost: str | None = None  # set once the run stopped for it: nothing may be written after

  def before_save(self, step: int) -> None:
    """Raises LockLostError on every process when process 0 no longer holds the run's lock (asks the store)."""
    reason = self._lock.lost() if self._lock is not None else None
    if agreement.everyones(int(reason is not None))[0]:
      self._stop(reason or "process 0 lost the run directory lock (its log says why)", f"without saving step {step}")

  def before_metrics(self, step: int) -> None:
    """Raises LockLostError on process 0 when its lock is known lost. No storage request (a takeover is seen by the
    heartbeat within HEARTBEAT_S), no collective: process 0's exit ends the job as any process's failure does."""
    reason = self._lock.lost(ask_store=False) if self._lock is not None else None
    if reason is not None:
      self._stop(reason, f"before writing the metrics of step {step}")

  def _stop(self, reason: str, stopping: str) -> None:
    self.lost = reason
    raise LockLostError(f"{reason}; stopping {stopping}, so the new owner's files stay as they are")


@contextlib.contextmanager
def hold(config: Config) -> Iterator[Guard]:
  """The run's lock for the duration of the block: process 0 takes it (it writes for the whole job) and every
  process learns whether it did, so a refused job stops on every process instead of waiting for process 0.

  A single process also turns SIGTERM into SystemExit here, so a run stopped before or outside the
  checkpointing loop (which saves on SIGTERM itself) still unwinds and releases the lock. Under
  jax.distributed, JAX's preemption service owns SIGTERM and the loop stops at an agreed step.
  """
  import jax

  lock, refused = None, None
  if jax.process_index() == 0:
    try:
      lock = acquire(config)
    except MaxLiteError as e:
      refused = e
  if agreement.everyones(int(refused is not None))[0]:
    raise refused or ConfigError(
      f"run directory {config.run_dir}: process 0 could not take its lock (process 0's log says why)"
    )
  previous = None
  if not jax.distributed.is_initialized() and threading.current_thread() is threading.main_thread():
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
  try:
    yield Guard(lock)
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
    if lock is not None:
      lock.release()

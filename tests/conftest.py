"""Shared fixtures: a real GCS emulator process, and run-store roots on disk and in the emulator."""

from __future__ import annotations

import os

import pytest

from workflows.local.emulator import GcsEmulator

BUCKET = "test-bucket"


@pytest.fixture(scope="session")
def gcs_emulator():
    """A fake-gcs-server process for the whole session, with BUCKET created and this process pointed at it."""
    em = GcsEmulator().start()
    em.create_bucket(BUCKET)
    saved = {k: os.environ.get(k) for k in em.env}
    em.apply()
    yield em
    em.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(params=["local", "gcs"])
def store_root(request, tmp_path):
    """A run-store root: a local directory, then a gs:// prefix in the emulator (unique per test)."""
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue("gcs_emulator")
    return f"gs://{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}-{os.getpid()}"

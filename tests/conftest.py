"""Shared fixtures: a real GCS emulator process, run-store roots on disk and in the emulator, task reference runs."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
from support.areas import AREAS, area_of
from support.local_job import reference_digest, shrunken_workflow

from workflows.local.emulator import GcsEmulator

BUCKET = "test-bucket"

# One compilation cache for every job this session starts (workers inherit it through the config): each
# program shape compiles cold once, not once per test. A fresh folder per session, so no run is warmed by
# an earlier session.
# With pytest-xdist the workers inherit the controller's folder; whoever made it removes it when it ends.
if "JAXREC_TEST_COMPILE_CACHE" not in os.environ:
    os.environ["JAXREC_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="jaxrec-test-compile-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXREC_TEST_COMPILE_CACHE"], ignore_errors=True)
# Steps called in this process act as the local runner's (jaxrec.adapters.kube.in_pod), even where the suite
# itself runs in a pod; a test that plays a step in a pod sets the variable itself.
os.environ.pop("KUBERNETES_SERVICE_HOST", None)


def pytest_addoption(parser):
    """The chaos runs of the real-controller tier (``pytest -m chaos``): which seeds."""
    group = parser.getgroup("chaos", "chaos runs on the real controllers (tests/k8s/test_chaos.py)")
    group.addoption("--chaos-seed", type=int, action="append", default=[], help="replay this seed (repeatable)")
    group.addoption(
        "--chaos-rounds",
        type=int,
        default=0,
        help="how many seeds to run beside each test's regression seeds (default 0: the regression seeds alone)",
    )
    group.addoption("--chaos-first-seed", type=int, default=1, help="the first of the --chaos-rounds seeds")
    group.addoption(
        "--chaos-results",
        default=None,
        help="append one JSON line per chaos run to this file (seed, faults by kind, violations, seconds, outcome)",
    )


def pytest_configure(config):
    """One marker per area of the product (``tests/support/areas.py``): ``pytest -m AREA``."""
    for area, (modules, _) in AREAS.items():
        config.addinivalue_line("markers", f"{area}: the tests of {modules}")


TIER_TEST_LIMIT_S = 240
"""The most a real-controller tier test may take (a chaos run says its own, at most 600 s). The session's fixtures
(the control plane's start, the undisturbed reference runs) are not the first test's: they bound their own waits."""


def pytest_collection_modifyitems(config, items):
    """Mark every test with its module's area (a test module in no area is a collection error), and give each tier
    test without a limit of its own the tier's."""
    missing: set[str] = set()
    for item in items:
        if item.get_closest_marker("k8s") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(TIER_TEST_LIMIT_S, func_only=True))
        path = item.path
        module = f"k8s/{path.stem}" if path.parent.name == "k8s" else path.stem
        area = area_of(module)
        if area is None:
            missing.add(module)
            continue
        item.add_marker(getattr(pytest.mark, area))
    if missing:
        raise pytest.UsageError(f"test modules in no area: {sorted(missing)}; add each to tests/support/areas.py")


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


@pytest.fixture
def gcs_bucket(gcs_emulator) -> str:
    """The emulator's bucket (a fixture: test modules never import this conftest, which shares its module name
    with tests/k8s/conftest.py)."""
    return BUCKET


@pytest.fixture(params=["local", "gcs"])
def store_root(request, tmp_path):
    """A run-store root: a local directory, then a gs:// prefix in the emulator (unique per test)."""
    if request.param == "local":
        return str(tmp_path / "store")
    request.getfixturevalue("gcs_emulator")
    return f"gs://{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}-{os.getpid()}"


@pytest.fixture(scope="session")
def classifier_job(tmp_path_factory):
    """The example image classifier's shrunken job (2 hosts) and the final params digest of an uninterrupted run.

    Returns ``((workflow, store_root), digest)``, the shape of the lm job's fixtures in test_e2e_local.
    """
    d = tmp_path_factory.mktemp("classifier-e2e")
    root = str(d / "store")
    wf = shrunken_workflow(d, "classifier", store_root=root, config="local-image-classifier.yaml", hosts=2)
    return (wf, root), reference_digest(wf, root)


def pytest_terminal_summary(terminalreporter, config):
    """One line when the real-controller tier (tests/k8s) did not run, with how to run it."""
    ran = any(
        "tests/k8s/" in r.nodeid or r.nodeid.startswith("k8s/")
        for key in ("passed", "failed", "error", "skipped")
        for r in terminalreporter.stats.get(key, [])
        if hasattr(r, "nodeid")
    )
    if ran:
        return

    why = "Go found" if shutil.which("go") else "no Go toolchain here"
    terminalreporter.write_line(
        f"real-controller tier not run ({why}): tools/k8s/build.sh && .venv/bin/python -m pytest -m k8s"
    )

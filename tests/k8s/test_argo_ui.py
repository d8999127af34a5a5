"""The Argo UI in a real browser: ``argo server`` built with the UI of argo-workflows v4.0.5
(``tools/argo-ui/build.sh``) serving the tier's cluster, and headless Chromium from Debian's packages driven by
Selenium through Debian's chromedriver. The test runs one Workflow that recovers from a killed worker and one that
gives up, then opens what a person opens: the workflow list, a run's graph, the nodes of each attempt (the failed
train-segment's one-line reason, classify-failure's class and decision, the give-up's reason) and the timeline. Each
page is kept as a screenshot under ``$JAXREC_ARTIFACTS/argo-ui`` (default ``.artifacts/`` in the checkout).

Skipped, with the reason, where the UI build or the browser is missing: they are not part of the control plane's
build (``.ci/run`` installs and builds both).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import argoctl
import pytest
from argorun import ArgoRun
from realcluster import RealCluster, wait_for
from tier import REPO

pytestmark = pytest.mark.k8s

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
PAGE_S = 30  # a page of the single-page app shows its data within this


def _ui_binary() -> Path:
    """The `argo` built with the UI (tools/argo-ui/build.sh --cached: no build here, minutes of it)."""
    env_bin = os.environ.get("JAXREC_ARGO_UI_BIN")
    if env_bin:
        return Path(env_bin)
    got = subprocess.run(
        [str(REPO / "tools" / "argo-ui" / "build.sh"), "--cached"], capture_output=True, text=True, timeout=120
    )
    if got.returncode != 0:
        pytest.skip(f"no Argo UI build: {got.stderr.strip().splitlines()[-1] if got.stderr.strip() else got}")
    return Path(got.stdout.strip())


@pytest.fixture
def browser(tmp_path) -> Iterator[Any]:
    """Headless Chromium (Debian's package) through chromedriver; quit after the test."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(f"no browser: {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        pytest.skip(f"no selenium: {e} (pip install -e '.[test]')")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1600,1000"):
        opts.add_argument(a)
    opts.add_argument(f"--user-data-dir={tmp_path / 'chromium'}")
    drv = webdriver.Chrome(
        service=Service(str(CHROMEDRIVER), log_output=str(tmp_path / "chromedriver.log")), options=opts
    )
    drv.set_page_load_timeout(PAGE_S)
    try:
        yield drv
    finally:
        drv.quit()


@pytest.fixture
def argo_server(real_cluster: RealCluster, argo, tmp_path) -> Iterator[argoctl.ArgoServer]:
    """``argo server`` with the UI for the shipped Workflow's namespace, killed after the test."""
    import yaml

    binary = _ui_binary()
    ns = yaml.safe_load((REPO / "argo" / argoctl.ARGO_FILE).read_text())["metadata"]["namespace"]
    srv = argoctl.start_server(real_cluster, ns, tmp_path / "argo-server", binary)
    try:
        yield srv
    finally:
        srv.stop()
        real_cluster.components.pop(srv.name, None)


def _artifacts() -> Path:
    d = Path(os.environ.get("JAXREC_ARTIFACTS") or REPO / ".artifacts") / "argo-ui"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _text(drv: Any) -> str:
    from selenium.webdriver.common.by import By

    return drv.find_element(By.TAG_NAME, "body").text


# Clicks the innermost element whose shown text is ``arguments[0]`` (a tab of the node's panel).
CLICK_TEXT = """
const want = arguments[0].toUpperCase();
const hits = [...document.querySelectorAll('body *')].filter(e => (e.innerText || '').trim().toUpperCase() === want);
if (!hits.length) return false;
hits[hits.length - 1].click();
return true;
"""


def _open(drv: Any, url: str, *expect: str, shot: str, tab: str | None = None) -> str:
    """Open ``url`` (and the panel's ``tab``), wait until the page's text holds every ``expect``, keep a screenshot;
    the page's text."""
    drv.get(url)
    if tab is not None:
        wait_for(f"the {tab} tab", lambda: drv.execute_script(CLICK_TEXT, tab), PAGE_S, 0.5)

    def shows() -> str | None:
        text = _text(drv)
        return text if all(e in text for e in expect) else None

    try:
        text = wait_for(f"{url} showing {expect}", shows, PAGE_S, 0.5)
        time.sleep(0.5)  # the graph settles its layout after the data arrives
    except AssertionError as e:
        raise AssertionError(f"{e}\nthe page says:\n{_text(drv)[:3000]}") from None
    finally:
        drv.save_screenshot(str(_artifacts() / f"{shot}.png"))
    return text


def _node(wf: dict[str, Any], template: str, index: int = 0) -> dict[str, Any]:
    return argoctl.pods_of(wf, template)[index]


def test_a_person_sees_each_attempt_its_reason_and_the_give_up_in_the_argo_ui(argo_run, argo_server, browser, tmp_path):
    rc, ns = argo_run.rc, argo_run.ns
    # One run that recovers: worker 2 killed (exit 137, infrastructure), attempt 1 trains to the end.
    recovered = argo_run.submit()
    argo_run.workers(0)
    argo_run.beat(0, 5)
    rc.exit_pod(ns, argo_run.workers(0)[2]["metadata"]["name"], 137)
    argo_run.workers(1)
    argo_run.beat(1, 12)
    argo_run.exit_all(1, 0)
    ok = argo_run.wait_done(200)
    assert ok["status"]["phase"] == "Succeeded", argoctl.summary(ok)
    # One that gives up at once: a worker finds the slice unlike the config (exit 2: configuration, no retry).
    second = ArgoRun(rc, argo_run.cfg, tmp_path / "store-2")
    gave_up = second.submit()
    rc.exit_pod(ns, second.workers(0)[1]["metadata"]["name"], 2)
    bad = second.wait_done(200)
    assert bad["status"]["phase"] == "Failed", argoctl.summary(bad)

    base = f"{argo_server.url}/workflows/{ns}"
    # The run that gave up says why under its name: its description, which give-up sets (Argo leaves MESSAGE empty).
    listed = _open(browser, base, recovered, gave_up, "giving up: class configuration", shot="1-workflow-list")
    assert listed.index(gave_up) < listed.index("giving up: class configuration") < listed.index(recovered)

    graph = _open(browser, f"{base}/{recovered}?tab=workflow", "train-segment", "classify-failure", shot="2-recovered")
    assert "give-up" in graph  # the branch not taken, shown skipped
    failed = _node(ok, "train-segment", 0)
    seg = _open(
        browser,
        f"{base}/{recovered}?tab=workflow&nodeId={failed['id']}",
        "worker 2 failed (exit code 137",
        shot="3-failed-segment",
    )
    assert "train-segment" in seg
    verdict = _node(ok, "classify-failure")
    _open(
        browser,
        f"{base}/{recovered}?tab=workflow&nodeId={verdict['id']}",
        "failure-class",
        "infrastructure",
        "decision",
        "retry",
        shot="4-classify-failure",
        tab="INPUTS/OUTPUTS",
    )
    _open(
        browser,
        f"{base}/{recovered}?tab=timeline",
        "provision-slice",
        "train-segment",
        "classify-failure",
        shot="5-timeline",
    )

    give_up = _node(bad, "give-up")
    _open(
        browser,
        f"{base}/{gave_up}?tab=workflow&nodeId={give_up['id']}",
        "giving up: class configuration",
        f"argo resubmit -n {ns} {gave_up}",
        shot="6-give-up",
    )

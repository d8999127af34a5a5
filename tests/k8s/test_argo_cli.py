"""The real ``argo`` CLI (argo-workflows v4.0.5, built by ``tools/k8s/build.sh`` into the tier's bin directory)
driving the shipped Workflow as ``README.md`` tells users to: ``argo submit argo/<job>.yaml -p ...``, ``argo list``,
``argo get``, ``argo logs``, ``argo wait``, ``argo stop``, ``argo retry`` and ``argo resubmit``, against the real
workflow-controller and API server; the step pods run their real programs (``podexec``, which also serves their logs
as the kubelet does).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import argoctl
import pytest
import standin
from argoctl import ARGO_FILE
from argorun import ArgoRun
from realcluster import RealCluster, wait_for
from tier import REPO

from jaxrec.model.contract import AttemptOutcome
from jaxrec.model.names import jobset_name

pytestmark = pytest.mark.k8s

CLI_TIMEOUT_S = 60


def argo_cli(rc: RealCluster, *args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """``argo ARGS`` as the cluster's admin."""
    cli = rc.bin_dir / "argo"
    if not os.access(cli, os.X_OK):
        from conftest import _required

        msg = f"{rc.bin_dir} lacks the argo CLI: run tools/k8s/build.sh"
        pytest.fail(msg, pytrace=False) if _required() else pytest.skip(msg)
    cmd = [str(cli), f"--kubeconfig={rc.root / 'admin.kubeconfig'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_the_cli_is_the_tiers_argo_version(real_cluster):
    out = argo_cli(real_cluster, "version", "--short")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "argo: v4.0.5", out.stdout


def _submit(r: ArgoRun) -> str:
    """``argo submit argo/<job>.yaml -p store-root=...``: the Workflow's name."""
    sub = argo_cli(r.rc, "submit", f"argo/{ARGO_FILE}", "-n", r.ns, "-p", f"store-root={r.store_root}", "-o", "name")
    assert sub.returncode == 0, sub.stderr
    r.name = sub.stdout.strip().rsplit("/", 1)[-1]
    return r.name


def _wait(r: ArgoRun, phase: str, timeout: float = 180) -> None:
    """``argo wait`` until the Workflow ends, in ``phase``."""
    t0 = time.monotonic()
    waited = argo_cli(r.rc, "wait", r.name, "-n", r.ns, timeout=timeout)
    assert time.monotonic() - t0 < timeout and r.name in waited.stdout and phase in waited.stdout, (
        waited,
        argo_cli(r.rc, "get", r.name, "-n", r.ns, "--no-color").stdout,
    )


def _gave_up_as_the_budget_says(r: ArgoRun) -> None:
    """The app-bug run as the controller ended it: the verdicts, the segments' exits, the give-up, the exit
    handler, the ledger, and the stand-in's replay of the same Workflow."""
    wf = r.wf()
    report = argoctl.summary(wf)
    assert wf["status"]["phase"] == "Failed", report
    segments = argoctl.pods_of(wf, "train-segment")
    assert [n["outputs"]["exitCode"] for n in segments] == ["1", "1"], report  # the verdict: no Argo retry
    assert [argoctl.outputs(n)["outcome"] for n in segments] == ["failed", "failed"], report
    (give_up,) = argoctl.pods_of(wf, "give-up")
    assert give_up["phase"] == "Failed", report
    (final,) = argoctl.pods_of(wf, "exit-handler")
    assert argoctl.outputs(final)["final-status"] == "Failed", report
    ledger = r.ledger()
    assert [(a.attempt, a.failure_class, a.decision) for a in ledger.attempts] == [
        (0, "application", "retry"),
        (1, "application", "stop"),
    ]
    assert ledger.final_status == "Failed"
    standin.agrees(r, wf, "app-bug")


def _verdicts(r: ArgoRun, name: str) -> list[dict[str, str]]:
    """Each attempt's classify-failure outputs, in order, from ``argo get -o json``."""
    got = argo_cli(r.rc, "get", name, "-n", r.ns, "-o", "json")
    assert got.returncode == 0, got.stderr
    return [argoctl.outputs(n) for n in argoctl.pods_of(json.loads(got.stdout), "classify-failure")]


def _trains_to_the_end(r: ArgoRun, attempt: int) -> None:
    """The attempt's gang runs, beats and completes."""
    r.workers(attempt)
    r.beat(attempt, 12)
    r.exit_all(attempt, 0)


def test_a_run_that_gives_up_as_a_user_follows_it_with_the_cli(argo_run):
    """README scenario ``app-bug`` through the CLI: an exception in the training step on every attempt (exit 42,
    podFailurePolicy FailJob) -> Failed with class ``application`` once its budget (1) is spent; train-segment is
    never retried by Argo, and the stand-in runs the finished Workflow as the controller ran it. Submitted from the
    file, listed, waited for; ``argo get`` shows each attempt's failed train-segment with its one-line reason and the
    give-up; ``argo logs`` has the failed supervisor's log with the time of each line. ``argo retry`` of it is
    refused: Argo replays only the give-up, which stops its Workflow and says to resubmit; ``argo resubmit``
    continues the run at its next attempt."""
    rc, ns = argo_run.rc, argo_run.ns
    first = _submit(argo_run)
    listed = argo_cli(rc, "list", "-n", ns)
    assert listed.returncode == 0 and argo_run.name in listed.stdout, listed
    for attempt in (0, 1):
        pods = argo_run.workers(attempt)
        if attempt == 0:  # the supervisor's pod as the API server classed it: Argo's init and wait containers too
            (sup,) = [p for p in rc.pods(ns) if "-train-segment-" in p["metadata"]["name"]]
            assert sup["status"]["qosClass"] == "Guaranteed", [c.get("resources") for c in sup["spec"]["containers"]]
        rc.exit_pod(ns, pods[1]["metadata"]["name"], 42)
    _wait(argo_run, "Failed", 240)
    _gave_up_as_the_budget_says(argo_run)

    got = argo_cli(rc, "get", argo_run.name, "-n", ns, "--no-color")  # plain text: it goes to a pipe
    assert got.returncode == 0, got.stderr
    lines = got.stdout.splitlines()
    assert any(line.startswith("Status:") and "Failed" in line for line in lines), got.stdout
    failed_segments = [line for line in lines if "train-segment(0)" in line]
    assert len(failed_segments) == 2, got.stdout
    # The node message is the step's one-line reason (its termination message), not a log tail.
    assert all("worker 1 failed (exit code 42" in line for line in failed_segments), got.stdout
    assert any("give-up" in line and "✖" in line for line in lines), got.stdout
    # Argo gives a step that succeeded no message (assessNodeStatus sets one only for a pending or failed pod): the
    # decision of a retried attempt shows as the branches it skipped, its class and reason as classify-failure's
    # outputs (``argo get -o json``, the UI's node panel).
    skipped = [line for line in lines if "give-up" in line and "'retry' == 'stop'" in line]
    assert len(skipped) == 1 and "evaluated false" in skipped[0], got.stdout
    verdicts = _verdicts(argo_run, argo_run.name)
    want = [("application", "retry"), ("application", "stop")]
    assert [(v["failure-class"], v["decision"]) for v in verdicts] == want, verdicts
    assert all("worker 1" in v["reason"] for v in verdicts), verdicts

    logs = argo_cli(rc, "logs", argo_run.name, "-n", ns, "--timestamps")
    assert logs.returncode == 0, logs.stderr
    assert "worker 1 failed (exit code 42" in logs.stdout, logs.stdout[-3000:]
    by_class = argo_cli(rc, "list", "-n", ns, "-l", "jaxrec/failure-class=application")
    assert by_class.returncode == 0 and first in by_class.stdout, by_class  # labelled by give-up
    (gave_up,) = [line for line in lines if "give-up" in line and "✖" in line]
    assert "giving up: class application" in gave_up and f"argo resubmit -n {ns} {first}" in gave_up, got.stdout

    retried = argo_cli(rc, "retry", first, "-n", ns)
    assert retried.returncode == 0, retried.stderr
    _wait(argo_run, "Failed", 120)
    got = argo_cli(rc, "get", first, "-n", ns, "--no-color").stdout
    assert "argo retry replays it" in got, got
    assert [(a.attempt, a.decision) for a in argo_run.ledger().attempts] == [(0, "retry"), (1, "stop")]

    again = argo_cli(rc, "resubmit", first, "-n", ns, "-o", "name")
    assert again.returncode == 0, again.stderr
    argo_run.name = again.stdout.strip().rsplit("/", 1)[-1]
    assert argo_run.name != first
    _trains_to_the_end(argo_run, 2)
    _wait(argo_run, "Succeeded")
    ledger = argo_run.ledger()
    assert [(a.attempt, a.outcome) for a in ledger.attempts][-1] == (2, AttemptOutcome.SUCCEEDED), ledger
    assert ledger.final_status == "Succeeded"


def test_argo_stop_takes_the_gang_and_argo_retry_of_it_is_refused(argo_run):
    """``argo stop`` of a training run: the exit handler deletes the gang and the ledger closes the attempt as
    stopped, charged to no class. ``argo retry`` of the stopped Workflow is refused: Argo replays its classify-failure
    after the exit handler released the run, which stops the Workflow again and says to resubmit; the ledger stays as
    the stop left it."""
    rc, ns = argo_run.rc, argo_run.ns
    name = _submit(argo_run)
    argo_run.workers(0)
    argo_run.beat(0, 5)
    stop = argo_cli(rc, "stop", name, "-n", ns)
    assert stop.returncode == 0 and f"workflow {name} stopped" in stop.stdout, stop
    _wait(argo_run, "Failed", 120)
    gang = f"jobset.sigs.k8s.io/jobset-name={jobset_name(argo_run.cfg.run_id, 0)}"
    wait_for("the stopped run's gang gone", lambda: not rc.pods(ns, gang), 60, 0.5)
    stopped = argo_run.ledger()
    assert [(a.attempt, a.outcome, a.failure_class) for a in stopped.attempts] == [(0, AttemptOutcome.STOPPED, None)]
    logs = argo_cli(rc, "logs", name, "-n", ns)
    assert f"deleted JobSet {argo_run.cfg.run_id}-a0" in logs.stdout, logs.stdout[-3000:]

    retried = argo_cli(rc, "retry", name, "-n", ns)
    assert retried.returncode == 0, retried.stderr
    _wait(argo_run, "Failed", 120)
    got = argo_cli(rc, "get", name, "-n", ns, "--no-color").stdout
    (classify,) = [line for line in got.splitlines() if "classify-failure" in line and "✖" in line]
    assert "argo retry replays it" in classify and f"argo resubmit -n {ns} {name}" in classify, got
    assert argo_run.ledger().attempts == stopped.attempts
    assert not rc.pods(ns, gang)

"""Chaos runs: ``argo/local-cpu.yaml`` with real trainers on the real controllers while a seeded schedule throws
faults at every dependency (``chaos``), then every invariant checked (``chaos.INVARIANTS``). The file's job is
shrunk for them (``trainers.chaos_shape``: two hosts, 30 steps, a checkpoint every 5), so that one run ends within
5 minutes; the faults' window is fitted to its undisturbed run.

``pytest -m chaos`` runs every test's regression seeds (``REGRESSION_SEEDS``: what ``pytest -m k8s`` and CI run),
and ``--chaos-rounds`` seeds more from ``--chaos-first-seed`` (the soak: ``tools/chaos_soak.py``); ``--chaos-seed N``
replays one schedule (repeatable). A failing run prints its fault log and the line that replays it; a seed that
found a bug joins ``REGRESSION_SEEDS``.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import argoctl
import chaos
import pytest
from argoctl import LOCAL_ARGO_FILE
from realcluster import RealCluster, wait_for
from tier import REPO, CpuHosts
from trainers import CHAOS_STEPS, chaos_shape, clean_run, final_digest, new_run

from jaxrec.adapters.store import RunLayout
from jaxrec.model.config import load_config

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.chaos]

# Seeds whose schedule once broke an invariant, by test, each with what it found: run on every tier run.
REGRESSION_SEEDS: dict[str, dict[int, str]] = {
    "test_no_fault_kills_a_healthy_gang_stops_the_run_or_costs_a_step": {
        1: "the process kubelet left a step pod Pending for good after a 503 in its set-up, and its nodes stayed "
        "tainted once the node-lifecycle controller set Ready Unknown (the exit handler never scheduled); an API "
        "server restarted from a fault thread died with the thread (PR_SET_PDEATHSIG); with the metadata faults "
        "drawn beside them: the deleted supervisor's pod stayed Terminating when the API took no confirmation (the "
        "process kubelet now confirms at each resync), its retry came after the gang had completed and re-created "
        "the attempt's JobSet from its restore step (a supervisor now reads the attempt's exit reports first), and "
        "two API server restarts at once left one running untracked; a checkpoint save slowed by GCS resets held "
        "the loop past the 20 s hang timeout and the attempt was called hung (the heartbeat now says the loop waits "
        "for a save, and supervision.save_timeout_s applies); the emulator's resumable sessions went around the "
        "fault proxy and answered a resent final chunk 404 where GCS answers 200, so a reset failed orbax's commit "
        "(the GCS stand-in now answers as GCS); the process kubelet died on a task-result 403 right after an API "
        "restart and left the deleted supervisor's pod Terminating for 10 min (it now fails the wait container "
        "and syncs the status until the API takes it); after an API server restart the real Argo controller's pod "
        "informer delivered nothing for over 10 minutes, so the deleted supervisor's node stayed Running with no pod "
        "in the API (Argo's, not the project's: its pod list keeps no resourceVersion; the test says what holds a "
        "Workflow and restarts the controller, as docs/DEPLOY.md tells an operator); a worker's first save met the "
        "metadata server silent, hung 120 s and sent requests with no token (tensorstore decides on credentials at "
        "its first GCS request: the worker now has it decide right after its own token came)",
        3: "the run ended with no ledger, under a check that could not yet say why (most likely a GCS reset after "
        "validate-config's upload: its retry was refused as a changed config and the Workflow ended before any "
        "attempt; a retried idempotent write that finds its own bytes is now done); "
        "later the supervisor called a capacity stall ('only 1/2 worker pods exist after 6 s') on the view it held "
        "while the API server restarted, the Job controller down with it creating the second pod late (it now "
        "judges no stall on a view it cannot refresh, and counts its clocks from when it can: supervision.view_clock); "
        "then, with kube-controller-manager restarted twice and the API server three times, three attempts in a row "
        "were called capacity ('only 0/2 worker pods exist after 6 s'): pods no controller has created yet now get "
        "supervision.MISSING_PODS_GRACE_S, a restarting controller's leader election; and after the same restarts "
        "a JobSet had neither Job nor pod for 60 s and was called capacity ('only 0/2 worker pods exist after 60 s'): "
        "a JobSet its controller has not acted on is now no capacity stall (the supervisor waits, says so past the "
        "start-up grace, and ends as transient after supervision.JOBSET_UNACTED_LIMIT_S), and missing pods' grace "
        "counts from their Job's creation",
    },
    "test_an_operator_stop_then_the_same_file_again_resumes_under_faults": {
        2: "after argo stop the ledger never closed the attempt the exit handler stopped (store attempts [0, 1], "
        "ledger [1]): finalize now closes it as stopped, charged to no class; later the 30 steps ended about 2 s "
        "after the first commit while the operator's client waited out an API server restart, so the Workflow "
        "ended before the stop (the test now holds the last step's save in the GCS proxy until the stop is in)",
    },
}


def pytest_generate_tests(metafunc):
    if "seed" not in metafunc.fixturenames:
        return
    opt = metafunc.config.getoption
    seeds = opt("--chaos-seed") or [
        *REGRESSION_SEEDS.get(metafunc.function.__name__, {}),
        *range(opt("--chaos-first-seed"), opt("--chaos-first-seed") + opt("--chaos-rounds")),
    ]
    metafunc.parametrize("seed", list(dict.fromkeys(seeds)), ids=lambda s: f"seed{s}")


CHAOS_TEST_LIMIT_S = 360
"""The most one chaos run may take: its end within 5 minutes, then the check and the clean-up (the undisturbed run
it is compared with is a session fixture, bounded by its own wait)."""
GANG_UP_S = 120.0
"""How long a chaos run waits for its first gang to run and commit a checkpoint, or for a stop to end the Workflow:
the undisturbed run has its gang up and a checkpoint committed in well under a minute."""


def _kill_a_worker(r: Any, kills: list[dict[str, Any]], notes: list[str]) -> None:
    """The one real failure of a run: a trainer of attempt 0 SIGKILLed once a checkpoint committed."""
    try:
        pods = r.workers(0, timeout=GANG_UP_S)
        committed, at = r.committed_past(0, timeout=GANG_UP_S)
        os.kill(r.hosts.pid(pods[1]), signal.SIGKILL)
    except (AssertionError, ProcessLookupError) as e:
        notes.append(f"no worker killed: {str(e).splitlines()[0]}")
        return
    kills.append({"attempt": 0, "committed": committed, "at": at, "pod": pods[1]["metadata"]["name"]})


@pytest.mark.timeout(CHAOS_TEST_LIMIT_S, func_only=True)
def test_no_fault_kills_a_healthy_gang_stops_the_run_or_costs_a_step(
    seed: int, real_cluster: RealCluster, cpu_hosts: CpuHosts, gcs_emulator, pods_gcs, chaos_uninterrupted, tmp_path
):
    """Six faults of the seed's schedule (and, for half the seeds, one real worker failure) thrown at a run of
    real trainers; the run Succeeds with the undisturbed run's parameters and every invariant holds."""
    ref, _ = chaos_uninterrupted
    r = new_run(real_cluster, cpu_hosts, gcs_emulator, prefix=f"chaos{seed}", shape=chaos_shape)
    faults, kill = chaos.schedule(seed, window_s=max(30.0, 0.8 * ref.seconds))
    log = chaos.FaultLog(tmp_path / "faults.jsonl")
    sa = load_config(REPO / "configs" / LOCAL_ARGO_FILE).service_account
    sampler = chaos.GangSampler(real_cluster, r.ns, r.run_id).start()
    kills: list[dict[str, Any]] = []
    notes: list[str] = []
    unauthorized = pods_gcs.proxy.unauthorized
    t0 = time.monotonic()
    r.submit()
    thrower = chaos.Chaos(real_cluster, pods_gcs, log, namespace=r.ns, workflow=r.name, steps_sa=sa)
    thrower.run(faults, t0)
    try:
        if kill:
            _kill_a_worker(r, kills, notes)
        wf = _ended(r, notes)
    finally:
        _quiet(thrower, sampler)
    observed = chaos.Observed(
        r,
        wf,
        final_digest(ref),
        kills,
        sampler,
        r.hosts.pods_roots,
        real_cluster.audit_log,
        unauthorized=pods_gcs.proxy.unauthorized - unauthorized,
    )
    violations = _checked(real_cluster, observed)
    notes += [f"worker killed: {kills}"] if kills else []
    report = _record(seed, faults, log, thrower, sampler, t0, violations, notes, wf)
    assert not violations, "\n".join(
        ["invariants violated:", *violations, f"replay: pytest -m chaos --chaos-seed {seed}", report]
    )


QUIET_S = 45.0
"""How long the run's end waits for its last faults to end (each fault's window is at most 30 s, its undo seconds)."""


def _quiet(thrower: chaos.Chaos, sampler: chaos.GangSampler) -> None:
    """Let the last faults end (dead components restarted), then stop sampling the gangs."""
    thrower.wait(QUIET_S)
    thrower.close()
    sampler.stop()


def _checked(rc: RealCluster, o: chaos.Observed) -> list[str]:
    """The invariants checked on what the run left; then the run's objects cleaned away, whatever the check did."""
    try:
        return chaos.check(o)
    finally:
        clean_run(rc, o.run.ns, o.run.run_id)


# What the real Argo controller (v4.0.5) can leave after an API server restart: its pod informer's list function
# returns the pods without the list's resourceVersion (``workflow/controller/pod/controller.go``,
# ``newWorkflowPodWatch``), so after a relist the reflector watches from "now" and a pod deleted between that list and
# that watch is never seen gone (the class of argoproj/argo-workflows#15106). Seen on seed 1: the deleted supervisor's
# pod went during the new API server's start-up, its node stayed Running with no pod in the API for good (over 17
# minutes, through the watch's own renewals), while a new watch of the same pods saw every event. Nothing the run
# does can refresh another component's informer: the test applies what docs/DEPLOY.md tells an operator (restart the
# workflow-controller, which lists every pod again), counts it as a finding, and checks every invariant as usual.
ARGO_CONTROLLER = "workflow-controller-{ns}"


RUN_LIMIT_S = 240.0
"""How long a chaos run's Workflow may take to end from its submission's wait: the undisturbed run and its faults'
recovery, with room; past it the run is reported as it is, with what holds it."""
STALE_S = 45.0
"""How long Argo's stale view (a Running Pod node whose pod the API no longer has) must last to be called stale: Argo
marks a deleted pod's node within seconds once its informer delivers the deletion."""


def _ended(r: Any, notes: list[str], timeout: float = RUN_LIMIT_S) -> dict[str, Any]:
    """The Workflow once it has ended, or within ``timeout`` as it is then, with what holds it (in ``notes``).

    Polled each second; every few seconds the Workflow's Running Pod nodes are matched against the pods in the API.
    A node whose pod has been gone for ``STALE_S`` is Argo's stale view: the controller is restarted once, as an
    operator would (docs/DEPLOY.md), counted as a finding, and the run goes on within the same bound.
    """
    deadline = time.monotonic() + timeout
    gone_since: dict[str, float] = {}
    restarted = False
    next_look = 0.0
    wf: dict[str, Any] = {}
    while True:
        try:
            wf = r.wf()
        except Exception:  # noqa: BLE001 - the API restarting under a fault: look again
            wf = wf or {}
        if ((wf.get("status") or {}).get("phase")) in argoctl.TERMINAL:
            return wf
        now = time.monotonic()
        if now >= deadline:
            notes.append(f"Workflow {r.name} not ended within {timeout:.0f} s")
            notes.append(_why_not_ended(r, wf)[0])
            return wf
        if now >= next_look and not restarted:
            next_look = now + 5
            gone = _running_without_pod(r, wf)
            gone_since = {i: gone_since.get(i, now) for i in gone}
            stale = [i for i, t in gone_since.items() if now - t >= STALE_S]
            if stale:
                notes.append(_why_not_ended(r, wf)[0])
                chaos.SUMMARY.findings += 1
                notes.append(
                    f"finding: Argo's controller showed {len(stale)} Pod node(s) Running {STALE_S:.0f} s after their "
                    "pods left the API; restarted, as an operator would"
                )
                r.rc.restart(ARGO_CONTROLLER.format(ns=r.ns))
                restarted = True
        time.sleep(1)


def _running_without_pod(r: Any, wf: dict[str, Any]) -> set[str]:
    """The ids of the Workflow's Running Pod nodes whose pod the API does not have (none when the pods cannot be
    read: an unanswered list is not absence)."""
    nodes = ((wf.get("status") or {}).get("nodes") or {}).values()
    running = {n["id"] for n in nodes if n.get("type") == "Pod" and n.get("phase") == "Running"}
    if not running:
        return set()
    try:
        have = {p["metadata"].get("annotations", {}).get("workflows.argoproj.io/node-id") for p in r.rc.pods(r.ns)}
    except Exception:  # noqa: BLE001 - unknown is not absence: look again at the next poll
        return set()
    return running - have


def _why_not_ended(r: Any, wf: dict[str, Any]) -> tuple[str, bool]:
    """What holds a Workflow that has not ended: each unfinished Pod node's pod as the API has it (phase, deletion,
    containers), and the lines the process kubelets and Argo's controllers logged about it; and whether it is only
    Argo's stale view (a node Running whose pod the API no longer has)."""
    nodes = ((wf.get("status") or {}).get("nodes") or {}).values()
    open_ = {n["id"]: n for n in nodes if n.get("type") == "Pod" and n.get("phase") in ("Pending", "Running")}
    running = [i for i, n in open_.items() if n.get("phase") == "Running"]
    try:
        pods = {p["metadata"].get("annotations", {}).get("workflows.argoproj.io/node-id"): p for p in r.rc.pods(r.ns)}
    except Exception as e:  # noqa: BLE001 - a diagnosis: what could not be read is said
        return f"pods not read: {e}", False
    dead = [c.name for c in r.rc.components.values() if not c.alive()]
    lines = [f"unfinished pod nodes: {len(open_)}; components not running: {dead or 'none'}"]
    for node_id, n in open_.items():
        pod = pods.get(node_id)
        if pod is None:
            lines.append(f"  {n.get('displayName')}: {n.get('phase')} in the Workflow, no pod in the API")
            continue
        meta, status = pod["metadata"], pod.get("status") or {}
        states = {c["name"]: list(c.get("state") or {})[:1] for c in status.get("containerStatuses") or []}
        lines.append(
            f"  {n.get('displayName')}: pod {meta['name']} {status.get('phase')} on {pod['spec'].get('nodeName')}, "
            f"deletion {meta.get('deletionTimestamp')}, finalizers {meta.get('finalizers')}, containers {states}"
        )
        for c in r.rc.components.values():
            said = [ln for ln in c.tail(100_000).splitlines() if meta["name"] in ln][-15:]
            lines += [f"    {c.name} ({'alive' if c.alive() else 'dead'}): {ln[:300]}" for ln in said]
    # Argo's stale view: every unfinished node Running (a pod it saw start) and gone from the API. A Pending node
    # with no pod (creation refused: admission, RBAC, quota) is not that, and is not waited on.
    stale = bool(open_) and not dead and len(running) == len(open_) and all(i not in pods for i in open_)
    return "\n".join(lines), stale


def _current_test() -> str:
    """The running test's node id (pytest sets it in the environment for the duration of each phase)."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


def _record(seed, faults, log, thrower, sampler, t0, violations, notes, wf) -> str:
    """Count the run in the session's summary; its report (printed, and the failure message)."""
    s = chaos.SUMMARY
    s.runs += 1
    s.kinds.update(log.kinds)
    s.violations += len(violations)
    exits = thrower.rc.exits[thrower.exits_from :]
    s.findings += len(exits)
    notes += [f"finding: {e}; started again, as its kubelet would" for e in exits]
    chaos.RUNS[_current_test()] = {
        "faults": dict(log.kinds),
        "violations": len(violations),
        "notes": [n.splitlines()[0][:200] for n in notes if n],
    }
    if violations:
        s.failing.append(seed)
    report = "\n".join(
        [
            f"seed {seed}: {len(faults)} faults; {time.monotonic() - t0:.0f} s; gang samples {sampler.samples} "
            f"({sampler.failed} unanswered), most live gangs {sampler.most}",
            *notes,
            *thrower.errors,
            "faults:",
            log.path.read_text() if log.path.exists() else "(none)",
            argoctl.summary(wf) if wf else "(no Workflow)",
        ]
    )
    print(report)
    return report


OPERATOR_ACTIONS = ("stop", "terminate", "delete")


def _safe_change(cfg: dict[str, Any]) -> None:
    cfg["monitoring"]["no_step_alert_minutes"] += 1  # safe in the compatibility table, and numerics unchanged


def _unsafe_change(cfg: dict[str, Any]) -> None:
    cfg["data"]["seed"] += 1  # unsafe: the saved data position would point into another order


# How the operator submits again after the stop: the same file; with a safe config change (and
# accept-safe-changes=true); with an unsafe one, which validate-config refuses, and then the same file.
RESUBMISSIONS = ("same", "safe", "unsafe")


FINAL_SAVE_HELD_S = 90.0
"""How long the operator test holds the last step's save at most: within the trainer's and supervisor's
``save_timeout_s`` (120 s in the local file), so a held save is never a hang."""

OPERATOR_RETRY_S = 90.0
"""How long the operator tries again while the API server does not answer or answers 429/5xx (it may be starting
after a fault: "the request has been made before all known HTTP paths have been installed", 503 Retry-After), as a
person running ``argo stop`` again would: an API server restart takes 6-30 s here, a fault's outage up to 20 s."""


def _operator(r: Any, rc: RealCluster, action: str) -> None:
    """``argo stop`` / ``argo terminate`` (the Workflow's ``spec.shutdown``, what the CLI patches) or
    ``argo delete``, tried again through a transient answer; returns once the Workflow has ended or is gone."""
    from kubernetes import client
    from podexec import retrying

    objs = client.CustomObjectsApi(rc.admin)
    where = ("argoproj.io", "v1alpha1", r.ns, "workflows")
    if action == "delete":

        def delete() -> None:
            try:
                objs.delete_namespaced_custom_object(*where, r.name)
            except client.ApiException as e:
                if e.status != 404:  # gone: an earlier try that was answered 5xx had deleted it
                    raise

        retrying(f"argo delete {r.name}", delete, OPERATOR_RETRY_S)
        wait_for(f"Workflow {r.name} gone", lambda: not _exists(objs, where, r.name), 120, 0.5)
        return
    shutdown = {"spec": {"shutdown": action.capitalize()}}
    retrying(
        f"argo {action} {r.name}",
        lambda: objs.patch_namespaced_custom_object(*where, r.name, shutdown),
        OPERATOR_RETRY_S,
    )
    r.wait_done(GANG_UP_S)


def _exists(objs: Any, where: tuple[str, ...], name: str) -> bool:
    from kubernetes import client

    try:
        objs.get_namespaced_custom_object(*where, name)
    except client.ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


@pytest.mark.timeout(CHAOS_TEST_LIMIT_S, func_only=True)
def test_an_operator_stop_then_the_same_file_again_resumes_under_faults(
    seed: int, real_cluster: RealCluster, cpu_hosts: CpuHosts, gcs_emulator, pods_gcs, chaos_uninterrupted, tmp_path
):
    """While the seed's faults fly, an operator stops, terminates or deletes the Workflow once a checkpoint has
    committed, then submits the file again with the same run id, as it was, with a safe config change, or first
    with an unsafe one (refused: it ends Failed and deletes nothing) and then as it was: the last Workflow adopts
    or restores the run and Succeeds with the undisturbed run's parameters; never two live gangs, and nothing the
    stop ended is charged."""
    ref, _ = chaos_uninterrupted
    rng = random.Random(seed)
    action = rng.choice(OPERATOR_ACTIONS)
    again = rng.choice(RESUBMISSIONS)
    r = new_run(real_cluster, cpu_hosts, gcs_emulator, prefix=f"op{seed}", shape=chaos_shape)
    faults, _ = chaos.schedule(seed + 10_000, window_s=max(30.0, 0.8 * ref.seconds), faults=4)
    log = chaos.FaultLog(tmp_path / "faults.jsonl")
    sa = load_config(REPO / "configs" / LOCAL_ARGO_FILE).service_account
    sampler = chaos.GangSampler(real_cluster, r.ns, r.run_id).start()
    unauthorized = pods_gcs.proxy.unauthorized
    t0 = time.monotonic()
    # The last step's save answered slowly until the operator has acted: the run cannot end before the stop
    # lands (its 30 steps take 2-3 s past the first commit, less than one API server restart).
    pods_gcs.proxy.hold_matching(f"{r.run_id}/{RunLayout.CHECKPOINTS}/{CHAOS_STEPS}/", FINAL_SAVE_HELD_S)
    first = r.submit()
    thrower = chaos.Chaos(real_cluster, pods_gcs, log, namespace=r.ns, workflow=first, steps_sa=sa)
    thrower.run(faults, t0)
    wf: dict[str, Any] = {}
    notes = [f"operator: {action} of {first}, then the file again: {again}"]
    refused = None
    try:
        r.workers(0, timeout=GANG_UP_S)
        r.committed_past(0, timeout=GANG_UP_S)
        stopped_at = time.time()
        _operator(r, real_cluster, action)
        pods_gcs.proxy.release()
        notes.append(f"the last step's save held: {pods_gcs.proxy.held} requests")
        if again == "unsafe":
            refused = _refused(r, thrower, notes)
        params = {"accept-safe-changes": "true"} if again == "safe" else {}
        last = r.submit(params, _safe_change if again == "safe" else None)
        thrower.workflow = last
        wf = _ended(r, notes)
    finally:
        pods_gcs.proxy.release()
        _quiet(thrower, sampler)
    names = (first, *((refused[0],) if refused else ()), last)
    observed = chaos.Observed(
        r,
        wf,
        final_digest(ref),
        [],
        sampler,
        r.hosts.pods_roots,
        real_cluster.audit_log,
        operator=(action, stopped_at),
        workflows=names,
        refused=refused,
        unauthorized=pods_gcs.proxy.unauthorized - unauthorized,
    )
    violations = _checked(real_cluster, observed)
    report = _record(seed, faults, log, thrower, sampler, t0, violations, notes, wf)
    assert not violations, "\n".join(
        ["invariants violated:", *violations, f"replay: pytest -m chaos --chaos-seed {seed}", report]
    )


def _refused(r: Any, thrower: chaos.Chaos, notes: list[str]) -> tuple[str, float, float, str]:
    """Submit the file with an unsafe config change and wait for its end: its name, window and phase."""
    began = time.time()
    name = r.submit(edit_config=_unsafe_change)
    thrower.workflow = name
    wf = _ended(r, notes)
    status = wf.get("status") or {}
    nodes = (status.get("nodes") or {}).values()
    pods = [n for n in nodes if n.get("templateName") == "validate-config" and n.get("type") == "Pod"]
    pods.sort(key=lambda n: n.get("startedAt") or "")
    ended = [n.get("phase") for n in pods]
    notes.append(f"unsafe resubmission {name}: {status.get('phase')}; validate-config {ended}")
    # Failed by validate-config's refusal: its last pod failed (a pod a fault deleted before it may be an Error).
    refused = status.get("phase") == "Failed" and ended[-1:] == ["Failed"]
    return name, began, time.time(), "Failed" if refused else f"{status.get('phase')}, validate-config {ended}"

"""Chaos on the real controllers: faults thrown at random, several at a time, while a real run of
``argo/local-cpu.yaml`` trains, and the invariants that must hold whatever happened.

A seed makes the schedule (``schedule``): which faults, at what second after the submission, for how long, against
what. Each fault is made by a real component where one can make it:

- Kubernetes API: etcd stopped (``SIGSTOP``) or slowed (stopped and continued in turns) under the real API server,
  which answers 5xx and times out; the API server restarted (every watch cut; compaction every 30 s makes a resumed
  watch meet ``410 Gone``); real API Priority and Fairness limits on the steps' ServiceAccount with a noisy
  neighbour on the same priority level (real 429s).
- GCS: the emulator behind toxiproxy (TCP: connections reset, slow answers, a request that never answers) and the
  HTTP proxy of the local rehearsals in front of it (5xx and 429 with GCS's bodies: the emulator never sends them).
- Credentials: the metadata stand-in the pods' google-auth and tensorstore get their tokens from
  (``metadata_server``, Workload Identity's token endpoint on GKE) answers 5xx or 429, never answers, or answers
  late. Drawn from a stream of their own (``METADATA_KINDS``), so that a seed's other faults are what they were.
- Controllers restarted mid-run: JobSet, Argo's workflow-controller, kube-controller-manager, kube-scheduler.
- Step pods of the run deleted at random (whichever step is running: the supervisor, provision-slice, ...).
- A real worker failure in some runs (a trainer SIGKILLed after a checkpoint committed): the one fault that is
  allowed to cost an attempt.

Every fault lands in ``faults.jsonl`` with its time, kind, target and what it did. After the run, ``check`` reads
the API server's audit log (who deleted what, when), the run store, the Workflow and the step pods' logs, and
returns one line per violated invariant (``INVARIANTS``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from realcluster import RealCluster, wait_for

INVARIANTS = (
    "the Workflow Succeeds with the undisturbed run's final parameters",
    "injected transients charge no failure budget: failed attempts <= real worker failures, each of its class",
    "every attempt is closed once, in order, and the run's ledger says Succeeded",
    "a real worker failure loses no committed checkpoint",
    "never two live gangs of one run",
    "no JobSet is deleted by a step before a supervisor's verdict on its attempt; no step deletes a pod",
    "no step prints a traceback",
    "every GCS request of the pods carries a token the metadata server issued",
)

# name -> weight: how often a schedule draws the kind.
KINDS = {
    "etcd-pause": 3,
    "etcd-slow": 2,
    "apiserver-restart": 2,
    "apf-throttle": 2,
    "controller-restart": 3,
    "gcs-error": 3,
    "gcs-latency": 2,
    "gcs-reset": 2,
    "gcs-hang": 2,
    "step-pod-delete": 3,
}
# Drawn apart from KINDS (one or two a run, from a generator of their own): added after seeds had become regression
# tests, whose other faults stay what they were.
METADATA_KINDS = ("metadata-error", "metadata-hang", "metadata-slow")
# Aimed at the one request or second that matters (one a run, from a generator of their own as well): every
# checkpoint manifest write refused 503 while the rest of GCS answers (a save's commit on a store blip); the metadata
# server silent from the moment the next step pod of the run is created (a pod's first seconds on a fresh node).
AIMED_KINDS = ("gcs-manifest-error", "metadata-step-start")
# Aimed at a stall clock (one a run, from a generator of its own, added after the others): the API server down from
# the moment the run's first gang has a pod, while the supervisor's start-up clocks (capacity, pull) would count, for
# longer than the start-up deadline (6 s in the local file): no verdict may come of a view it cannot refresh.
STALL_KINDS = ("apiserver-down-at-gang-start",)
CONTROLLERS = ("jobset", "kube-controller-manager", "kube-scheduler", "workflow-controller")


@dataclass
class Summary:
    """What the session's chaos runs threw and found (the tier's summary line)."""

    runs: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    violations: int = 0
    failing: list[int] = field(default_factory=list)
    findings: int = 0  # what the real components did that the invariants tolerate (docs/TESTING.md, "Chaos")

    def line(self) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.kinds.items())) or "none"
        failing = f" (seeds {', '.join(map(str, self.failing))})" if self.failing else ""
        return (
            f"chaos: {self.runs} run(s), {sum(self.kinds.values())} fault(s) injected ({kinds}), "
            f"{self.violations} invariant violation(s){failing}"
            + (f", {self.findings} finding(s) of the real components" if self.findings else "")
        )


SUMMARY = Summary()
RUNS: dict[str, dict[str, Any]] = {}
"""What each chaos run threw and found, by test id (``_record`` in test_chaos); the results file's lines."""


@dataclass
class Fault:
    """One fault of a schedule: ``kind`` against ``target`` from ``at`` s after the submission, for ``seconds``."""

    at: float
    kind: str
    seconds: float = 0.0
    target: str = ""
    params: dict[str, Any] = field(default_factory=dict)


def schedule(seed: int, window_s: float, faults: int = 6) -> tuple[list[Fault], bool]:
    """The seed's faults (sorted by start) over ``window_s`` seconds, and whether a worker is killed as well."""
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items(), strict=True)
    out = []
    for _ in range(faults):
        kind = rng.choices(kinds, weights)[0]
        f = Fault(round(rng.uniform(2, window_s), 1), kind, round(rng.uniform(3, 12), 1))
        if kind == "controller-restart":
            f.target, f.seconds = rng.choice(CONTROLLERS), 0.0
        elif kind in ("apiserver-restart", "step-pod-delete"):
            f.seconds = 0.0
        elif kind == "gcs-error":
            f.params = {"status": rng.choice((503, 429)), "share": rng.choice((0.3, 1.0))}
        elif kind == "gcs-latency":
            f.params = {"latency": rng.choice((500, 2000, 5000)), "jitter": 200}
        elif kind in ("gcs-reset", "gcs-hang"):
            f.params = {"toxicity": rng.choice((0.3, 1.0))}
        out.append(f)
    kill = rng.random() < 0.5
    aimed = _metadata_faults(seed, window_s) + _aimed_faults(seed, window_s) + _stall_faults(seed, window_s)
    return sorted(out + aimed, key=lambda f: f.at), kill


def _aimed_faults(seed: int, window_s: float) -> list[Fault]:
    rng = random.Random(f"aimed-{seed}")
    kind = rng.choice(AIMED_KINDS)
    return [Fault(round(rng.uniform(2, window_s), 1), kind, round(rng.uniform(3, 12), 1))]


def _stall_faults(seed: int, window_s: float) -> list[Fault]:
    """At the schedule's earliest time: the fault itself waits for the first gang's first pod."""
    rng = random.Random(f"stall-{seed}")
    return [Fault(2.0, rng.choice(STALL_KINDS), round(rng.uniform(8, 20), 1))]


def _metadata_faults(seed: int, window_s: float) -> list[Fault]:
    rng = random.Random(f"metadata-{seed}")
    out = []
    for _ in range(rng.choice((1, 2))):
        f = Fault(round(rng.uniform(2, window_s), 1), rng.choice(METADATA_KINDS), round(rng.uniform(3, 12), 1))
        if f.kind == "metadata-error":
            f.params = {"status": rng.choice((503, 500, 429)), "share": rng.choice((0.5, 1.0))}
        elif f.kind == "metadata-slow":
            f.params = {"delay": rng.choice((1.0, 2.5, 5.0))}
        out.append(f)
    return out


STEP_START_WAIT_S = 30.0
"""How long an aimed metadata fault waits for the run's next step pod to be created."""
GANG_START_WAIT_S = 90.0
"""How long a stall fault waits for the run's first worker pod (the undisturbed run has its gang up in seconds)."""


class FaultLog:
    """``faults.jsonl``: one line per fault (when it began and ended, what it did), and counts by kind."""

    def __init__(self, path: Path):
        self.path = path
        self.kinds: Counter[str] = Counter()
        self._lock = threading.Lock()

    def write(self, fault: Fault, began: float, ended: float, **did: Any) -> None:
        with self._lock:
            self.kinds[fault.kind] += 1
            with self.path.open("a") as out:
                out.write(json.dumps({**asdict(fault), "began": began, "ended": ended, **did}) + "\n")


@dataclass
class Gcs:
    """The GCS emulator as the pods reach it: the HTTP fault proxy in front of toxiproxy in front of the emulator
    (``proxy`` is ``workflows.local.outage.OutageProxy``, ``tcp`` a toxiproxy proxy, or None where not built), and
    the metadata server their credentials come from (``metadata_server.MetadataServer``)."""

    proxy: Any
    tcp: Any
    metadata: Any
    env: dict[str, str]


class Chaos:
    """Throws a schedule's faults at a running run; ``close`` undoes whatever is still in effect."""

    def __init__(self, rc: RealCluster, gcs: Gcs, log: FaultLog, *, namespace: str, workflow: str, steps_sa: str):
        self.rc, self.gcs, self.log = rc, gcs, log
        self.namespace, self.workflow, self.steps_sa = namespace, workflow, steps_sa
        self._undo: list[Callable[[], None]] = []
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []
        self.exits_from = len(rc.exits)  # the control plane's exits nobody asked for before this run

    def run(self, faults: Iterable[Fault], t0: float) -> None:
        """Start each fault at its time (one thread per fault, so that they overlap)."""
        for f in faults:
            t = threading.Thread(target=self._one, args=(f, t0), name=f"chaos-{f.kind}", daemon=True)
            t.start()
            self._threads.append(t)

    def wait(self, timeout: float) -> None:
        """Wait for every fault to have ended, ``timeout`` seconds at most in all."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _one(self, f: Fault, t0: float) -> None:
        time.sleep(max(0.0, t0 + f.at - time.monotonic()))
        began = time.time()
        try:
            did = getattr(self, "_" + f.kind.replace("-", "_"))(f) or {}
        except Exception as e:  # noqa: BLE001 - a fault that could not be made is reported, never silent
            did = {"error": f"{type(e).__name__}: {e}"}
            self.errors.append(f"{f.kind} at {f.at}s: {did['error']}")
        self.log.write(f, began, time.time(), **did)

    # --- Kubernetes API ---------------------------------------------------------------------------------------

    def _etcd_pause(self, f: Fault) -> dict[str, Any]:
        pid = self.rc.components["etcd"].proc.pid
        os.kill(pid, signal.SIGSTOP)
        self._undo.append(lambda: os.kill(pid, signal.SIGCONT))
        try:
            time.sleep(f.seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
        return {"target": "etcd"}

    def _etcd_slow(self, f: Fault) -> dict[str, Any]:
        pid = self.rc.components["etcd"].proc.pid
        self._undo.append(lambda: os.kill(pid, signal.SIGCONT))
        end = time.monotonic() + f.seconds
        while time.monotonic() < end:  # etcd answers half the time, in turns of 0.7 s
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.7)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.7)
        return {"target": "etcd"}

    def _apiserver_restart(self, f: Fault) -> dict[str, Any]:
        t = time.monotonic()
        self.rc.restart("kube-apiserver")
        wait_for("kube-apiserver /readyz after restart", lambda: self.rc._https("/readyz") == "ok", 90, 0.3)
        return {"target": "kube-apiserver", "down_s": round(time.monotonic() - t, 1)}

    def _apiserver_down_at_gang_start(self, f: Fault) -> dict[str, Any]:
        """The API server stopped for ``seconds`` from the moment a worker pod of the run exists (at most
        ``GANG_START_WAIT_S`` after the fault's time; none by then: no fault), then started and ready again."""
        began = time.time()

        def gang_pod() -> str | None:
            for p in self.rc.pods(self.namespace, "jobset.sigs.k8s.io/jobset-name"):
                meta = p["metadata"]
                at = datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00")).timestamp()
                if at >= began - 1:
                    return f"{meta['name']} ({(p.get('status') or {}).get('phase')})"
            return None

        try:
            pod = wait_for("a worker pod of the run", gang_pod, GANG_START_WAIT_S, 0.2)
        except AssertionError:
            return {"target": "kube-apiserver", "pod": None}
        t = time.monotonic()
        self.rc.down_for("kube-apiserver", f.seconds)
        wait_for("kube-apiserver /readyz after its outage", lambda: self.rc._https("/readyz") == "ok", 90, 0.3)
        return {"target": "kube-apiserver", "pod": pod, "down_s": round(time.monotonic() - t, 1)}

    def _apf_throttle(self, f: Fault) -> dict[str, Any]:
        """Real APF: the steps' ServiceAccount on a priority level of its own with the fewest seats and no queue
        (``Reject``), and a neighbour on the same level (the same ServiceAccount's token, as another tenant's
        controller sharing an identity would be) that keeps its seats busy."""
        from kubernetes import client

        name = f"chaos-{self.namespace}"
        plc = {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "PriorityLevelConfiguration",
            "metadata": {"name": name},
            "spec": {
                "type": "Limited",
                "limited": {
                    "nominalConcurrencyShares": 1,
                    "lendablePercent": 0,
                    "borrowingLimitPercent": 0,
                    "limitResponse": {"type": "Reject"},
                },
            },
        }
        fs = {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "FlowSchema",
            "metadata": {"name": name},
            "spec": {
                "priorityLevelConfiguration": {"name": name},
                "matchingPrecedence": 50,
                "distinguisherMethod": {"type": "ByUser"},
                "rules": [
                    {
                        "subjects": [
                            {
                                "kind": "ServiceAccount",
                                "serviceAccount": {"name": self.steps_sa, "namespace": self.namespace},
                            }
                        ],
                        "resourceRules": [
                            {
                                "verbs": ["*"],
                                "apiGroups": ["*"],
                                "resources": ["*"],
                                "namespaces": ["*"],
                                "clusterScope": True,
                            }
                        ],
                        "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}],
                    }
                ],
            },
        }
        objs = client.CustomObjectsApi(self.rc.admin)
        where = ("flowcontrol.apiserver.k8s.io", "v1")

        def remove() -> None:
            for plural in ("flowschemas", "prioritylevelconfigurations"):
                with contextlib.suppress(client.ApiException):
                    objs.delete_cluster_custom_object(*where, plural, name)

        self._undo.append(remove)
        self.rc.apply(plc)
        self.rc.apply(fs)
        token = self.rc.token_for(self.namespace, self.steps_sa)
        counts: Counter[int] = Counter()
        end = time.monotonic() + f.seconds

        def neighbour() -> None:
            core = client.CoreV1Api(self.rc.api(token))
            while time.monotonic() < end:
                try:
                    core.list_namespaced_pod(self.namespace, _request_timeout=5)
                    counts[200] += 1
                except client.ApiException as e:
                    counts[e.status] += 1
                except Exception:  # noqa: BLE001 - the neighbour counts answers; a reset is not one
                    counts[0] += 1

        load = [threading.Thread(target=neighbour, daemon=True) for _ in range(8)]
        for t in load:
            t.start()
        for t in load:
            t.join(f.seconds + 10)
        remove()
        return {"target": f"serviceaccount {self.namespace}/{self.steps_sa}", "neighbour": dict(counts)}

    # --- controllers and step pods ------------------------------------------------------------------------------

    def _controller_restart(self, f: Fault) -> dict[str, Any]:
        name = f.target
        if name == "workflow-controller":
            name = next(n for n in self.rc.components if n == f"workflow-controller-{self.namespace}")
        t = time.monotonic()
        self.rc.restart(name)
        return {"component": name, "down_s": round(time.monotonic() - t, 1)}

    def _step_pod_delete(self, f: Fault) -> dict[str, Any]:
        pods = [
            p
            for p in self.rc.pods(self.namespace, f"workflows.argoproj.io/workflow={self.workflow}")
            if p["status"].get("phase") in ("Pending", "Running") and not p["metadata"].get("deletionTimestamp")
        ]
        if not pods:
            return {"deleted": None}
        rng = random.Random(f.at)
        pod = rng.choice(sorted(pods, key=lambda p: p["metadata"]["name"]))
        self.rc.core().delete_namespaced_pod(pod["metadata"]["name"], self.namespace)
        return {
            "deleted": pod["metadata"]["name"],
            "step": pod["metadata"]["annotations"].get("workflows.argoproj.io/node-name"),
        }

    # --- GCS ------------------------------------------------------------------------------------------------

    def _gcs_error(self, f: Fault) -> dict[str, Any]:
        before = self.gcs.proxy.refused
        self.gcs.proxy.fail_for(f.seconds, f.params["status"], f.params["share"])
        time.sleep(f.seconds)
        return {"target": "gcs", "refused": self.gcs.proxy.refused - before}

    def _gcs_manifest_error(self, f: Fault) -> dict[str, Any]:
        before = self.gcs.proxy.refused
        self.gcs.proxy.fail_matching("manifest.json", f.seconds, 503)
        time.sleep(f.seconds)
        return {"target": "gcs: checkpoint manifests", "refused": self.gcs.proxy.refused - before}

    def _toxic(self, f: Fault, kind: str, attributes: dict[str, Any]) -> dict[str, Any]:
        if self.gcs.tcp is None:
            raise RuntimeError("toxiproxy is not built (tools/k8s/build.sh)")
        tcp = self.gcs.tcp
        name = tcp.add(kind, attributes, toxicity=f.params.get("toxicity", 1.0), name=f"{f.kind}-{f.at}")
        self._undo.append(lambda: tcp.remove(name))
        try:
            time.sleep(f.seconds)
        finally:
            with contextlib.suppress(Exception):
                tcp.remove(name)
        return {"target": "gcs", "toxic": name}

    def _gcs_latency(self, f: Fault) -> dict[str, Any]:
        return self._toxic(f, "latency", {"latency": f.params["latency"], "jitter": f.params["jitter"]})

    def _gcs_reset(self, f: Fault) -> dict[str, Any]:
        return self._toxic(f, "reset_peer", {"timeout": 0})

    def _gcs_hang(self, f: Fault) -> dict[str, Any]:
        return self._toxic(f, "timeout", {"timeout": 0})

    # --- credentials: the metadata server -----------------------------------------------------------------

    def _metadata(self, f: Fault, start: Callable[[], None]) -> dict[str, Any]:
        md = self.gcs.metadata
        before = dict(md.counts)
        start()
        time.sleep(f.seconds)
        return {"target": "metadata", **{k: n - before.get(k, 0) for k, n in md.counts.items() if k != "tokens"}}

    def _metadata_error(self, f: Fault) -> dict[str, Any]:
        md = self.gcs.metadata
        return self._metadata(f, lambda: md.fail_for(f.seconds, f.params["status"], f.params["share"]))

    def _metadata_hang(self, f: Fault) -> dict[str, Any]:
        return self._metadata(f, lambda: self.gcs.metadata.hang_for(f.seconds))

    def _metadata_step_start(self, f: Fault) -> dict[str, Any]:
        """The metadata server silent for ``seconds`` from the creation of the run's next step pod (at most
        ``STEP_START_WAIT_S`` after the fault's time; none created by then: no fault)."""
        began = time.time()
        sel = f"workflows.argoproj.io/workflow={self.workflow}"

        def created() -> str | None:
            for p in self.rc.pods(self.namespace, sel):
                meta = p["metadata"]
                at = datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00")).timestamp()
                if at >= began - 1:
                    return meta["name"]
            return None

        try:
            pod = wait_for("a step pod created", created, STEP_START_WAIT_S, 0.2)
        except AssertionError:
            return {"target": "metadata", "pod": None}
        return {"pod": pod, **self._metadata(f, lambda: self.gcs.metadata.hang_for(f.seconds))}

    def _metadata_slow(self, f: Fault) -> dict[str, Any]:
        return self._metadata(f, lambda: self.gcs.metadata.slow_for(f.seconds, f.params["delay"]))

    def close(self) -> None:
        """Undo every fault still in effect (etcd continued, toxics removed, APF objects deleted)."""
        for undo in reversed(self._undo):
            with contextlib.suppress(Exception):
                undo()
        self.gcs.proxy.fail_for(0)
        self.gcs.proxy.fail_matching("", 0)
        self.gcs.metadata.clear()
        for name in list(self.rc.components):
            if not self.rc.components[name].alive():
                self.errors.append(f"{name} was not running after the faults: started again")
                self.rc.components[name].start()


class GangSampler:
    """Samples the run's worker pods every second: the most gangs (JobSets) seen live at once, and when."""

    def __init__(self, rc: RealCluster, namespace: str, run_id: str):
        self.rc, self.namespace, self.run_id = rc, namespace, run_id
        self.most: tuple[int, list[str]] = (0, [])
        self.samples = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gang-sampler", daemon=True)

    def start(self) -> GangSampler:
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                resp = self.rc.core().list_namespaced_pod(
                    self.namespace,
                    label_selector=f"jaxrec/run-id={self.run_id},jobset.sigs.k8s.io/jobset-name",
                    _request_timeout=3,
                    _preload_content=False,
                )
                pods = json.loads(resp.data)["items"]
            except Exception:  # noqa: BLE001 - an API fault: no sample this second
                self.failed += 1
                continue
            self.samples += 1
            live = sorted(
                {
                    p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"]
                    for p in pods
                    if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
                }
            )
            if len(live) > self.most[0]:
                self.most = (len(live), live)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _ts(s: str) -> float:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def audit_deletes(path: Path, namespace: str) -> list[dict[str, Any]]:
    """The audit log's successful deletes in ``namespace``: resource, name, user and time (s since the epoch)."""
    out = []
    with contextlib.suppress(FileNotFoundError), path.open() as f:
        for line in f:
            ev = json.loads(line)
            ref = ev.get("objectRef") or {}
            code = (ev.get("responseStatus") or {}).get("code")
            if ev.get("stage") != "ResponseComplete" or ref.get("namespace") != namespace or code not in (200, 202):
                continue
            user = (ev.get("user") or {}).get("username", "")
            at = _ts(ev["requestReceivedTimestamp"])
            out.append(
                {"verb": ev["verb"], "resource": ref.get("resource"), "name": ref.get("name"), "user": user, "at": at}
            )
    return out


def step_tracebacks(pods_roots: Iterable[Path], namespace: str, workflow: str) -> list[str]:
    """The step pods' logs (podexec's pod folders) of ``workflow`` that print a traceback."""
    found = []
    for root in pods_roots:
        for log in sorted(root.glob(f"{namespace}_{workflow}-*/*.log")):
            if "Traceback (most recent call last)" in log.read_text(errors="replace"):
                found.append(str(log))
    return found


@dataclass
class Observed:
    """What a chaos run did and saw: the inputs of ``check``."""

    run: Any  # trainers.TrainerRun
    wf: dict[str, Any]
    reference_digest: str
    kills: list[dict[str, Any]]  # {"attempt", "committed", "at"} of each real worker failure
    sampler: GangSampler
    pods_roots: tuple[Path, ...]
    audit_log: Path
    # An operator's action (``argo stop``, terminate, delete) and when: what it ends is not charged to the run.
    operator: tuple[str, float] | None = None
    workflows: tuple[str, ...] = ()  # every Workflow of the run (default: the run's one)
    # A resubmission whose config validate-config had to refuse: its name, when it was submitted and ended, and
    # its phase. It must end Failed having deleted nothing (it never held the run).
    refused: tuple[str, float, float, str] | None = None
    unauthorized: int = 0  # GCS requests of the pods that carried no issued token (the proxy answered 401)


def check(o: Observed) -> list[str]:
    """One line per violated invariant (``INVARIANTS``); empty when every one held."""
    from trainers import final_digest

    from jaxrec.adapters.documents import read_ledger, read_worker_reports
    from jaxrec.adapters.store import RunLayout
    from jaxrec.model.names import jobset_name
    from jaxrec.model.records import SupervisionRecord

    r, bad = o.run, []
    phase = (o.wf.get("status") or {}).get("phase")
    if phase != "Succeeded":
        bad.append(f"the Workflow ended {phase}: {(o.wf.get('status') or {}).get('message', '')}")
    else:
        digest = final_digest(r)
        if digest != o.reference_digest:
            bad.append(f"final parameters {digest} differ from the undisturbed run's {o.reference_digest}")
    ledger = read_ledger(r.store)
    if ledger is None:
        return [*bad, "the run has no ledger: no attempt was closed"]
    stopped_at = o.operator[1] if o.operator else float("inf")
    failed = [a for a in ledger.attempts if a.outcome != "succeeded" and (a.closed_at or 0) < stopped_at]
    if len(failed) > len(o.kills) or any(a.failure_class != "infrastructure" for a in failed):
        bad.append(
            f"{len(failed)} failed attempt(s) for {len(o.kills)} real worker failure(s): "
            + "; ".join(f"attempt {a.attempt} {a.outcome} {a.failure_class}: {a.reason}" for a in failed)
        )
    numbers = [a.attempt for a in ledger.attempts]
    if numbers != list(range(len(numbers))) or sorted(r.store.attempts()) != numbers:
        bad.append(f"ledger attempts {numbers}, store attempts {r.store.attempts()}")
    if ledger.final_status != "Succeeded" and phase == "Succeeded":
        bad.append(f"ledger final status {ledger.final_status}: {ledger.final_reason}")
    for k in o.kills:
        reports = read_worker_reports(r.store, k["attempt"] + 1)[0]
        restored = min((w.restore_step for w in reports if w.restore_step is not None), default=None)
        if restored is None or restored < k["committed"]:
            bad.append(
                f"after the worker killed at step {k['at']} attempt {k['attempt'] + 1} restored {restored}, "
                f"older than the checkpoint committed before the kill ({k['committed']})"
            )
    if o.sampler.most[0] > 1:
        bad.append(f"{o.sampler.most[0]} live gangs at once: {o.sampler.most[1]}")
    product = f"system:serviceaccount:{r.ns}:"
    names = {jobset_name(r.run_id, a): a for a in range(len(numbers) + 1)}
    if o.unauthorized:
        bad.append(f"{o.unauthorized} GCS request(s) of the pods carried no token the metadata server issued")
    if o.refused and o.refused[3] != "Failed":
        bad.append(f"the resubmission {o.refused[0]} with an unsafe config change ended {o.refused[3]}, not Failed")
    for d in audit_deletes(o.audit_log, r.ns):
        if not d["user"].startswith(product):
            continue
        if o.refused and o.refused[1] <= d["at"] <= o.refused[2]:
            bad.append(
                f"{d['user']} deleted {d['resource']} {d['name']} while only {o.refused[0]}, whose config "
                "was refused, ran"
            )
            continue
        if d["resource"] == "pods":
            bad.append(f"{d['user']} deleted pod {d['name']} (no node was lost)")
        elif d["resource"] == "jobsets" and d["name"] in names:
            path = RunLayout.supervision(names[d["name"]])
            rec = SupervisionRecord.model_validate(r.store.read_json(path)) if r.store.exists(path) else None
            if d["at"] >= stopped_at:
                continue  # the operator stopped the run: positive evidence
            if rec is None or not rec.decided or rec.detected_at > d["at"]:
                bad.append(
                    f"{d['user']} deleted JobSet {d['name']} at {d['at']:.1f} before a verdict on its attempt "
                    f"({rec.outcome if rec else 'no supervision record'}, "
                    f"decided at {rec.detected_at if rec else None})"
                )
    for wf in o.workflows or (r.name,):
        for log in step_tracebacks(o.pods_roots, r.ns, wf):
            bad.append(f"a step printed a traceback: {log}")
    return bad

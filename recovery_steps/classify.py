"""Pure failure classification: ``classify(evidence) -> Verdict``, decided from the first failure.

JobSet stops the whole gang when one worker fails, so most exits of an attempt are collateral: the
siblings' SIGTERM (143), their neighbours' peer-loss errors (20) and the coordination service's
aborts (SIGABRT). The classifier orders the workers' failures in time, takes the first, and when
that first one is only a symptom of a lost peer (20, SIGABRT) it looks for the cause among the rest.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from jaxrec.model.contract import (
    CLASS_INFO,
    PEER_LOSS_MARKERS,
    AttemptOutcome,
    ExitCode,
    FailureClass,
    StallKind,
    exit_code_info,
)
from jaxrec.model.records import SupervisionRecord, WorkerExitReport
from jaxrec.model.snapshot import Condition, NodeEvidence, PodEvidence, PodPhase, first_failed
from recovery_steps.evidence import Evidence
from recovery_steps.supervision import create_refusal, one_line, pull_failure_is_permanent, waiting_cause

SIGABRT, SIGKILL, SIGTERM = 6, 9, 15
# A crash in native code: the process dies by the signal (exit 128 + it) with no exit report. The trainer has Python's
# faulthandler write every thread's stack to its termination message from a C handler (trainer.__main__); the
# kubelet keeps its last 4096 bytes as the container's termination message.
FATAL_SIGNALS = {4: "SIGILL", 7: "SIGBUS", 8: "SIGFPE", 11: "SIGSEGV"}
_FRAME = re.compile(r'File "([^"]+)", line \d+ in (\S+)')
# Where a frame says the worker was: the training loop, or its start-up (the accelerator's runtime and backends,
# jax.distributed and its coordination service, the trainer's own joining and building of its state).
_TRAINING_FRAME = re.compile(r"trainer/loop\.py")
_STARTUP_FRAME = re.compile(
    r"jax/_src/(distributed|xla_bridge)\.py|jax/_src/clusters/|trainer/app\.py (initialize|_join|_backend)|"
    r"trainer/(compile_cache|train_state)\.py"
)
IMAGE_ERRORS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
CONTAINER_CONFIG_ERRORS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")
SCHEDULING_EVENTS = ("FailedScheduling", "NotTriggerScaleUp", "FailedScaleUp")
NON_FINITE_MARKERS = ("non-finite", "nan", "inf loss", "floatingpointerror")
COMPILE_MARKERS = ("compil", "resource_exhausted", "hlo")
_JOB_POD = re.compile(r"for pod (?:[\w.-]+/)?([\w.-]+) failed with exit code (\d+)")
# A JobSet worker pod's name: <jobset>-<replicatedJob>-<jobIndex>-<podIndex>-<suffix>; the pod index is the worker's.
_POD_INDEX = re.compile(r"-(\d+)-[a-z0-9]+$")
# The kubelet's placeholder for a container it cannot account for when the pod ends: exit 137, whether or not the
# container ever ran ("we do not know whether the container was successful, always report an error";
# kubernetes pkg/kubelet/status/status_manager.go TerminatePod). It is not a SIGKILL of the trainer.
PLACEHOLDER_REASON = "ContainerStatusUnknown"
# Kubelet event reasons of a pull that failed (pkg/kubelet/events): "Failed" also names a container that
# could not be created ("Error: ...").
PULL_EVENTS = ("ErrImagePull", "ImagePullBackOff", "InspectFailed", "ErrImageNeverPull")
_EVENT_ONLY_REASON = re.compile(r"^Error: (ErrImagePull|ImagePullBackOff)$")


@dataclass(frozen=True)
class Verdict:
    """The classifier's answer: a class, a one-line reason for a person, and the evidence it used."""

    failure_class: FailureClass
    reason: str
    evidence: list[str] = field(default_factory=list)
    first_worker: int | None = None
    cause_worker: int | None = None


@dataclass
class _Obs:
    """One worker's failure as seen through pod status, its Job and its exit report."""

    index: int | None
    pod: PodEvidence | None = None
    node: NodeEvidence | None = None
    at: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    term_reason: str | None = None
    message: str | None = None
    report: WorkerExitReport | None = None
    named_by_job: bool = False
    placeholder: bool = False  # the exit code is the kubelet's placeholder (ContainerStatusUnknown), not the trainer's
    slice_spot: bool = False  # some node of the gang is a Spot VM (a TPU slice's node pool is all Spot or none)
    job_pod: str | None = None  # the pod a Job's failure names, when the pod itself is no longer in the evidence

    @property
    def who(self) -> str:
        parts = [f"worker {self.index}" if self.index is not None else "a worker"]
        if self.pod is not None:
            parts.append(f"pod {self.pod.name}")
        elif self.job_pod is not None:
            parts.append(f"pod {self.job_pod}, gone: as its Job's failure names it")
        node = self.node.name if self.node else (self.pod.node if self.pod else None)
        if node:
            parts.append(f"node {node}")
        elif self.report is not None and self.report.hostname:
            parts.append(f"host {self.report.hostname}")
        return parts[0] + (f" ({', '.join(parts[1:])})" if len(parts) > 1 else "")

    def failed(self) -> bool:
        disrupted = self.pod is not None and self.pod.disruption() is not None
        node_down = self.node is not None and (self.node.ready is False or not self.node.found)
        # A placeholder alone says only that the gang was torn down; the pod's events may say why it never ran.
        explained = self.placeholder and _event_finding(self.pod) is not None
        return bool(self.exit_code) or bool(self.signal) or disrupted or node_down or explained


@dataclass(frozen=True)
class _Finding:
    cls: FailureClass
    what: str
    secondary: bool = False


def _hms(t: float | None) -> str:
    if t is None:
        return "time unknown"
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S") + "Z"


def _exit_text(o: _Obs) -> str:
    if o.placeholder and o.exit_code is None and o.signal is None:
        return f"no exit of its own [{PLACEHOLDER_REASON}]"
    if o.signal and not o.exit_code:
        text = f"killed by signal {o.signal}"
    elif o.exit_code is not None:
        info = exit_code_info(o.exit_code)
        name = "SIGTERM" if o.exit_code == ExitCode.PREEMPTED else (info.code.name if info else "")
        text = f"exit {o.exit_code}" + (f" {name}" if name else "")
        if o.signal:
            text += f" (signal {o.signal})"
    else:
        text = "no exit recorded"
    if o.term_reason and o.term_reason not in ("Error", "Completed"):
        text += f" [{o.term_reason}]"
    return text


def _line(o: _Obs) -> str:
    text = f"{o.who}: {_exit_text(o)} at {_hms(o.at)}"
    d = o.pod.disruption() if o.pod else None
    if d is not None:
        text += f"; DisruptionTarget {d.reason}"
    if o.node is not None and (o.node.ready is False or not o.node.found):
        text += "; node gone" if not o.node.found else f"; node NotReady ({o.node.ready_reason})"
    if o.report is not None and o.report.exception_type:
        text += f"; {o.report.exception_type}: {one_line(o.report.exception_message)}"
    if o.report is not None and o.report.last_step is not None:
        text += f"; last step {o.report.last_step}"
    return text


def _normalise(code: int | None, signal: int | None) -> tuple[int | None, int | None]:
    """Negative codes (a local process killed by a signal) become signals; 128 + a signal implies it.

    That is 134 SIGABRT, 137 SIGKILL and the fatal ones: 139 SIGSEGV, 135 SIGBUS, 132 SIGILL, 136 SIGFPE.
    """
    if code is not None and code < 0:
        return 128 - code, -code
    if signal is None and code is not None and code - 128 in (SIGABRT, SIGKILL, *FATAL_SIGNALS):
        return code, code - 128
    return code, signal


def _observations(ev: Evidence) -> list[_Obs]:
    by_index: dict[int, _Obs] = {}
    loose: list[_Obs] = []
    job_pods = {m.group(1): (int(m.group(2)), c) for m, c in _job_failures(ev)}
    spot = any(n.spot for n in ev.nodes)
    for p in ev.pods:
        c = p.trainer()
        placeholder = c is not None and c.reason == PLACEHOLDER_REASON
        code, sig = (None, None) if placeholder else _normalise(c.exit_code if c else None, c.signal if c else None)
        named = job_pods.get(p.name)
        from_job = named is not None and code is None and sig is None and not placeholder
        if from_job:
            # The pod as last seen still ran, its Job has since failed naming its exit code: a view of the pod older
            # than the Job's (two watches, one behind). The Job controller saw the exit; it is the fresher fact.
            code, sig = _normalise(named[0], None)
        o = _Obs(
            index=p.worker_index,
            pod=p,
            node=ev.node(p.node),
            at=c.finished_at if c else None,
            exit_code=code,
            signal=sig,
            term_reason=c.reason if c else None,
            message=(c.message if c else None) or p.message,
            named_by_job=named is not None,
            placeholder=placeholder,
            slice_spot=spot,
        )
        if o.at is None and from_job:
            o.at = named[1].at
        if o.at is None:
            d = p.disruption()
            o.at = d.at if d else (o.node.ready_since if o.node and o.node.ready is False else None)
        if p.worker_index is None:
            loose.append(o)
        else:
            by_index[p.worker_index] = o
    _job_named(ev, by_index, loose)
    for r in ev.reports:
        o = by_index.setdefault(r.process_index, _Obs(index=r.process_index))
        o.report = r
        if o.exit_code is None and o.signal is None:
            o.exit_code = r.exit_code
        if o.at is None:
            o.at = r.ended_at
    for a in ev.agents:  # a trainer that died without a report in a pod its agent keeps running (level 0)
        o = by_index.setdefault(a.process_index, _Obs(index=a.process_index))
        if o.exit_code is None and o.signal is None and a.exit_code:
            o.exit_code, o.signal = _normalise(a.exit_code, None)
            o.at = o.at or a.at
    return sorted(by_index.values(), key=lambda o: o.index or 0) + loose


def _job_failures(ev: Evidence) -> list[tuple[re.Match[str], Condition]]:
    """The Jobs' failures (Failed, or the FailureTarget before it) that name a pod and its exit code."""
    failures = [c for j in ev.jobs if (c := j.failure()) is not None]
    return [(m, c) for c in failures if (m := _JOB_POD.search(c.message or "")) is not None]


def _job_named(ev: Evidence, by_index: dict[int, _Obs], loose: list[_Obs]) -> None:
    """A worker whose failure only its Job still tells (its pod is gone): the exit code the Job's message names."""
    present = {p.name for p in ev.pods}
    for m, c in _job_failures(ev):
        name, code = m.group(1), int(m.group(2))
        idx = _POD_INDEX.search(name)
        index = int(idx.group(1)) if idx else None
        if name in present or (index is not None and index in by_index):
            continue
        o = _Obs(index=index, at=c.at, exit_code=code, named_by_job=True, job_pod=name)
        if index is None:
            loose.append(o)
        else:
            by_index[index] = o


def _rank(o: _Obs, f: _Finding) -> int:
    """Within one second, a cause sorts before a symptom (k8s times have one-second resolution)."""
    if f.secondary:
        return 3
    if o.exit_code == ExitCode.PREEMPTED and f.cls is FailureClass.PREEMPTION and not _disrupted(o):
        return 2
    return 0


def _disrupted(o: _Obs) -> Condition | None:
    return o.pod.disruption() if o.pod is not None else None


def _report_text(r: WorkerExitReport | None) -> str:
    if r is None:
        return ""
    return " ".join(x for x in (r.exception_type, r.exception_message, r.traceback) if x).lower()


def usual_class(code: int) -> FailureClass:
    """The failure class the exit-code table gives ``code`` (a code the table names with a class)."""
    info = exit_code_info(code)
    if info is None or info.usual_class is None:
        raise ValueError(f"exit code {code} has no usual class in the exit-code table")
    return info.usual_class


def _judge(o: _Obs) -> _Finding:
    """What one worker's failure says on its own."""
    code, sig, rep = o.exit_code, o.signal, _report_text(o.report)
    node = o.node
    if o.term_reason == "OOMKilled":
        return _Finding(FailureClass.APPLICATION, "OOMKilled: host memory exhausted by the trainer process")
    if code in (ExitCode.CONFIGURATION, ExitCode.INCOMPATIBLE_CHECKPOINT):
        what = (
            "startup validation or configuration error"
            if code == ExitCode.CONFIGURATION
            else "checkpoint incompatible with config"
        )
        return _Finding(usual_class(code), what)
    if code in (126, 127):
        return _Finding(FailureClass.CONFIGURATION, "entrypoint not executable or not found in the image")
    if code == ExitCode.APPLICATION:
        if any(m in rep for m in PEER_LOSS_MARKERS):
            return _Finding(FailureClass.INFRASTRUCTURE, "exception from a lost peer (collective failed)", True)
        if any(m in rep for m in NON_FINITE_MARKERS):
            return _Finding(FailureClass.APPLICATION, "non-finite loss")
        if "xla" in rep and any(m in rep for m in COMPILE_MARKERS):
            return _Finding(FailureClass.APPLICATION, "XLA compilation failed (will repeat with the same program)")
        return _Finding(FailureClass.APPLICATION, "uncaught exception in training code")
    if code == ExitCode.HANG:
        return _Finding(usual_class(code), "watchdog: no step completed within the hang timeout")
    if code == ExitCode.ACCELERATOR_INIT:
        return _Finding(usual_class(code), "accelerator or runtime initialisation failed")
    d = _disrupted(o)
    if d is not None:
        return _disruption(d, o)
    if node is not None and not node.found:
        if o.slice_spot:
            return _Finding(FailureClass.PREEMPTION, "its node, a Spot VM of the slice, is gone: reclaimed")
        return _Finding(FailureClass.INFRASTRUCTURE, "its node is gone from the cluster")
    if node is not None and node.maintenance():
        return _Finding(FailureClass.PREEMPTION, f"node reclaimed for maintenance ({node.maintenance()})")
    if node is not None and node.ready is False:
        if _shutting_down(node):
            return _Finding(FailureClass.PREEMPTION, f"node shutting down ({_ready_text(node)})")
        if node.spot:
            return _Finding(FailureClass.PREEMPTION, f"Spot node NotReady ({node.ready_reason}): reclaimed")
        return _Finding(FailureClass.INFRASTRUCTURE, f"node NotReady ({node.ready_reason or 'no reason given'})")
    if code == ExitCode.PREEMPTED or sig == SIGTERM:
        return _Finding(
            usual_class(ExitCode.PREEMPTED), "received SIGTERM first (node shutdown or preemption), state saved"
        )
    if sig == SIGKILL:
        return _Finding(FailureClass.INFRASTRUCTURE, "SIGKILLed without OOMKilled (host or kubelet killed it)")
    if sig in FATAL_SIGNALS and o.report is None:
        return _native_crash(FATAL_SIGNALS[sig], o.message or "")
    if code == ExitCode.PEER_LOST:
        return _Finding(usual_class(code), "lost a peer (collective or coordination service failed)", True)
    if sig == SIGABRT:
        return _Finding(FailureClass.INFRASTRUCTURE, "aborted by the JAX runtime (coordination heartbeat lost)", True)
    if code == ExitCode.CAPACITY:
        return _Finding(usual_class(code), "capacity not available")
    if o.pod is not None and o.pod.reason in ("NodeLost", "NodeShutdown", "Terminated", "Shutdown"):
        return _Finding(FailureClass.PREEMPTION, f"pod ended by node shutdown ({o.pod.reason})")
    if o.report is not None and o.report.traceback:
        return _Finding(FailureClass.APPLICATION, f"exit {code} with a Python traceback")
    if o.placeholder and code is None:
        found = _event_finding(o.pod)
        if found is not None:
            return found
        return _Finding(FailureClass.UNKNOWN, "torn down before it ran; no event says why")
    return _Finding(FailureClass.UNKNOWN, f"exit {code} is outside the exit-code contract" if code else "no cause")


def _native_crash(name: str, trace: str) -> _Finding:
    """A worker killed by a fatal signal with no exit report: where its stacks (the termination message) say it was.

    In its start-up (the accelerator's runtime, jax.distributed) it is what exit 22 says, an initialisation that
    failed; in the training loop a crash in native code (a host or driver fault, or a kernel's bug, which the
    no-progress guard stops if it repeats). No stack at all is unknown, and says so.
    """
    frames = [f"{path} {fn}" for path, fn in _FRAME.findall(trace)]
    if not frames:
        return _Finding(
            FailureClass.UNKNOWN, f"killed by {name} with no exit report and no stack in its termination message"
        )
    innermost = frames[0].rsplit("/", 1)[-1]
    if any(_TRAINING_FRAME.search(f) for f in frames):
        return _Finding(FailureClass.INFRASTRUCTURE, f"killed by {name} in native code while training ({innermost})")
    if any(_STARTUP_FRAME.search(f) for f in frames):
        what = usual_class(ExitCode.ACCELERATOR_INIT)
        return _Finding(
            what, f"killed by {name} in its start-up ({innermost}): accelerator or runtime initialisation failed"
        )
    return _Finding(FailureClass.UNKNOWN, f"killed by {name} with no exit report ({innermost})")


def _shutting_down(node: NodeEvidence) -> bool:
    """The kubelet's Ready condition in a graceful node shutdown (pkg/kubelet/nodeshutdown ``ShutdownStatus``)."""
    text = f"{node.ready_reason or ''} {node.ready_message or ''}".lower()
    return "shutting down" in text or "shutdown" in text


def _ready_text(node: NodeEvidence) -> str:
    return f"{node.ready_reason or '-'}: {node.ready_message}" if node.ready_message else node.ready_reason or "-"


def _event_finding(p: PodEvidence | None) -> _Finding | None:
    """What a pod's warning events say about a container that never ran: a pull or creation that failed."""
    if p is None:
        return None
    found: list[_Finding] = []
    for e in p.events:
        reason, _, msg = e.partition(": ")
        if _EVENT_ONLY_REASON.match(msg.strip()):
            continue  # the waiting reason again; the event before it has the error
        pull = reason in PULL_EVENTS or (reason == "Failed" and "pull" in msg.lower())
        if pull or reason in ("Failed", "FailedMount", "FailedCreatePodSandBox"):
            what = "its image cannot be pulled" if pull else f"its container could not start ({reason})"
            if pull_failure_is_permanent("ErrImagePull", msg):
                found.append(_Finding(FailureClass.CONFIGURATION, f"{what}: {one_line(msg, 120)}"))
            else:
                why = "a registry or network fault" if pull else "a node or runtime fault"
                found.append(_Finding(FailureClass.INFRASTRUCTURE, f"{what}, {why}: {one_line(msg, 120)}"))
    found.sort(key=lambda f: f.cls is not FailureClass.CONFIGURATION)
    return found[0] if found else None


def _disruption(d: Condition, o: _Obs) -> _Finding:
    msg = (d.message or "").lower() + " " + ((o.pod.message or "").lower() if o.pod else "")
    if d.reason == "PreemptionByScheduler":
        return _Finding(FailureClass.PREEMPTION, "preempted by the scheduler for a higher-priority pod")
    if d.reason == "TerminationByKubelet":
        if "low on resource: memory" in msg:
            return _Finding(FailureClass.APPLICATION, "evicted by the kubelet: node low on memory")
        spot = " (Spot VM reclaimed)" if o.node is not None and o.node.spot else ""
        return _Finding(FailureClass.PREEMPTION, f"node shutting down{spot}: kubelet terminated the pod")
    if d.reason == "EvictionByEvictionAPI":
        return _Finding(FailureClass.PREEMPTION, "evicted through the Eviction API (node drain, maintenance)")
    if d.reason == "DeletionByTaintManager":
        if o.node is not None and o.node.maintenance():
            return _Finding(FailureClass.PREEMPTION, f"deleted for node maintenance ({o.node.maintenance()})")
        if o.node is not None and o.node.spot:
            return _Finding(FailureClass.PREEMPTION, "deleted by the taint manager: its Spot node was reclaimed")
        return _Finding(FailureClass.INFRASTRUCTURE, "deleted by the taint manager (node unreachable or NotReady)")
    if d.reason == "DeletionByPodGC":
        if o.slice_spot:
            return _Finding(FailureClass.PREEMPTION, "garbage-collected: its node, a Spot VM of the slice, disappeared")
        return _Finding(FailureClass.INFRASTRUCTURE, "garbage-collected: its node disappeared")
    return _Finding(FailureClass.INFRASTRUCTURE, f"disrupted by Kubernetes ({d.reason})")


# What a stall the supervisor ended means. Once it stops the attempt every worker gets SIGTERM and exits
# 143, which would otherwise read as a preemption: the supervisor's verdict comes first.
STALL_CLASSES = {
    StallKind.CAPACITY: FailureClass.CAPACITY,
    StallKind.CONFIGURATION: FailureClass.CONFIGURATION,
    StallKind.HANG: FailureClass.HANG,
    StallKind.IMAGE_PULL: FailureClass.INFRASTRUCTURE,
    StallKind.NODE_LOST: FailureClass.INFRASTRUCTURE,
    StallKind.REFUSED: FailureClass.UNKNOWN,
}


def _reclaimed(ev: Evidence, s: SupervisionRecord) -> list[str]:
    """Why a node-lost stall is a preemption: what the lost node and the workers said (empty: it is not).

    A graceful node shutdown marks the node NotReady ("node is shutting down") before its pods fail
    (kubernetes pkg/kubelet/nodeshutdown); a Spot VM or a node under maintenance is taken back by the platform;
    a worker that exited 143 (SIGTERM) before the supervisor's own stop was told to leave by its node.
    """
    snap = s.snapshot
    pods = [*ev.pods, *(snap.pods if snap else [])]
    nodes = [*ev.nodes, *(snap.nodes if snap else [])]
    names = {p.node for p in pods if p.node and s.worker is not None and p.worker_index == s.worker}
    lost = [n for n in nodes if n.name in names] or [n for n in nodes if not n.found or n.ready is not True]
    why: list[str] = []
    for n in lost:
        if _shutting_down(n):
            why.append(f"node {n.name} was shutting down ({_ready_text(n)})")
        if n.spot:
            why.append(f"node {n.name} is a Spot VM")
        if n.maintenance():
            why.append(f"node {n.name} is under maintenance ({n.maintenance()})")
    if not why and "node is shutting down" in s.reason.lower():
        why.append("the supervisor saw the node shutting down")
    if not why and any(not n.found for n in lost):
        spot = next((n for n in nodes if n.found and n.spot), None)
        if spot is not None:
            why.append(f"the slice's nodes are Spot VMs (node {spot.name}) and the lost one is gone")
    sigterm = sorted(
        {
            r.process_index
            for r in ev.reports
            if r.exit_code == ExitCode.PREEMPTED and (r.ended_at is None or r.ended_at <= s.detected_at)
        }
    )
    if sigterm:
        who = ", ".join(str(i) for i in sigterm)
        why.append(f"worker {who} exited 143 (SIGTERM) before the supervisor stopped the attempt")
    return list(dict.fromkeys(why))


def _supervised(ev: Evidence) -> Verdict | None:
    s = ev.supervision
    if s is None:
        return None
    if s.outcome == AttemptOutcome.ERROR:
        info = exit_code_info(s.exit_code) if s.exit_code is not None else None
        cls = info.usual_class if info and info.usual_class else FailureClass.UNKNOWN
        return Verdict(
            cls,
            f"train-segment could not supervise the attempt: {s.reason}",
            [f"train-segment exit code {s.exit_code}: {s.reason}"],
        )
    if s.outcome != AttemptOutcome.STALLED or s.stall_kind not in STALL_CLASSES:
        return None
    lines = [f"supervisor: stalled ({s.stall_kind}): {s.reason}", *s.evidence]
    cls, reason = STALL_CLASSES[s.stall_kind], f"the attempt stalled ({s.stall_kind}) and was stopped: {s.reason}"
    if s.stall_kind == StallKind.NODE_LOST:
        reclaimed = _reclaimed(ev, s)
        if reclaimed:
            cls, reason = FailureClass.PREEMPTION, f"{reason}; a preemption: {'; '.join(reclaimed)}"
        lines += [f"preemption: {r}" for r in reclaimed]
    return Verdict(cls, reason, lines, first_worker=s.worker, cause_worker=s.worker)


def _precheck(ev: Evidence) -> Verdict | None:
    """Failures of the whole attempt that precede any worker's exit.

    Pods the API refused to create, a supervised stall, an image or container that cannot start, capacity.
    """
    supervised = _supervised(ev)
    refused = _refused(ev)
    if refused is not None and (supervised is None or supervised.failure_class is FailureClass.CAPACITY):
        # Pods that were never created leave the supervisor only a count of missing pods: the Job says why.
        return replace(refused, evidence=refused.evidence + (supervised.evidence if supervised else []))
    if supervised is not None:
        return supervised
    waiting = _cannot_start(ev, permanent=True) or _never_ran(ev)
    if waiting is not None:
        return waiting
    pending = [
        p
        for p in ev.pods
        if p.phase == PodPhase.PENDING and any(e.split(":", 1)[0] in SCHEDULING_EVENTS for e in p.events)
    ]
    if pending:
        p = pending[0]
        msg = next(e for e in p.events if e.split(":", 1)[0] in SCHEDULING_EVENTS)
        tpu = "google.com/tpu" in msg
        lines = [f"pod {q.name}: Pending: {one_line(next(iter(q.events)), 200)}" for q in pending]
        return Verdict(
            FailureClass.CAPACITY,
            f"{len(pending)} of {len(ev.pods)} worker pods stayed Pending "
            f"({'no free TPU slice of this shape' if tpu else 'unschedulable'}): {one_line(msg, 120)}. "
            "Nothing ran; the next attempt waits for capacity.",
            lines,
        )
    if ev.step_exit_code is not None:
        info = exit_code_info(ev.step_exit_code)
        cls = info.usual_class if info and info.usual_class else FailureClass.UNKNOWN
        meaning = info.meaning if info else "exit code outside the contract"
        return Verdict(
            cls,
            f"the step before training exited {ev.step_exit_code}: {meaning}",
            [f"step exit code {ev.step_exit_code}"],
        )
    return None


def _refused(ev: Evidence) -> Verdict | None:
    """A Job whose worker pods the API refused to create, in a gang whose trainers never ran.

    A refusal by policy comes first. Once a trainer ran, the workers' exits explain the attempt, not a refusal the
    Job controller retried.
    """
    if ev.reports or any(_trainer_ran(p) for p in ev.pods):
        return None
    found = [(j, e, r) for j in ev.jobs for e in j.events if (r := create_refusal(e)) is not None]
    if not found:
        return None
    found.sort(key=lambda f: f[2][0] is not FailureClass.CONFIGURATION)
    job, _, (cls, what) = found[0]
    lines = [f"Job {job.name}: {one_line(e, 300)}" for j, e, _ in found if j is job]
    return Verdict(cls, f"Job {job.name} could not create its worker pods: {what}. {CLASS_INFO[cls].advice}", lines)


def _trainer_ran(pod: PodEvidence) -> bool:
    """Whether the pod's trainer container ever started (a kubelet placeholder never did)."""
    c = pod.trainer()
    return c is not None and (c.started_at is not None or c.running_since is not None)


def _cannot_start(ev: Evidence, *, permanent: bool) -> Verdict | None:
    """A worker container waiting on an image pull or creation failure.

    ``permanent``: one waiting cannot heal (configuration); otherwise one it may (infrastructure: the kubelet was
    retrying a registry or runtime fault).
    """
    for p in ev.pods:
        for c in p.containers:
            if c.waiting_reason not in IMAGE_ERRORS and c.waiting_reason not in CONTAINER_CONFIG_ERRORS:
                continue
            cause = waiting_cause(c.waiting_reason, c.waiting_message)
            if pull_failure_is_permanent(c.waiting_reason, cause) != permanent:
                continue
            line = f"pod {p.name}: container {c.name} waiting: {c.waiting_reason}: {one_line(c.waiting_message)}"
            what = f"worker {p.worker_index} (pod {p.name})"
            waiting = f"{c.waiting_reason} ({one_line(c.waiting_message, 100)})"
            if not permanent:
                cls = FailureClass.INFRASTRUCTURE
                reason = f"{what} could not start: {waiting}; a registry, network or runtime fault the kubelet was "
                reason += "still retrying. Retried on a fresh slice."
            else:
                fix = "check the image name and tag, and the node pool's pull access"
                if c.waiting_reason in CONTAINER_CONFIG_ERRORS:
                    fix = "check the pod's ConfigMaps, Secrets and env"
                cls = FailureClass.CONFIGURATION
                reason = f"{what} cannot start: {waiting}; {fix}. Retrying will not help."
            return Verdict(cls, reason, [line], first_worker=p.worker_index, cause_worker=p.worker_index)
    return None


def _never_ran(ev: Evidence) -> Verdict | None:
    """A worker container torn down before it ran whose events say it never could (its image cannot be pulled)."""
    for p in ev.pods:
        c = p.trainer()
        found = _event_finding(p) if c is not None and c.reason == PLACEHOLDER_REASON else None
        if found is not None and found.cls is FailureClass.CONFIGURATION:
            events = "; ".join(one_line(e, 200) for e in p.events)
            return Verdict(
                FailureClass.CONFIGURATION,
                f"worker {p.worker_index} (pod {p.name}) never ran: {found.what}. Retrying will not help.",
                [f"pod {p.name}: container {c.name} never ran ({PLACEHOLDER_REASON}); events: {events}"],
                first_worker=p.worker_index,
                cause_worker=p.worker_index,
            )
    return None


def classify(evidence: Evidence) -> Verdict:
    """Classify a failed attempt from its evidence (pure; no I/O).

    Returns:
        The class, a one-line reason naming the worker, node and code, and the evidence lines used.
    """
    pre = _precheck(evidence)
    if pre is not None:
        # What the adapters could not read (events skipped, a snapshot used) belongs to every verdict's evidence.
        return replace(pre, evidence=pre.evidence + [f"note: {n}" for n in evidence.notes])
    obs = [o for o in _observations(evidence) if o.failed()]
    context = _context_lines(evidence)
    if not obs:
        # A pull the kubelet was still retrying explains an attempt only when no worker failed.
        waiting = _cannot_start(evidence, permanent=False)
        if waiting is not None:
            return replace(waiting, evidence=waiting.evidence + context)
        return Verdict(
            FailureClass.UNKNOWN,
            f"{_unexplained(evidence)}; no worker exit code, pod status or exit report explains attempt "
            f"{evidence.attempt}. Read the train-segment step logs.",
            [_inventory(evidence)] + context,
        )
    judged = {id(o): _judge(o) for o in obs}
    # The worker the supervisor named when it saw the gang fail (by the same rule, on its live view), else the
    # rule over what is left to see now.
    first = _named_by_supervisor(evidence, obs) or first_failed(
        obs,
        ended=lambda o: o.at,
        index=lambda o: o.index,
        rank=lambda o: _rank(o, judged[id(o)]),
        named=lambda o: o.named_by_job,
    )
    f = judged[id(first)]
    cause, cf = first, f
    if f.secondary:
        # The first failure is a symptom of a lost peer: the cause is the earliest real finding elsewhere.
        others = sorted(
            (o for o in obs if o is not first and not judged[id(o)].secondary and not (_rank(o, judged[id(o)]) == 2)),
            key=lambda o: o.at or float("inf"),
        )
        if others:
            cause, cf = others[0], judged[id(others[0])]
    lines = [_line(cause)] + ([_line(first)] if cause is not first else [])
    lines += [_line(o) for o in sorted(obs, key=lambda o: o.at or float("inf")) if o is not first and o is not cause]
    return Verdict(
        cf.cls,
        _reason(cf, cause, first, f, obs, judged),
        lines + context,
        first_worker=first.index,
        cause_worker=cause.index,
    )


def _named_by_supervisor(ev: Evidence, obs: list[_Obs]) -> _Obs | None:
    """The failed worker the supervisor's failure verdict names, when it is among ``obs``."""
    sup = ev.supervision
    if sup is None or sup.outcome != AttemptOutcome.FAILED or sup.worker is None:
        return None
    return next((o for o in obs if o.index == sup.worker), None)


def _unexplained(ev: Evidence) -> str:
    """What ended an attempt no worker's failure explains: a Job's failure (FailureTarget or Failed), the JobSet's."""
    for j in ev.jobs:
        c = j.failure()
        if c is not None:
            return f"Job {j.name} {c.type} ({c.reason}: {one_line(c.message, 100)})"
    js = ev.jobset
    cond = next((c for c in (js.conditions if js else []) if c.type == "Failed" and c.status == "True"), None)
    return f"JobSet failed ({cond.reason}: {one_line(cond.message, 100)})" if cond else "no failed worker found"


def _reason(cf: _Finding, cause: _Obs, first: _Obs, f: _Finding, obs: list[_Obs], judged: dict[int, _Finding]) -> str:
    text = f"{cause.who} {_exit_text(cause)} at {_hms(cause.at)}: {cf.what}"
    if cause.report is not None and cause.report.exception_type:
        text += f" ({cause.report.exception_type}: {one_line(cause.report.exception_message, 100)}"
        text += f", step {cause.report.last_step})" if cause.report.last_step is not None else ")"
    same = [o for o in obs if judged[id(o)].cls is cf.cls and judged[id(o)].what == cf.what and o is not cause]
    if same and cf.cls is FailureClass.APPLICATION:
        text += f"; the same on {len(same) + 1} of {len(obs)} failed workers"
    if cause is not first:
        text += f"; {first.who} failed first with {_exit_text(first)} ({f.what}), a symptom"
    elif f.secondary:
        text += "; no application cause found on any worker"
    rest = [o for o in obs if o is not cause and o is not first]
    if rest:
        kinds = Counter(_exit_text(o) for o in rest)
        text += "; then " + ", ".join(f"{n}x {k}" for k, n in kinds.items())
    return text + f". {CLASS_INFO[cf.cls].advice}"


def _inventory(ev: Evidence) -> str:
    return (
        f"looked at: {len(ev.pods)} pods, {len(ev.jobs)} Jobs, {len(ev.nodes)} nodes, {len(ev.reports)} worker reports"
    )


def _context_lines(ev: Evidence) -> list[str]:
    lines = []
    if ev.jobset is not None:
        for c in ev.jobset.conditions:
            if c.status == "True" and c.type in ("Failed", "Suspended"):
                lines.append(f"JobSet {ev.jobset.name} {c.type}: {c.reason}: {one_line(c.message)}")
    for j in ev.jobs:
        c = j.failure()
        if c is not None:
            lines.append(f"Job {j.name} {c.type} at {_hms(c.at)}: {c.reason}: {one_line(c.message)}")
    lines += [f"note: {n}" for n in ev.notes]
    return lines

"""When is a training attempt over? One pure decision over a plain observation of its JobSet.

``decide(observation, deadlines)`` is what the ``train-segment`` supervisor calls on every change of the
gang and at least every watch interval, on GKE and in the local runner alike. It does no I/O and imports
nothing heavy: the supervisor builds the ``Observation`` from the ``ClusterSnapshot`` its world's adapter
answers (``recovery_steps.kube_gang.KubeGang`` over the Kubernetes API, a cluster's or the local runner's), plus
the clocks it keeps between observations.

Why a supervisor has to decide at all (a JobSet reacts to a Job's ``Failed`` only; a pull or a Pending pod fails no
Job; a worker alive in a collective fails nothing), and what it must not take for an end (a node NotReady not yet
lost, a kubelet's cached waiting reason, a heartbeat or a view it cannot read): docs/FAILURES.md, with the sources.
"""

from __future__ import annotations

import contextlib
import math
import re
import signal
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from jaxrec.model.config import SupervisionConfig
from jaxrec.model.contract import AttemptOutcome, ExitCode, FailureClass, StallKind, outcome_check
from jaxrec.model.records import STARTUP_MARGIN, AgentState, SupervisionRecord, WorkerPhase
from jaxrec.model.snapshot import (
    ClusterSnapshot,
    JobEvidence,
    JobSetEvidence,
    NodeEvidence,
    PodEvidence,
    PodPhase,
    first_failed,
)

# Container waiting reasons of an image pull or a container creation that failed (kubelet
# pkg/kubelet/images/types.go and kuberuntime): they loop with a back-off and never fail the pod.
PULL_WAITING_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "ErrImageNeverPull",
        "InvalidImageName",
        "RegistryUnavailable",
        "SignatureValidationFailed",
    }
)
IMAGE_WAITING_REASONS = PULL_WAITING_REASONS | {"CreateContainerConfigError", "CreateContainerError"}
# Waiting reasons that cannot recover by waiting: no deadline needed.
IMMEDIATE_WAITING_REASONS = frozenset({"InvalidImageName", "ErrImageNeverPull"})
# Waiting reasons that are the job's own doing whatever their message: a Secret, ConfigMap or key the pod names is
# missing; the image's signature is refused by the node's policy.
PERMANENT_WAITING_REASONS = frozenset({"CreateContainerConfigError", "SignatureValidationFailed"})
# What a registry or runtime says when the image or the right to pull it is not there: waiting cannot heal it.
# Any other failure (5xx, i/o timeout, connection reset, a runtime timeout in CreateContainerError) may.
PERMANENT_PULL_MARKERS = (
    "not found",
    "manifest unknown",
    "denied",
    "403 forbidden",
    "invalid reference format",
    "invalidimagename",
    "errimageneverpull",
)
# The Job controller's event when the API refuses a pod it creates: reason FailedCreate, message 'Error creating:
# <the API's error>' (kubernetes pkg/controller/controller_utils.go, FailedCreatePodReason).
FAILED_CREATE = "FailedCreate"
# JobSet's own pod webhook refuses a follower pod of an exclusive-placement Job until its leader pod is scheduled
# (the mutating webhook then sets the follower's node selector, and the Job controller's retry is admitted): "an
# expected, transient error" in jobset v0.12.0 pkg/webhooks/pod_webhook.go ``ValidateCreate``. No refusal.
JOBSET_SEQUENCING = re.compile(
    r"follower pod node selector (not set|for topology domain not found)|leader pod not yet scheduled"
    r"|expected 1 leader pod",
    re.I,
)
# Refusals that say the API could not decide yet, and that the Job controller's next try gets past: ResourceQuota
# admission refuses every pod it charges while the quota's status lacks the usage of one of its resources ("status
# unknown for quota: NAME, resources: ...", kubernetes plugin/pkg/admission/resourcequota/controller.go
# ``CheckRequest``), until the quota controller has counted it; JobSet's webhook refuses a follower pod while the
# leader pod is missing or doubled (``leaderPodForFollower``: "expected 1 leader pod (NAME), but got N. this is an
# expected, transient error", jobset v0.12.0 pkg/webhooks/pod_webhook.go). No refusal either.
TRANSIENT_REFUSALS = re.compile(r"status unknown for quota|this is an expected, transient error", re.I)
# What the refusal says, first match wins: (pattern, class, what refused the pods, the fix). A spent ResourceQuota
# is a 403 "is forbidden: exceeded quota" too, so it comes before the other refusals; a webhook that cannot be
# called (500 "failed calling webhook") is a fault of the webhook's service, not of the pods.
CREATE_REFUSALS: tuple[tuple[re.Pattern[str], FailureClass, str, str], ...] = (
    (
        re.compile(r"exceeded quota: ([\w.-]+)", re.I),
        FailureClass.CAPACITY,
        "the namespace's ResourceQuota {0} is spent",
        "the next attempt waits for capacity; raise the quota or free what holds it",
    ),
    (
        re.compile(r'violates PodSecurity "([^"]+)"', re.I),
        FailureClass.CONFIGURATION,
        "the namespace's Pod Security admission ({0}) forbids them",
        "label the namespace pod-security.kubernetes.io/enforce with a level that admits the workers, or take what "
        "the policy forbids out of the pod spec",
    ),
    (
        re.compile(r'admission webhook "([^"]+)" denied the request', re.I),
        FailureClass.CONFIGURATION,
        "admission webhook {0} denied them",
        "change the pod spec to pass the webhook's policy, or exempt the namespace from it",
    ),
    (
        re.compile(r'failed calling webhook "([^"]+)"', re.I),
        FailureClass.INFRASTRUCTURE,
        "admission webhook {0} could not be called",
        "retried; check the webhook's service if this repeats",
    ),
    (
        # LimitRanger admission (plugin/pkg/admission/limitranger): "maximum memory usage per Container is 64Gi,
        # but limit is 400Gi", and the minimum, ratio and default forms of the same sentence.
        re.compile(r"(?:maximum|minimum) \S+ usage per (\w+) is|\S+ max limit to request ratio per (\w+) is", re.I),
        FailureClass.CONFIGURATION,
        "the namespace's LimitRange forbids them",
        "fix the workers' requests and limits (worker_resources) or the LimitRange",
    ),
    (
        # ServiceAccount admission: "error looking up service account NS/NAME: serviceaccount NAME not found".
        re.compile(r"error looking up service account ([\w./-]+)", re.I),
        FailureClass.CONFIGURATION,
        "the API server forbids them: no service account {0}",
        "apply argo/rbac.yaml in the namespace, or name an existing account (worker_service_account)",
    ),
    (
        re.compile(r"forbidden", re.I),
        FailureClass.UNKNOWN,
        "the API server forbids them, for a reason the classifier does not know",
        "read the message: a LimitRange, the ServiceAccount or a policy needs fixing, or it passes on a retry",
    ),
)
# What a registry says when the pull's credentials were not accepted (401: none, or an expired token): the kubelet's
# credential provider fetches a new token on its next try, so it is waited on as long as a transient failure; one
# that outlives that wait is not an expiry but missing credentials (configuration). Artifact Registry words it
# "401 Unauthorized ... unauthorized: not authenticated: No valid credential was supplied" (gitpod-io/gitpod#11454:
# after a stretch of inactivity, healed once credentials were fetched again). A refused permission is 403/denied.
CREDENTIAL_PULL_MARKERS = ("unauthorized", "not authenticated", "no valid credential")
# The kubelet's back-off wrapper. Since Kubernetes 1.32 it repeats the failed pull's error
# ('Back-off pulling image "X": ErrImagePull: <error>'; pkg/kubelet/images/image_manager.go prevPullErrMsg,
# kubernetes#127918);
# before, it is only 'Back-off pulling image "X"'.
_BACK_OFF = re.compile(r'^Back-off pulling image "[^"]*":?\s*')
_CAUSE_TAG = re.compile(r"^(?:ErrImagePull|RegistryUnavailable|SignatureValidationFailed):\s*")
# Addresses, ports and request ids change from one try to the next; the failure does not.
_DIGITS = re.compile(r"\d+")


class _Rec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Where an attempt stands, as the supervisor's verdict says it: running, or over (succeeded, failed or stalled).
_VerdictState = Annotated[
    AttemptOutcome, AfterValidator(outcome_check(AttemptOutcome.VERDICT_STATES, "a supervisor's verdict"))
]


class WorkerProgress(_Rec):
    """A worker's newest heartbeat: its last completed step and when."""

    index: int
    step: int | None = Field(default=None, description="Last step completed (None: none yet).")
    at: float = Field(description="When the heartbeat was written (epoch seconds).")
    first_step_at: float | None = None
    saving: int | None = Field(default=None, description="The checkpoint step the loop waits for since ``at``.")
    phase: WorkerPhase | None = Field(default=None, description="What the worker was doing from ``at`` on.")
    step_seconds: float | None = Field(default=None, description="The longest of its latest steps (the heartbeat's).")


class ReadState(_Rec):
    """How one kind of the supervisor's reads stands once one failed: failing now, or readable again."""

    ok: bool = Field(description="The newest read succeeded.")
    since: float = Field(description="When the reads turned failing (ok False) or readable again (ok True).")
    error: str = Field(default="", description="The newest failed read's error.")


class HeartbeatRead(ReadState):
    """How the supervisor's reads of one worker's heartbeat stand once one failed."""

    index: int


def _turned(prev: ReadState | None, error: str | None, now: float) -> dict[str, object] | None:
    """The fields of a read state after one more read; None when it is unchanged (no failure, or none since)."""
    if error is not None:
        since = prev.since if prev is not None and not prev.ok else now
        return {"ok": False, "since": since, "error": error}
    if prev is None or prev.ok:
        return None
    return {"ok": True, "since": now}


def read_clock(prev: HeartbeatRead | None, index: int, error: str | None, now: float) -> HeartbeatRead | None:
    """The state of a worker's heartbeat reads after one more read; the adapter keeps it between observations.

    A read that failed is never evidence of absence: the decision gives no hang verdict for a worker while its
    reads fail, and counts its hang clocks only from when they succeed again (the worker may not have been able to
    write either). ``error``: why this read failed (None: it succeeded). None while no read has failed.
    """
    turned = _turned(prev, error, now)
    return prev if turned is None else HeartbeatRead(index=index, **turned)


def view_clock(prev: ReadState | None, error: str | None, now: float) -> ReadState | None:
    """The state of the supervisor's view of the cluster (its watches and node reads) after one more observation.

    While the view is failing, what it holds may be old: only a terminal fact in it (a failed pod, a Job at
    ``FailureTarget``, a terminal JobSet, every worker succeeded) ends the attempt, and every stall clock counts
    only from when the view is current again (a Job controller that was down creates its pods late; a node whose
    status could not be read may be fine). ``error``: why the view is not current now (``ClusterSnapshot.unreadable``;
    None: it is). None while no observation has failed.
    """
    turned = _turned(prev, error, now)
    return prev if turned is None else ReadState(**turned)


# How long the supervisor may go without a current view of the gang (its watches, node reads or a worker's
# heartbeat failing all along) before its step ends as transient (exit 69): Argo retries the step and the new
# supervisor re-attaches to the gang, which is left running; a gang is never held unsupervised for good.
STALE_VIEW_LIMIT_S = 300.0

# How long a supervisor waits for the JobSet controller to create any Job of a JobSet it sees with neither Job nor
# pod before its step ends as transient (exit 69), the JobSet left for the retry to re-attach to. A JobSet no
# controller has acted on says nothing about capacity: a restarting controller re-lists (client-go's watch back-off
# reaches 30 s) and re-queues an object whose reconcile failed with a growing back-off; one not running never acts.
JOBSET_UNACTED_LIMIT_S = 300.0


class WaitClock(_Rec):
    """How long one container has waited on one failure; the adapter keeps it from one observation to the next."""

    key: str = Field(description="The failure: pull or the creation reason, and its cause with digits masked.")
    since: float = Field(description="When this failure was first seen.")
    cause: str = Field(default="", description="The failure's own text (``waiting_cause``).")


class Observation(_Rec):
    """Everything the decision looks at, at one instant."""

    now: float
    expected_workers: int = Field(ge=1)
    created_at: float = Field(description="When the attempt's JobSet was created.")
    snapshot: ClusterSnapshot = Field(description="The JobSet, its Jobs, its pods and their nodes, as last seen.")
    waits: dict[str, WaitClock] = Field(
        default_factory=dict,
        description="The supervisor's clock of each pod's current pull or creation failure, by pod name "
        "(``wait_clock``: the same failure again keeps the time; another, or a container that started, starts it "
        "again).",
    )
    lost_seen: dict[str, float] = Field(
        default_factory=dict,
        description="When the supervisor first saw each lost node lost, by name: the grace counts from it when the "
        "Ready condition gives no time (the Node is gone, or Ready is True while the unreachable taint is on).",
    )
    progress: tuple[WorkerProgress, ...] = ()
    reads: tuple[HeartbeatRead, ...] = Field(
        default=(),
        description="The workers whose heartbeat reads failed (``read_clock``); a worker not named had every read "
        "succeed, and a missing beat of it is absent.",
    )
    view: ReadState | None = Field(
        default=None,
        description="How the cluster view (watches, node reads) stands once an observation failed (``view_clock``).",
    )
    startup_before_s: float | None = Field(
        default=None,
        description="The longest this run's earlier attempts took from every worker running to every worker's "
        "first step (``startup_seconds`` of their supervision records); None when none is known.",
    )
    ended: tuple[AgentState, ...] = Field(
        default=(),
        description="With restarts in place: the workers whose agent saw this attempt's trainer exit (their pods "
        "still run: the agent holds them for the supervisor's order).",
    )

    @property
    def jobset(self) -> JobSetEvidence | None:
        """The attempt's JobSet, None once it is gone."""
        return self.snapshot.live_jobset

    @property
    def jobset_terminal_state(self) -> str | None:
        """``status.terminalState`` of the JobSet."""
        return self.jobset.terminal_state if self.jobset else None

    @property
    def jobs(self) -> list[JobEvidence]:
        """The JobSet's Jobs."""
        return self.snapshot.jobs

    @property
    def pods(self) -> list[PodEvidence]:
        """The worker pods."""
        return self.snapshot.pods

    @property
    def nodes(self) -> list[NodeEvidence]:
        """Their nodes, by name."""
        return sorted(self.snapshot.nodes, key=lambda n: n.name)

    @property
    def unreadable(self) -> list[HeartbeatRead]:
        """The workers whose heartbeat cannot be read now."""
        return [r for r in self.reads if not r.ok]

    def counted_from(self, start: float) -> float:
        """When a stall clock that started at ``start`` counts from: never before the view was current again."""
        return max(start, self.view.since) if self.view is not None else start

    def heard_for(self, index: int | None) -> float:
        """Seconds the worker's heartbeat has been readable: since its reads last failed, or ever (``inf``)."""
        r = next((r for r in self.reads if r.index == index), None)
        if r is None:
            return math.inf
        return self.now - r.since if r.ok else -math.inf


class Verdict(_Rec):
    """The decision: the attempt's state, the stall kind when stalled, and one line saying why."""

    state: _VerdictState
    kind: StallKind | None = None
    reason: str
    worker: int | None = Field(default=None, description="The worker the reason is about, if one.")

    @property
    def over(self) -> bool:
        """True when the attempt has ended (the supervisor stops it and exits)."""
        return self.state != AttemptOutcome.RUNNING


def waiting_cause(reason: str | None, message: str | None) -> str:
    """The failure behind a waiting container: its message without the kubelet's back-off wrapper.

    ``ImagePullBackOff`` and ``ErrImagePull`` alternate while the kubelet retries one failing pull; both give the
    same cause. Empty when the message names none (a back-off message of a kubelet before 1.32).
    """
    text = (message or "").strip()
    if reason == "ImagePullBackOff":
        text = _BACK_OFF.sub("", text, count=1)
    return _CAUSE_TAG.sub("", text, count=1).strip()


def pull_failure_is_permanent(reason: str | None, cause: str | None) -> bool:
    """True when waiting cannot heal this pull or container creation failure (the image or the right is missing)."""
    if reason in IMMEDIATE_WAITING_REASONS or reason in PERMANENT_WAITING_REASONS:
        return True
    text = (cause or "").lower()
    return any(m in text for m in PERMANENT_PULL_MARKERS)


def pull_failure_is_credentials(reason: str | None, cause: str | None) -> bool:
    """True when the registry did not accept the pull's credentials (401), which a refreshed token may heal."""
    text = (cause or "").lower()
    return not pull_failure_is_permanent(reason, cause) and any(m in text for m in CREDENTIAL_PULL_MARKERS)


def create_refusal(event: str) -> tuple[FailureClass, str] | None:
    """What a Job's warning event ('Reason: message') says about worker pods the API refused to create (pure).

    Returns:
        The class and one line naming what refused the pods, the API's words and the fix; None when the event is
        not a FailedCreate (``CREATE_REFUSALS``).
    """
    reason, _, msg = event.partition(": ")
    return pod_refusal(msg) if reason == FAILED_CREATE else None


def unnamed_refusal(event: str) -> str | None:
    """The API's words in a Job's FailedCreate that no rule names and that does not say it passes (pure).

    A 500, a 422 or an unknown webhook's answer; None for any other event.
    """
    reason, _, msg = event.partition(": ")
    if reason != FAILED_CREATE or JOBSET_SEQUENCING.search(msg) or TRANSIENT_REFUSALS.search(msg):
        return None
    return None if pod_refusal(msg) is not None else one_line(msg, 240)


def pod_refusal(msg: str) -> tuple[FailureClass, str] | None:
    """What the API's refusal of a worker pod's create says (pure): a Job's FailedCreate, or a dry run's answer.

    Returns:
        The class and one line naming what refused the pod, the API's words and the fix; None for a refusal that
        passes on its own (JobSet's leader handshake, a quota not counted yet) or that no rule names.
    """
    if JOBSET_SEQUENCING.search(msg) or TRANSIENT_REFUSALS.search(msg):
        return None
    for pattern, cls, what, fix in CREATE_REFUSALS:
        m = pattern.search(msg)
        if m is not None:
            return cls, f"{what.format(*m.groups())} ({one_line(msg, 240)}); {fix}"
    return None


def one_line(text: str | None, n: int = 160) -> str:
    """The first line of ``text``, cut to ``n`` characters (an API's message, a waiting reason's cause)."""
    if not text or not text.strip():
        return ""
    first = text.strip().splitlines()[0]
    return first if len(first) <= n else first[: n - 3] + "..."


def wait_clock(prev: WaitClock | None, reason: str | None, message: str | None, now: float) -> WaitClock | None:
    """The clock of a container's image-pull or creation failure after one more look at its waiting state.

    The kubelet reports its last pull failure, cached, while it retries the pull: one registry error followed by a
    slow multi-GB pull reads as one long failure. So the clock restarts whenever the failure changes (another
    reason family or another cause), and stops when the container no longer waits on such a failure (it started,
    or is being created). ``ErrImagePull`` and ``ImagePullBackOff`` of the same cause are one failure: the kubelet
    alternates them on every try. A back-off message that names no cause (kubelet before 1.32) is the back-off of
    the last pull error seen. None when the container is not waiting on a pull or creation failure.
    """
    if reason not in IMAGE_WAITING_REASONS:
        return None
    family = "pull" if reason in PULL_WAITING_REASONS else reason
    cause = waiting_cause(reason, message)
    if not cause and prev is not None and prev.key.startswith(f"{family}:"):
        cause = prev.cause
    key = f"{family}:{_DIGITS.sub('#', cause)}"
    if prev is not None and prev.key == key:
        return prev
    return WaitClock(key=key, since=now, cause=cause)


def _failed(obs: Observation) -> Verdict | None:
    if obs.jobset is None:
        return Verdict(state=AttemptOutcome.FAILED, reason="the attempt's JobSet was deleted by someone else")
    # FailureTarget is the Job controller's verdict; Failed only follows once every pod is terminal (the
    # snapshot's Job record keeps either, ``JobEvidence.failure``). The worker that failed first is named before it,
    # and before the JobSet's failure, which a supervisor slower than the controllers may see in the same view.
    jobs = [
        f"Job {j.name} {c.type}: {c.reason or '-'}: {c.message or 'no message'}" for j in obs.jobs if (c := j.failure())
    ]
    if obs.jobset_terminal_state == "Failed":
        c = next((c for c in obs.jobset.conditions if c.type == "Failed" and c.status == "True"), None)
        jobs.append("JobSet failed" + (f": {c.reason}: {c.message}" if c and (c.reason or c.message) else ""))
    failed = [p for p in obs.pods if p.phase == PodPhase.FAILED]
    if failed:
        # The first to fail, not a worker that exited on losing it (exit 20 comes a heartbeat timeout later).
        p = first_failed(
            failed,
            ended=lambda p: p.finished_at,
            index=lambda p: p.index,
            rank=lambda p: int(p.exit_code == ExitCode.PEER_LOST),
        )
        return Verdict(
            state=AttemptOutcome.FAILED, reason="; ".join([f"{p.label} failed ({_ended(p)})", *jobs]), worker=p.index
        )
    if jobs:
        return Verdict(state=AttemptOutcome.FAILED, reason="; ".join(jobs))
    return None


def _ended(p: PodEvidence) -> str:
    """``exit code 137, SIGKILL``: the code, the signal a code above 128 stands for, a reason other than Error."""
    if p.exit_code is None:
        return "no exit code"
    reason = p.terminated_reason if p.terminated_reason and p.terminated_reason != "Error" else None
    return _code_text(p.exit_code, reason)


def _code_text(code: int, reason: str | None = None) -> str:
    parts = [f"exit code {code}"]
    if code > 128:
        with contextlib.suppress(ValueError):  # 128 + a number that names no signal
            parts.append(signal.Signals(code - 128).name)
    return ", ".join([*parts, *([reason] if reason else [])])


def _trainer_ended(obs: Observation) -> Verdict | None:
    """A trainer exited non-zero in a pod its agent keeps running (level 0): the first to end failed the attempt."""
    failed = [a for a in obs.ended if a.exit_code]
    if not failed:
        return None
    peer = ExitCode.PEER_LOST
    a = first_failed(
        failed, ended=lambda a: a.at, index=lambda a: a.process_index, rank=lambda a: int(a.exit_code == peer)
    )
    return Verdict(
        state=AttemptOutcome.FAILED,
        reason=f"worker {a.process_index}'s trainer exited ({_code_text(a.exit_code or 0)}); its pod runs on",
        worker=a.process_index,
    )


def _succeeded(obs: Observation) -> Verdict | None:
    if obs.jobset_terminal_state == "Completed":
        return Verdict(state=AttemptOutcome.SUCCEEDED, reason="JobSet completed")
    if obs.jobs and all(j.has("Complete") for j in obs.jobs):
        return Verdict(state=AttemptOutcome.SUCCEEDED, reason="every Job completed")
    done = {p.index for p in obs.pods if p.phase == PodPhase.SUCCEEDED}
    if len(done) >= obs.expected_workers and all(p.phase == PodPhase.SUCCEEDED for p in obs.pods):
        return Verdict(state=AttemptOutcome.SUCCEEDED, reason=f"every worker succeeded ({len(done)}/{len(done)})")
    return None


def _container(obs: Observation, d: SupervisionConfig) -> Verdict | None:
    for p in obs.pods:
        for c in p.conditions:
            if c.type in d.config_conditions and c.status == "True":
                return Verdict(
                    state=AttemptOutcome.STALLED,
                    kind=StallKind.CONFIGURATION,
                    reason=f"{p.label}: pod condition {c.type}: {c.reason or '-'}: {c.message or 'no message'}",
                    worker=p.index,
                )
        reason = p.waiting_reason
        if reason not in IMAGE_WAITING_REASONS:
            continue
        clock = obs.waits.get(p.name)
        waited = obs.now - obs.counted_from(clock.since if clock is not None else obs.now)
        cause = (clock.cause if clock is not None else "") or waiting_cause(reason, p.waiting_message)
        permanent = pull_failure_is_permanent(reason, cause)
        credentials = pull_failure_is_credentials(reason, cause)
        if reason in IMMEDIATE_WAITING_REASONS:
            deadline = 0.0
        else:
            deadline = d.image_pull_deadline_s if permanent else d.transient_pull_deadline_s
        if waited >= deadline:
            said = p.waiting_message or "no message"
            told = f" (last error: {cause})" if cause and cause not in said else ""
            what = "permanent" if permanent else "credentials" if credentials else "transient"
            return Verdict(
                state=AttemptOutcome.STALLED,
                kind=StallKind.CONFIGURATION if permanent or credentials else StallKind.IMAGE_PULL,
                reason=f"{p.label}: container waiting {reason} for {waited:.0f} s (deadline {deadline:g} s for a "
                f"{what} failure): {said}{told}",
                worker=p.index,
            )
    return None


def _refused(obs: Observation, d: SupervisionConfig) -> Verdict | None:
    # Worker pods the API refuses by a policy no retry gets past (Pod Security, an admission webhook's denial, a
    # LimitRange, a missing ServiceAccount): the Job controller says so at once in a FailedCreate event, and keeps
    # trying for good; waiting for the start-up deadline would only delay the same verdict.
    if len(obs.pods) >= obs.expected_workers:
        return None
    for j in obs.jobs:
        for event in j.events:
            refusal = create_refusal(event)
            if refusal is not None and refusal[0] is FailureClass.CONFIGURATION:
                return Verdict(
                    state=AttemptOutcome.STALLED,
                    kind=StallKind.CONFIGURATION,
                    reason=f"Job {j.name} could not create its worker pods: {refusal[1]}",
                )
    return None


def _node_lost(obs: Observation, d: SupervisionConfig) -> Verdict | None:
    # A node lost for less than the grace ends nothing: a graceful shutdown marks it NotReady while the workers
    # still save, and the pods' failure (or the Job's FailureTarget, checked before this) follows; a kubelet
    # restart turns it Ready again.
    nodes = {n.name: n for n in obs.nodes}
    for p in obs.pods:
        if p.ended:  # being deleted while its node is healthy: on its way out; count what the Job counts
            continue
        n = nodes.get(p.node) if p.node else None
        terminating = p.deleted_at is not None
        terminating_for = obs.now - obs.counted_from(p.deleted_at) if p.deleted_at is not None else 0.0
        stuck = terminating and terminating_for >= d.force_delete_grace_s
        if n is not None and n.lost:
            lost_for = obs.now - obs.counted_from(n.lost_since(obs.now, obs.lost_seen.get(n.name)))
            if lost_for < d.node_lost_grace_s and not stuck:
                continue
            pod = f"; its pod Terminating for {obs.now - p.deleted_at:.0f} s" if terminating else ""
            return Verdict(
                state=AttemptOutcome.STALLED,
                kind=StallKind.NODE_LOST,
                reason=f"{p.label}: node {p.node} is {n.state} for {lost_for:.0f} s "
                f"(grace {d.node_lost_grace_s:g} s){pod}",
                worker=p.index,
            )
        # A live kubelet ends a deleted pod within the pod's own grace (SIGTERM, then SIGKILL; kubelet
        # pkg/kubelet/kuberuntime killContainer): on a node not known lost, only past that grace is it stuck.
        grace = d.force_delete_grace_s + (p.grace_s or 0)
        if terminating and terminating_for >= grace:
            return Verdict(
                state=AttemptOutcome.STALLED,
                kind=StallKind.NODE_LOST,
                reason=f"{p.label}: pod Terminating for {obs.now - p.deleted_at:.0f} s "
                f"(grace {grace:g} s) on node {p.node or '?'}",
                worker=p.index,
            )
    return None


def _capacity(obs: Observation, d: SupervisionConfig) -> Verdict | None:
    for p in obs.pods:
        if (p.phase or PodPhase.PENDING) != PodPhase.PENDING or p.node is not None:  # no phase yet: Pending
            continue
        sched = p.condition("PodScheduled")
        waited = obs.now - obs.counted_from(p.created_at if p.created_at is not None else obs.created_at)
        if sched is not None and sched.status == "False" and waited >= d.startup_deadline_s:
            return Verdict(
                state=AttemptOutcome.STALLED,
                kind=StallKind.CAPACITY,
                reason=f"{p.label}: unschedulable for {waited:.0f} s (deadline {d.startup_deadline_s:g} s): "
                f"{sched.reason or '-'}: {sched.message or 'no message'}",
                worker=p.index,
            )
    # Counted from the last Job's creation when later: the Job controller creates the pods once the JobSet
    # controller has created their Job, and either may have been restarting.
    jobs_at = [j.created_at for j in obs.jobs if j.created_at is not None]
    waited = obs.now - obs.counted_from(max([obs.created_at, *jobs_at]))
    deadline = max(d.startup_deadline_s, MISSING_PODS_GRACE_S)
    if len(obs.pods) < obs.expected_workers and waited >= deadline:
        missing = f"only {len(obs.pods)}/{obs.expected_workers} worker pods exist after {waited:.0f} s "
        # The Job said why: the API refused its pods, in words no rule names. Not capacity (nothing asked the
        # scheduler), and not configuration (whose budget is 0) without knowing: the class is unknown.
        said = [(j.name, w) for j in obs.jobs for e in j.events if (w := unnamed_refusal(e)) is not None]
        kind, why = StallKind.CAPACITY, ""
        if said:
            kind, why = StallKind.REFUSED, f": Job {said[-1][0]} says the API refused them: {said[-1][1]}"
        return Verdict(state=AttemptOutcome.STALLED, kind=kind, reason=f"{missing}(deadline {deadline:g} s){why}")
    return None


MISSING_PODS_GRACE_S = 60.0
"""The least a pod the API refused nothing for may take to exist: the JobSet and Job controllers create the pods,
and one that restarts acts only once it wins its leader election (kube-controller-manager's lease is 15 s by
default, renewed within 10 s) and has synced its caches; a start-up deadline shorter than that (a rehearsal's) would
charge a control-plane restart to capacity. A refused pod is the Job's FailedCreate, judged at once (``_refused``)."""


def startup_seconds(record: SupervisionRecord) -> float | None:
    """From every worker running to every worker's first step, as the supervisor of an attempt recorded it."""
    workers = record.workers
    started = [w.started_at for w in workers]
    first = [w.first_step_at for w in workers]
    if not workers or None in started or None in first:
        return None
    return max(0.0, max(first) - max(started))


def _first_step_grace(obs: Observation, d: SupervisionConfig) -> tuple[float, str]:
    """How long the gang may go without a first step, and what says so."""
    grace, why = d.compile_grace_s, f"compile grace {d.compile_grace_s:g} s"
    before = obs.startup_before_s
    if before is not None and STARTUP_MARGIN * before > grace:
        grace = STARTUP_MARGIN * before
        why = f"{STARTUP_MARGIN:g} times this run's earlier start-up of {before:.0f} s, above the {why}"
    return grace, why


STUCK_STEP_TIMES = 20
"""A step is stuck once no step ended for this many times the longest of the worker's latest steps (saves and
pauses between them included), plus the heartbeat interval the last step's heartbeat may be late by..."""
STUCK_STEP_FLOOR_S = 60.0
"""...and never sooner than this: a busy host (a collector, a slow disk, a neighbour compiling) can stall one step of
a fast loop for seconds without it being stuck."""


def _stuck_step_limit(b: WorkerProgress, d: SupervisionConfig) -> tuple[float, str]:
    """How long a stepping worker may go without a new step, and what says so.

    ``hang_timeout_s`` at most; sooner when the worker's heartbeats say how long its steps take, so that a stuck
    step of a fast loop is caught within a bounded multiple of its own time, not after the timeout set for the
    slowest.
    """
    if b.step_seconds is not None:
        limit = max(STUCK_STEP_FLOOR_S, d.heartbeat_interval_s + STUCK_STEP_TIMES * b.step_seconds)
        if limit < d.hang_timeout_s:
            return limit, (
                f"stuck-step limit {limit:.0f} s: {STUCK_STEP_TIMES} times its longest recent step of "
                f"{b.step_seconds:.1f} s plus the heartbeat interval of {d.heartbeat_interval_s:g} s, at least "
                f"{STUCK_STEP_FLOOR_S:g} s; hang timeout {d.hang_timeout_s:g} s"
            )
    return d.hang_timeout_s, f"hang timeout {d.hang_timeout_s:g} s"


def _hang(obs: Observation, d: SupervisionConfig) -> Verdict | None:
    running = [p for p in obs.pods if p.phase == PodPhase.RUNNING and p.running_since is not None]
    if len(running) < obs.expected_workers:
        return None  # the gang is not up yet: startup deadlines apply, not the hang timeout
    gang_up = obs.counted_from(max(p.running_since for p in running))
    beats = {b.index: b for b in obs.progress}
    save_limit = max(d.save_timeout_s, d.hang_timeout_s)
    # A gang steps together: while one worker's loop waits for a save (within its timeout), a peer blocked in the
    # next step's collective behind it is not hung either, from a little before that wait began.
    waits = [b.at for b in obs.progress if b.saving is not None and obs.now - b.at < save_limit]
    covered_from = min(waits) - d.hang_timeout_s if waits else None
    for p in sorted(running, key=lambda p: p.index or 0):
        # A worker whose reads fail, or succeed again since less than the timeout, shows neither absence nor silence.
        if obs.heard_for(p.index) < d.hang_timeout_s:
            continue
        b = beats.get(p.index) if p.index is not None else None
        if b is None or b.step is None:
            waited = obs.now - gang_up
            grace, why = _first_step_grace(obs, d)
            if waited >= grace:
                where = f"; in {b.phase.value} for {obs.now - b.at:.0f} s" if b is not None and b.phase else ""
                return Verdict(
                    state=AttemptOutcome.STALLED,
                    kind=StallKind.HANG,
                    reason=f"{p.label}: no first step {waited:.0f} s after every worker started ({why}){where}",
                    worker=p.index,
                )
            continue
        # A heartbeat is written at most every heartbeat_interval_s: the last step may be that old.
        silent = obs.now - obs.counted_from(b.at)
        if b.saving is not None:  # the loop waits for a save's commit: a slow store is not a hung step
            limit = save_limit
            why = (
                f"waited {silent:.0f} s after step {b.step} for the save of checkpoint {b.saving} to commit "
                f"(save timeout {limit:g} s)"
            )
        elif covered_from is not None and b.at >= covered_from:
            continue
        else:
            limit, why = _stuck_step_limit(b, d)
            why = f"no progress past step {b.step} for {silent:.0f} s ({why})"
        if silent >= limit:
            return Verdict(
                state=AttemptOutcome.STALLED, kind=StallKind.HANG, reason=f"{p.label}: {why}", worker=p.index
            )
    return None


def decide(obs: Observation, deadlines: SupervisionConfig) -> Verdict:
    """The state of an attempt.

    Order matters: an ended JobSet or a failed Job/pod wins over any stall (a pod stuck Terminating
    after the Job's ``FailureTarget`` is a failure, not a node-lost stall; a pod the kubelet failed in a
    node shutdown is a failure, not a lost node); success needs every worker; stalls are checked from the
    most specific evidence (a container that cannot start, a node lost past its grace) to the least (no
    room, no progress). ``deadlines``: the config's ``supervision`` section. The verdict is ``running``, with the
    gang's state as reason, while nothing has ended.
    """
    for check in (_failed(obs), _succeeded(obs), _trainer_ended(obs)):
        if check is not None:
            return check
    if obs.view is not None and not obs.view.ok:
        return Verdict(
            state=AttemptOutcome.RUNNING,
            reason=f"{_gang_state(obs)}; the cluster view is not current for {obs.now - obs.view.since:.0f} s "
            f"({obs.view.error}): no stall is judged on it",
        )
    if obs.jobset is not None and not obs.jobs and not obs.pods:
        return Verdict(
            state=AttemptOutcome.RUNNING,
            reason=f"JobSet has no Job {obs.now - obs.counted_from(obs.created_at):.0f} s after its creation: the "
            "JobSet controller has not acted on it yet (restarting, or not running); no stall is judged before it does",
        )
    for stall in (_container, _refused, _node_lost, _capacity, _hang):
        v = stall(obs, deadlines)
        if v is not None:
            return v
    return Verdict(state=AttemptOutcome.RUNNING, reason=_gang_state(obs))


def _gang_state(obs: Observation) -> str:
    """The running gang in one line: scheduled and running pods, the gang's step, saves waited for, blind reads."""
    scheduled = sum(1 for p in obs.pods if p.node is not None)
    running = sum(1 for p in obs.pods if p.phase == PodPhase.RUNNING)
    steps = [b.step for b in obs.progress if b.step is not None]
    at = f", step {min(steps)}" if len(steps) == obs.expected_workers else ""
    blind = ", ".join(str(r.index) for r in obs.unreadable)
    unread = f", heartbeats unreadable: worker {blind}" if blind else ""
    saves = sorted({b.saving for b in obs.progress if b.saving is not None})
    waits = f", waiting for the save of checkpoint {', '.join(map(str, saves))}" if saves else ""
    return f"scheduled {scheduled}/{obs.expected_workers}, running {running}/{obs.expected_workers}{at}{waits}{unread}"

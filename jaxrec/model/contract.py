"""The contracts between trainer, JobSet, and the recovery steps: exit codes, failure classes, closed vocabularies.

This module is the single table the README documents, the trainer imports, the JobSet
``podFailurePolicy`` is generated from, and ``classify-failure`` reads. The closed vocabularies that travel
inside the records and the step outputs are ``StrEnum``s whose values are the interface (a ``when`` branches
on them, a stored document holds them). It imports nothing heavy.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

# Substrings (lower case) of errors raised when another process of the gang or the coordination service is gone:
# the trainer exits 20 (peer lost) on them, and the classifier reads a traceback that has them as a lost peer.
PEER_LOSS_MARKERS = (
    "gloo",
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "coordination service",
    "coordinationservice",
    "heartbeat",
    "unavailable:",
    "deadline_exceeded",
    "barrier",
    "socket closed",
    "task has been shut down",
    "distributed service",
    "preempted",
)


class FailureClass(enum.StrEnum):
    """Why an attempt failed. The values are the workflow interface (Argo output parameters)."""

    PREEMPTION = "preemption"
    INFRASTRUCTURE = "infrastructure"
    HANG = "hang"
    CAPACITY = "capacity"
    APPLICATION = "application"
    CONFIGURATION = "configuration"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ClassInfo:
    """One row of the failure-class table: what a class means for the retries and for the user who reads it."""

    cls: FailureClass
    budget: int  # retries allowed by default (``retry.budgets``)
    # Counted over the whole run, or since the last attempt that advanced the checkpoint (``retry.budget_scopes``).
    scope: str
    no_progress_exempt: bool  # not counted by the no-progress guard (``retry.no_progress_attempts``)
    advice: str  # the sentence that ends classify-failure's reason


# Preemption and capacity are the platform's doing and expected on Spot for as long as the run lasts: budgeted
# since the last progress (a run that keeps checkpointing never runs out of them) and no sign of a run that stopped
# progressing. The rest say something about the job or its hosts that progress does not cure: the whole run.
FAILURE_CLASSES: tuple[ClassInfo, ...] = (
    ClassInfo(
        FailureClass.PREEMPTION,
        20,
        "since_progress",
        True,
        "Not a bug: the next attempt resumes from the last checkpoint.",
    ),
    ClassInfo(
        FailureClass.INFRASTRUCTURE,
        5,
        "run",
        False,
        "Host or network fault: retried on a fresh slice; repeated hits need a node check.",
    ),
    ClassInfo(
        FailureClass.HANG,
        3,
        "run",
        False,
        "A collective or input stall: retried; if it repeats, take a stack dump from a live worker.",
    ),
    ClassInfo(FailureClass.CAPACITY, 20, "since_progress", True, "Waiting for capacity."),
    ClassInfo(
        FailureClass.APPLICATION, 1, "run", False, "Will repeat if retried unchanged: fix the code or config first."
    ),
    ClassInfo(FailureClass.CONFIGURATION, 0, "run", False, "Retrying will not help: fix the config or image."),
    ClassInfo(FailureClass.UNKNOWN, 1, "run", False, "Read the worker logs."),
)
CLASS_INFO: dict[FailureClass, ClassInfo] = {c.cls: c for c in FAILURE_CLASSES}


class Decision(enum.StrEnum):
    """What ``classify-failure`` decides after a failed attempt."""

    RETRY = "retry"
    STOP = "stop"
    # Retry, in a continuation Workflow of the same run id: this one has run retry.attempts_per_workflow attempts.
    HAND_OVER = "hand-over"
    # Not a failed attempt: its supervisor was lost and left no verdict while the gang still runs; supervise the
    # same attempt again (the attempt is not closed and no budget is spent).
    RESUPERVISE = "resupervise"


class StallKind(enum.StrEnum):
    """Why a stalled attempt cannot end by itself: train-segment's ``stall-kind`` output."""

    CAPACITY = "capacity"
    CONFIGURATION = "configuration"
    HANG = "hang"
    # An image pull or container creation that keeps failing for a reason waiting may cure (class infrastructure).
    IMAGE_PULL = "image-pull"
    NODE_LOST = "node-lost"
    # Worker pods missing past the start-up deadline while their Job says the API refused them for a reason no rule
    # names (class unknown: neither capacity nor configuration is known).
    REFUSED = "refused"


class AttemptOutcome(enum.StrEnum):
    """Where an attempt stands or how it ended: the one vocabulary of every place that says it.

    The supervisor's live verdict (``supervision.Verdict.state``), train-segment's ``outcome`` output and
    ``attempts/<n>/supervision.json``, and ``attempts/<n>/record.json`` and the ledger each hold a subset, named by
    the sets below and checked where the record is validated (``outcome_check``): a value outside its place's
    subset is refused there.
    """

    # Verdict: the gang runs and nothing says the attempt is over (the supervisor keeps watching).
    # record.json, ledger: classify-failure's record of an attempt whose gang still runs with no supervisor
    # (resupervised: the attempt is not closed).
    RUNNING = "running"
    # Verdict, supervision.json, outcome output, record.json, ledger: every worker ended successfully.
    SUCCEEDED = "succeeded"
    # Verdict, supervision.json, outcome output: the gang failed. record.json, ledger: the attempt was closed
    # as failed, with a failure class (a stalled attempt is recorded failed too).
    FAILED = "failed"
    # Verdict, supervision.json, outcome output: the attempt cannot end by itself (``StallKind`` says why).
    STALLED = "stalled"
    # supervision.json, outcome output: not a verdict: this supervisor could not supervise (the record's
    # exit_code says why).
    ERROR = "error"
    # record.json, ledger: the Workflow ended other than Succeeded while the attempt was open (``argo stop``, or a
    # step that failed outside the loop) and its exit handler stopped the gang: no failure class, no budget charged.
    STOPPED = "stopped"

    SUPERVISOR_VERDICTS: ClassVar[frozenset[AttemptOutcome]]
    """A supervisor's verdict on an attempt that is over: succeeded, failed or stalled."""
    VERDICT_STATES: ClassVar[frozenset[AttemptOutcome]]
    """What the supervisor's live verdict (``supervision.Verdict.state``) holds: running, or a verdict."""
    SUPERVISION_OUTCOMES: ClassVar[frozenset[AttemptOutcome]]
    """What supervision.json and train-segment's ``outcome`` output hold: a verdict, or error."""
    RECORD_OUTCOMES: ClassVar[frozenset[AttemptOutcome]]
    """What record.json and the ledger hold: succeeded, failed, running (resupervised) or stopped."""


AttemptOutcome.SUPERVISOR_VERDICTS = frozenset(
    {AttemptOutcome.SUCCEEDED, AttemptOutcome.FAILED, AttemptOutcome.STALLED}
)
AttemptOutcome.VERDICT_STATES = AttemptOutcome.SUPERVISOR_VERDICTS | {AttemptOutcome.RUNNING}
AttemptOutcome.SUPERVISION_OUTCOMES = AttemptOutcome.SUPERVISOR_VERDICTS | {AttemptOutcome.ERROR}
AttemptOutcome.RECORD_OUTCOMES = frozenset(
    {AttemptOutcome.SUCCEEDED, AttemptOutcome.FAILED, AttemptOutcome.RUNNING, AttemptOutcome.STOPPED}
)


def outcome_check(allowed: frozenset[AttemptOutcome], where: str) -> Callable[[AttemptOutcome], AttemptOutcome]:
    """A validator (pydantic ``AfterValidator``): refuses an outcome outside ``allowed``, the subset ``where`` holds."""
    names = ", ".join(o.value for o in AttemptOutcome if o in allowed)

    def check(outcome: AttemptOutcome) -> AttemptOutcome:
        if outcome not in allowed:
            raise ValueError(f"{where} holds no outcome {outcome.value!r} (only {names})")
        return outcome

    return check


class NodePhase(enum.StrEnum):
    """A Workflow node's (and the Workflow's) phase, as Argo writes it.

    argo-workflows v4.0.5, ``pkg/apis/workflow/v1alpha1/workflow_types.go`` ``NodePhase``.
    """

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    SKIPPED = "Skipped"
    FAILED = "Failed"
    ERROR = "Error"
    OMITTED = "Omitted"


WORKFLOW_FINISHED = frozenset({NodePhase.SUCCEEDED, NodePhase.FAILED, NodePhase.ERROR})
"""The phases a Workflow ends in (argo-workflows v4.0.5 ``WorkflowPhase``: Succeeded, Failed, Error)."""


class FinalStatus(enum.StrEnum):
    """How the exit handler ends a Workflow's part in the run: its ``final-status`` output and the ledger's."""

    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    # A continuation Workflow of the run id carries the run on.
    HANDED_OVER = "HandedOver"
    # Another Workflow holds the run: this one recorded nothing.
    NOT_HOLDER = "NotHolder"


class Backend(enum.StrEnum):
    """What an attempt's gang ran on: a TPU slice (on GKE), or the CPU slice (the local runner's, or a cluster's)."""

    GKE = "gke"
    LOCAL = "local"

    @classmethod
    def of(cls, slice_cfg: Any) -> Backend:
        """The backend of a config's ``slice``."""
        return cls.LOCAL if slice_cfg.is_cpu else cls.GKE


class SkipKind(enum.StrEnum):
    """Why a step directory under ``checkpoints/`` is not restored (restore.json, QUARANTINE_REASON.json)."""

    TEMPORARY = "temporary"
    EMPTY = "empty"
    UNCOMMITTED = "uncommitted"
    MANIFEST = "manifest"
    CLOSED_ATTEMPT = "closed-attempt"
    INCOMPATIBLE = "incompatible"
    FILES = "files"
    NOT_A_STEP = "not-a-step"
    NOT_A_DIRECTORY = "not-a-directory"
    NAME = "non-canonical-name"
    ODD_ENTRIES = "odd-entries"


class ExitCode(enum.IntEnum):
    """Exit codes of the trainer and the step programs."""

    OK = 0
    ATTEMPT_FAILED = 1
    CONFIGURATION = 2
    INCOMPATIBLE_CHECKPOINT = 3
    PEER_LOST = 20
    HANG = 21
    ACCELERATOR_INIT = 22
    APPLICATION = 42
    TRANSIENT = 69
    CAPACITY = 75
    PREEMPTED = 143


@dataclass(frozen=True)
class ExitCodeInfo:
    """One row of the exit-code table."""

    code: ExitCode
    meaning: str
    usual_class: FailureClass | None
    # What JobSet's podFailurePolicy does with a pod that exits with this code:
    # "FailJob" ends the attempt at once (the usual case for a gang); "Ignore" would let the
    # Job recreate the pod, which is never right for a multi-host gang, so nothing uses it.
    pod_failure_action: str | None


EXIT_CODES: tuple[ExitCodeInfo, ...] = (
    ExitCodeInfo(ExitCode.OK, "training finished (all steps)", None, None),
    ExitCodeInfo(
        ExitCode.ATTEMPT_FAILED,
        "train-segment: the attempt failed or stalled and was stopped (classify-failure names the class)",
        None,
        None,
    ),
    ExitCodeInfo(
        ExitCode.CONFIGURATION,
        "configuration error or startup validation mismatch (process count, devices, topology)",
        FailureClass.CONFIGURATION,
        "FailJob",
    ),
    ExitCodeInfo(
        ExitCode.INCOMPATIBLE_CHECKPOINT,
        "checkpoint incompatible with the config",
        FailureClass.CONFIGURATION,
        "FailJob",
    ),
    ExitCodeInfo(
        ExitCode.PEER_LOST,
        "peer lost: a collective or the coordination service failed",
        FailureClass.INFRASTRUCTURE,
        "FailJob",
    ),
    ExitCodeInfo(ExitCode.HANG, "hang: no step completed within the watchdog timeout", FailureClass.HANG, "FailJob"),
    ExitCodeInfo(
        ExitCode.ACCELERATOR_INIT,
        "accelerator or runtime initialisation failed",
        FailureClass.INFRASTRUCTURE,
        "FailJob",
    ),
    ExitCodeInfo(
        ExitCode.APPLICATION,
        "application error: uncaught exception in training code, non-finite loss",
        FailureClass.APPLICATION,
        "FailJob",
    ),
    # sysexits EX_UNAVAILABLE. Every step template retries it in place (Argo retryStrategy), outside the
    # failure-class budgets; only a step that still fails after its retries reaches classify-failure.
    ExitCodeInfo(
        ExitCode.TRANSIENT,
        "transient: run store or Kubernetes API unreachable, HTTP 429/5xx (the step is retried in place)",
        FailureClass.INFRASTRUCTURE,
        None,
    ),
    ExitCodeInfo(
        ExitCode.CAPACITY,
        "capacity not available yet (provision-slice; retry later)",
        FailureClass.CAPACITY,
        None,
    ),
    ExitCodeInfo(
        ExitCode.PREEMPTED,
        "SIGTERM received; state saved at the agreed step when the save fits the shutdown window, then exited",
        FailureClass.PREEMPTION,
        "FailJob",
    ),
)

_BY_CODE = {row.code.value: row for row in EXIT_CODES}


def exit_code_info(code: int) -> ExitCodeInfo | None:
    """Return the table row for ``code``, or None for a code outside the contract."""
    return _BY_CODE.get(code)


def trainer_exit_codes() -> list[int]:
    """Codes the trainer itself may exit with (the ones a JobSet podFailurePolicy maps)."""
    return [row.code.value for row in EXIT_CODES if row.pod_failure_action is not None]

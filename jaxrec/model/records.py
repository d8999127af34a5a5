"""Every document the parts exchange through the run store, each declared once as a pydantic record.

Each record's path is one function of ``RunLayout`` (``jaxrec.adapters.store``); writers and readers go
through ``RunStore.write_record`` / ``RunStore.read_record``, which refuse an unreadable or wrong-shaped
document with one line naming the file (``DocumentError``). The decisions made over these records live
elsewhere (``classify``, ``verify``, ``retry``).
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationInfo,
    field_validator,
    model_validator,
)

from jaxrec.model.contract import (
    AttemptOutcome,
    Backend,
    Decision,
    FailureClass,
    FinalStatus,
    SkipKind,
    StallKind,
    outcome_check,
)
from jaxrec.model.snapshot import ClusterSnapshot
from jaxrec.model.tiers import Tier

# The outcomes each record holds (``AttemptOutcome``'s subsets), refused outside them when a record is validated.
_RecordedOutcome = Annotated[
    AttemptOutcome, AfterValidator(outcome_check(AttemptOutcome.RECORD_OUTCOMES, "an attempt's record"))
]
_SupervisedOutcome = Annotated[
    AttemptOutcome, AfterValidator(outcome_check(AttemptOutcome.SUPERVISION_OUTCOMES, "supervision.json"))
]


class _Record(BaseModel):
    # A field that exists is declared: a document with an unknown field is of the wrong shape and is refused
    # (every part of one run runs the same image, so a reader never meets a newer writer's fields).
    model_config = ConfigDict(extra="forbid")


def now() -> float:
    """Wall-clock seconds since the epoch: the one clock every record uses."""
    return time.time()


class RunConfigDocument(_Record):
    """``config.json``: the validated config of the run and its hash (written by validate-config)."""

    config: dict[str, Any] = Field(description="Every field of the JobConfig, as JSON.")
    hash: str = Field(description="JobConfig.config_hash() of ``config``.")


class PreemptionSave(enum.StrEnum):
    """What a worker did with its state after a SIGTERM stop (the exit report's ``preemption_save``)."""

    SAVED = "saved"  # the agreed step was saved and committed inside the window
    IN_FLIGHT_ONLY = "in-flight-only"  # the interval save in flight was committed; the agreed step was not saved
    SKIPPED = "skipped"  # no save fitted the window: exited at once without starting one
    NONE = "none"  # not stopped by SIGTERM (or stopped before any decision was made)


class WorkerExitReport(_Record):
    """What one worker writes to ``attempts/<n>/workers/<i>.json`` before it exits (any exit)."""

    run_id: str
    attempt: int
    process_index: int
    process_count: int
    exit_code: int = Field(description="The contract code the worker exits with.")
    exit_name: str = Field(description="Name of the exit code (ExitCode member name).")
    last_step: int | None = Field(default=None, description="Last step completed by this worker.")
    last_checkpoint_step: int | None = Field(default=None, description="Newest committed checkpoint step.")
    restore_step: int | None = Field(default=None, description="Step restored at start (None: fresh).")
    restore_tier: Tier | None = Field(
        default=None, description="With the local tiers: local, peer or gcs, the farthest tier a part came from."
    )
    exception_type: str | None = None
    exception_message: str | None = None
    traceback: str | None = Field(default=None, description="Last lines of the traceback, if any.")
    hostname: str | None = None
    pid: int | None = None
    started_at: float | None = None
    initialized_at: float | None = Field(default=None, description="jax.distributed ready.")
    restored_at: float | None = Field(default=None, description="State restored (or fresh state built).")
    first_step_at: float | None = Field(default=None, description="First step compiled and finished.")
    ended_at: float | None = None
    compile_seconds: float | None = None
    steps_per_second: float | None = None
    restore_seconds: float | None = Field(
        default=None, description="Restoring the checkpoint (or building the fresh state)."
    )
    restore_parts: dict[str, float] = Field(
        default_factory=dict,
        description="From the runtime ready to the state restored, by part, in seconds (opening the task, data and "
        "manifest; setting aside newer steps; building the model; opening the checkpointer; reading the checkpoint; "
        "checking the bytes read).",
    )
    compile_cache_requests: int | None = Field(
        default=None, description="Compilations that asked the persistent cache, up to the first step."
    )
    compile_cache_hits: int | None = Field(default=None, description="Of those, the ones the cache answered.")
    peak_rss_mib: float | None = Field(default=None, description="Peak resident set size of the worker, MiB.")
    params_digest: str | None = Field(
        default=None, description="sha256 of the final parameters (exit 0): resumes compare it."
    )
    state_digest: str | None = Field(
        default=None,
        description="sha256 of this process's shards of the whole final state: parameters, optimizer state, step, "
        "RNG, data position (exit 0). Equal between runs of one sharding when the states are identical.",
    )
    preemption_save: PreemptionSave = Field(
        default=PreemptionSave.NONE,
        description="After a SIGTERM stop: saved, in-flight-only, skipped (no save fitted the window) or none.",
    )
    preemption_reason: str | None = Field(
        default=None, description="One line: why that was decided (estimate against the budget left)."
    )
    preemption_budget_s: float | None = Field(
        default=None, description="Save budget: the shutdown window minus the exit margin (seconds)."
    )
    preemption_elapsed_s: float | None = Field(
        default=None, description="Seconds from the gang's first SIGTERM to the decision."
    )
    preemption_estimate_s: float | None = Field(
        default=None, description="Estimated save time used (newest measured save; None: none measured yet)."
    )
    preemption_in_flight: bool | None = Field(
        default=None, description="An interval save was still in flight when the stop was agreed."
    )


class ManifestFile(_Record):
    """One file of a checkpoint, as the manifest records it."""

    path: str = Field(description="Path relative to the checkpoint step directory.")
    size: int
    crc32c: str = Field(
        description="CRC32C of the contents, hex: on GCS the one the store computed on upload and lists; on a "
        "local directory computed by the writing host, streamed."
    )
    generation: int | None = Field(
        default=None,
        description="GCS object generation as listed when the manifest was written: pins the object itself, so "
        "a rewrite or a copy with the same bytes does not pass. None locally and in manifests written before "
        "generations were recorded (those verify by size and CRC32C only).",
    )
    sha256: str | None = Field(
        default=None,
        description="SHA-256 of the contents, hex, on a local directory: streamed by the host that wrote the file "
        "alongside the CRC32C; it pins the contents where the CRC32C cannot (OCDBT files end with their own "
        "CRC32C, so all have the same whole-file CRC32C). None on GCS (the generation pins the object).",
    )


class CheckpointManifest(_Record):
    """``checkpoints/<step>/manifest.json``: written by the primary host after orbax committed the step.

    Its presence is the last part of the transaction: a step without a valid manifest is incomplete.
    """

    step: int
    run_id: str
    attempt: int = Field(description="Attempt that wrote this checkpoint.")
    config_hash: str
    config: dict[str, Any] = Field(description="The full config the checkpoint was written under.")
    code_version: str
    dataset_version: str = Field(
        description="data.dataset_version for generated examples; the record files' fingerprint for data.files."
    )
    task_name: str = Field(default="lm", description="TaskSpec.name of the task whose state this is.")
    task_version: str = Field(default="1", description="TaskSpec.version: the state's structure and meaning.")
    task_options_hash: str = Field(default="", description="sha256 of the task's validated options.")
    process_count: int
    mesh_shape: dict[str, int]
    library_versions: dict[str, str]
    wall_time: float = Field(description="When the manifest was written (epoch seconds).")
    save_seconds: float | None = Field(default=None, description="From save start to commit.")
    files: list[ManifestFile] = Field(default_factory=list)


class Incident(_Record):
    """One failure and its recovery, on one clock (epoch seconds). Fields unknown stay None."""

    attempt: int = Field(description="The attempt that failed.")
    scenario: str | None = Field(default=None, description="Injected scenario, when the failure was injected.")
    failure_class: FailureClass | None = None
    injected_at: float | None = None
    detected_at: float | None = Field(default=None, description="First worker exited with a failure.")
    stopped_at: float | None = Field(default=None, description="Every worker of the attempt had exited.")
    slice_ready_at: float | None = Field(default=None, description="Next attempt's provision-slice done.")
    workers_started_at: float | None = Field(default=None, description="Every worker of the next attempt up.")
    restored_at: float | None = Field(default=None, description="Checkpoint restored on every worker.")
    first_step_at: float | None = Field(default=None, description="First step compiled and done.")
    compile_seconds: float | None = Field(
        default=None, description="The next attempt's step compilation (slowest worker), started before the restore."
    )
    compile_overlap_seconds: float | None = Field(
        default=None, description="Of that compilation, the seconds that ran beside the restore (hidden by it)."
    )
    recovered_at: float | None = Field(default=None, description="Back at the pre-failure step.")
    pre_failure_step: int | None = None
    restored_step: int | None = None
    restore_tier: Tier | None = Field(
        default=None, description="With the local tiers: where the restored step came from (local, peer or gcs)."
    )
    steps_lost: int | None = None
    params_match_reference: bool | None = Field(
        default=None, description="Local runs with --reference: the run's final parameters equal the reference's."
    )

    @property
    def recovery_seconds(self) -> float | None:
        """From the failure (injected or detected) to being back at the pre-failure step."""
        start = self.injected_at or self.detected_at
        if start is None or self.recovered_at is None:
            return None
        return self.recovered_at - start


class AttemptRecord(_Record):
    """``attempts/<n>/record.json`` and one entry of the ledger."""

    attempt: int
    outcome: _RecordedOutcome = Field(description="succeeded, failed or stopped (running: resupervised, not closed).")
    failure_class: FailureClass | None = None
    reason: str = ""
    evidence: list[str] = Field(default_factory=list, description="Evidence lines the verdict used.")
    decision: Decision | None = None
    decision_reason: str | None = Field(default=None, description="Why classify-failure decided retry or stop.")
    backoff_seconds: float = Field(default=0, description="The retry policy's backoff for this failure.")
    backoff_wait_seconds: float | None = Field(
        default=None, description="What was left of the backoff when the attempt was closed (it counts from ended_at)."
    )
    checkpoint_step_before: int | None = None
    checkpoint_step_after: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    closed_at: float | None = Field(default=None, description="When the attempt was closed in the ledger.")
    backend: Backend | None = Field(default=None, description="gke or local.")
    jobset: str | None = Field(default=None, description="The attempt's JobSet (or local slice) name.")
    first_worker: int | None = Field(default=None, description="Index of the first worker that failed.")
    cause_worker: int | None = Field(default=None, description="Index of the worker whose failure is the cause.")
    workflow: str | None = Field(default=None, description="Name of the Workflow that ran the attempt.")
    level: int | None = Field(
        default=None,
        description="The recovery ladder's rung that followed the failure: 0, every trainer restarted in its pod "
        "(the segment's supervisor closed the attempt); None, the gang recreated (levels 1 and 2).",
    )


class HandOver(_Record):
    """One entry of ``Ledger.hand_overs``: a Workflow passed the run to a continuation Workflow of the run id."""

    from_workflow: str = Field(description="Name of the Workflow that handed the run over.")
    from_uid: str
    to_workflow: str = Field(description="Name of the continuation Workflow (deterministic: <run-id>-c<attempt>).")
    to_uid: str = Field(description="Its uid: the run lease passes to it before the first Workflow ends.")
    next_attempt: int = Field(description="The attempt the continuation starts with.")
    at: float
    backend: Backend = Field(description="gke (created through the Kubernetes API) or local (the local runner).")


class Ledger(_Record):
    """``ledger.json``: every closed attempt of the run, updated with generation preconditions."""

    run_id: str
    attempts: list[AttemptRecord] = Field(default_factory=list)
    final_status: FinalStatus | None = Field(default=None, description="Succeeded or Failed once the run ended.")
    final_reason: str | None = None
    argo_status: str | None = Field(default=None, description="``{{workflow.status}}`` the exit handler saw.")
    hand_overs: list[HandOver] = Field(
        default_factory=list, description="Continuation Workflows of the run, in order (empty: one Workflow)."
    )

    @model_validator(mode="wrap")
    @classmethod
    def _stored_with_attempts(cls, data: Any, handler: ModelWrapValidatorHandler[Ledger], info: ValidationInfo):
        # Every writer writes the list, empty included: a stored ledger without one was not written by a step, and
        # reading it as "no attempts" would reset every budget.
        ledger = handler(data)
        if isinstance(data, dict) and (info.context or {}).get("stored") and "attempts" not in data:
            raise ValueError("no 'attempts' list; restore ledger.json from the run's history, or start a new run id")
        return ledger

    @field_validator("attempts")
    @classmethod
    def _one_record_per_attempt(cls, attempts: list[AttemptRecord]) -> list[AttemptRecord]:
        # Budgets and the closed-attempt rule count records: a second record of an attempt would count it twice,
        # and a reader taking "the last entry" would pick one at random.
        seen: set[int] = set()
        for prev, a in zip([None, *attempts], attempts, strict=False):
            if a.attempt in seen:
                raise ValueError(f"attempt {a.attempt} is recorded twice; keep one record per attempt in ledger.json")
            if prev is not None and a.attempt < prev.attempt:
                raise ValueError(
                    f"attempt {a.attempt} is recorded after attempt {prev.attempt}; list attempts in ascending order"
                )
            seen.add(a.attempt)
        return attempts

    def by_class(self) -> dict[str, int]:
        """Failed attempts so far, by class (every class present, zero included)."""
        counts = Counter(a.failure_class.value for a in self.attempts if a.failure_class is not None)
        return {c.value: counts[c.value] for c in FailureClass}

    def closed_attempts(self) -> set[int]:
        """Numbers of the attempts already closed (a checkpoint they write later is not trusted)."""
        return {a.attempt for a in self.attempts if a.closed_at is not None}


class SkippedStep(_Record):
    """One checkpoint restore-latest did not choose, and why."""

    step: int
    name: str = Field(description="The step directory's name under ``checkpoints/``.")
    reason: str
    kind: SkipKind = Field(description="Why it is not restorable.")
    quarantined: bool = Field(description="Moved to ``quarantine/`` (False: left in place).")


class RestoreRecord(_Record):
    """``attempts/<n>/restore.json``: which step attempt ``n`` restores, decided by restore-latest."""

    attempt: int
    run_id: str
    config_hash: str
    exit_code: int
    restore_step: int = Field(description="The step to restore; -1 for a fresh start.")
    restore_path: str = Field(description="The step directory verified (empty for a fresh start).")
    skipped: list[SkippedStep] = Field(default_factory=list)
    quarantined: list[str] = Field(default_factory=list, description="Quarantine directories written.")
    decided_at: float


class LocalPartManifest(_Record):
    """``<local dir>/<run-id>/steps/<step>/part-<i>/manifest.json``: one host's part of a step on a host-local disk.

    Written last, by the host that wrote the part or by the peer that copied it (same content), so a part
    directory with no manifest is never restored. A copy counts only when it names this run, this config
    (hash), the same process count and device layout, and every file has its size, CRC32C and SHA-256.
    """

    format: int = 1
    run_id: str
    step: int
    process_index: int = Field(description="The part: whose addressable shards and data position it holds.")
    process_count: int
    local_devices: int = Field(description="Devices per process when it was written (the shard layout).")
    mesh_shape: dict[str, int]
    config_hash: str
    dataset_version: str
    attempt: int
    node: str = Field(description="The node the part was written on (a peer copy keeps the writer's).")
    copied_to: str | None = Field(default=None, description="For a peer copy: the node that holds this copy.")
    files: list[ManifestFile]
    wall_time: float


class TierPart(_Record):
    """Where one part of the restored step was read from."""

    part: int
    tier: Tier = Field(description="local (own disk), peer (another host's disk) or gcs.")
    node: str | None = None


class TierSkipped(_Record):
    """A step newer than the one restored that had no complete set of verified copies, and why."""

    step: int
    reason: str


class TierRecord(_Record):
    """``attempts/<n>/tiers.json``: the gang's choice among local, peer and GCS copies (process 0 writes it)."""

    attempt: int
    gcs_step: int = Field(description="restore-latest's choice in the bucket (-1: none).")
    step: int = Field(description="The step restored (-1: fresh start).")
    tier: Tier | None = Field(description="The farthest tier any part came from (gcs: every part from GCS).")
    parts: list[TierPart] = Field(default_factory=list)
    skipped: list[TierSkipped] = Field(default_factory=list, description="Newer steps not restorable, and why.")
    note: str = ""
    rounds: int = Field(default=1, description="Decisions made: one more each time a copy failed its check on load.")
    refused: list[str] = Field(default_factory=list, description="Copies that failed their check on load, and why.")
    seconds: float = Field(description="From the start of the choice to every part loaded and checked.")
    decided_at: float


class QuarantineReason(_Record):
    """``quarantine/<name>/QUARANTINE_REASON.json``: why a checkpoint was moved, from where, by which attempt."""

    step: int
    from_: str = Field(alias="from", description="Where the step directory was.")
    kind: SkipKind
    reason: str
    attempt: int
    objects: int = Field(description="Objects moved.")
    moved_at: float

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ProvisionRecord(_Record):
    """``attempts/<n>/provision.json``: provision-slice's last try (classify-failure reads it)."""

    exit_code: int
    message: str
    at: float


class RunLease(_Record):
    """``lease.json``: which workflow acts for the run (generation-checked writes; ``recovery_steps.lease``)."""

    run_id: str
    holder: str = Field(description="The holding workflow's uid ({{workflow.uid}}).")
    holder_name: str = Field(description="The holding workflow's name, for people and `argo stop`.")
    acquired_at: float
    renewed_at: float = Field(description="Last renewal; the lease expires at renewed_at + ttl_s.")
    ttl_s: float
    released: bool = Field(default=False, description="Set by the holder's exit handler.")
    namespace: str | None = Field(
        default=None,
        description="The holding workflow's namespace (None: the local runner, or not known).",
    )
    cluster: str | None = Field(
        default=None,
        description="The holding workflow's cluster: the uid of its kube-system namespace (None: the local runner, "
        "or not readable). Another holder finds the workflow by name only in the same cluster and namespace.",
    )
    first_attempt: int | None = Field(
        default=None,
        description="The first attempt this holder acts for: set by validate-config once it has compared and pinned "
        "the config (by hand-over: the continuation's first attempt). None: the holder never validated, so its exit "
        "handler records nothing and deletes nothing.",
    )


class PreflightCheck(_Record):
    """``preflight.json``: what the preflight of the latest submission found (validate-config writes it)."""

    ok: bool = Field(description="True when every check passed.")
    problems: list[str] = Field(default_factory=list, description="One line per missing permission or object.")
    at: float = Field(default_factory=now, description="When the checks ran.")


class InjectedFault(_Record):
    """One fault the local runner injected, and when."""

    scenario: str
    attempt: int
    at: float


class LocalSummary(_Record):
    """``local/summary.json``: how a local run ended (written by ``workflows.local``)."""

    run_id: str
    status: str
    restarts: int
    final_reason: str | None = None
    params_digest: str | None = None
    reference_digest: str | None = None
    params_match_reference: bool | None = None
    injected: list[InjectedFault] = Field(default_factory=list)
    corrupted: list[str] = Field(default_factory=list)
    attempts: int | None = None
    finished_at: float


class EventKind(enum.StrEnum):
    """What a ``WorkerEvent`` line says happened, in the order a worker meets them."""

    STARTED = "started"  # the process is up
    INITIALIZED = "initialized"  # jax.distributed ready on every process
    COMPILED = "compiled"  # the step compiled ahead, beside the restore
    RESTORED = "restored"  # state restored (or a fresh one built)
    FIRST_STEP = "first_step"
    STEP = "step"
    SAVE_STARTED = "save_started"
    SAVE_COMMITTED = "save_committed"
    SAVE_COST = "save_cost"  # what a save cost the loop, known once its steps are read at their pace again
    LOCAL_SAVED = "local_saved"  # a part landed on a host's disk: reason "local" (own) or "peer" (a copy)
    SIGTERM = "sigterm"
    PREEMPTION_PLAN = "preemption_plan"  # what the gang does with its state on a SIGTERM stop
    EXIT = "exit"


class WorkerEvent(_Record):
    """One line of ``worker-<i>.jsonl`` (``TRAINER_EVENTS_DIR``; ``local/events/`` in a gs:// local run)."""

    t: float = Field(description="When (the one clock, epoch seconds).")
    event: EventKind
    attempt: int
    process_index: int
    step: int | None = None
    code: int | None = Field(default=None, description="exit: the exit code.")
    reason: str | None = Field(default=None, description="exit: why; preemption_plan: the action and why.")
    process_count: int | None = Field(default=None, description="initialized: processes in the gang.")
    devices: int | None = Field(default=None, description="initialized: devices in the gang.")
    restore_step: int | None = Field(default=None, description="restored: the step restored (-1: fresh).")
    restore_tier: Tier | None = Field(default=None, description="restored: local, peer or gcs (local tiers on).")
    loss: float | None = Field(default=None, description="step: the loss.")
    compile_seconds: float | None = Field(
        default=None, description="first_step: compile and run time; compiled: the step's compilation ahead."
    )
    overlap_seconds: float | None = Field(
        default=None, description="compiled: of the compilation, the seconds it ran beside the restore."
    )
    waited_seconds: float | None = Field(
        default=None, description="compiled: seconds the worker waited for it after the state was restored."
    )
    save_seconds: float | None = Field(default=None, description="save_committed: save start to commit.")
    blocking_seconds: float | None = Field(
        default=None, description="save_cost: the time the loop did not step because of the save."
    )
    blocking_parts: dict[str, float] | None = Field(
        default=None, description="save_cost: where the blocking time went, and what ran off the loop."
    )
    restore_seconds: float | None = Field(default=None, description="restored: restoring (or building) the state.")
    restore_parts: dict[str, float] | None = Field(
        default=None, description="restored: from the runtime ready to the state restored, by part (seconds)."
    )
    cpu_s: float | None = Field(
        default=None,
        description="started, initialized, restored, first_step: the worker's CPU seconds so far (all threads).",
    )
    cache_requests: int | None = Field(default=None, description="first_step: compilations that asked the cache.")
    cache_hits: int | None = Field(default=None, description="first_step: of those, answered by the cache.")


def parse_event_line(line: bytes | str) -> WorkerEvent | None:
    """One ``WorkerEvent`` line, or None for a torn or foreign line.

    Event files are appended to while they are read; a line that is not a complete event is skipped.
    """
    try:
        return WorkerEvent.model_validate_json(line)
    except ValueError:
        return None


class WorkerPhase(enum.StrEnum):
    """What a worker is doing, as its heartbeat says: a hang deadline knows which phase it judges."""

    RESTORE = "restore"  # reading the checkpoint (or building fresh state)
    COMPILE = "compile"  # state restored, waiting for the step's compilation
    STEP = "step"  # training
    SAVE = "save"  # the loop waits for a checkpoint save to commit


STARTUP_MARGIN = 2.0
"""A hang deadline before the first step is never shorter than this many times the longest start-up of the run's
latest earlier attempts (the supervisor's and the worker's watchdog alike): a restore or compilation as long as one
the run already went through is not a hang."""
STARTUP_ATTEMPTS_READ = 5
"""How many of the run's latest earlier attempts those start-ups are read from."""


def startup_attempts(attempt: int) -> range:
    """The run's latest earlier attempts whose start-ups a hang deadline of ``attempt`` reads, newest first."""
    return range(attempt - 1, max(-1, attempt - 1 - STARTUP_ATTEMPTS_READ), -1)


class WorkerHeartbeat(_Record):
    """``attempts/<n>/heartbeats/<i>.json``: one worker's newest progress, rewritten at most every interval.

    The supervisor reads these from the run store rather than scraping the workers' metrics: the store
    is reachable from the supervisor's pod whatever happens to a worker's node or network, it outlives
    the worker, and it is the same path locally and on GKE.
    """

    process_index: int
    step: int | None = Field(default=None, description="Last step completed (None before the first).")
    checkpoint_step: int | None = Field(default=None, description="Newest committed checkpoint step.")
    at: float = Field(description="When this heartbeat was written.")
    first_step_at: float | None = Field(default=None, description="When the first step finished.")
    saving: int | None = Field(
        default=None,
        description="The checkpoint step whose save the loop has waited for since ``at`` (None: not waiting).",
    )
    phase: WorkerPhase | None = Field(
        default=None, description="What the worker was doing from ``at`` on (None: a worker that does not say)."
    )
    step_seconds: float | None = Field(
        default=None,
        description="The longest time between the ends of two of its latest steps (saves and pauses in between "
        "included, the first step's compilation not): how long a step of this run takes at most.",
    )


class AgentAction(enum.StrEnum):
    """What a ``RestartOrder`` asks of a gang's agents (``trainer.agent``)."""

    STOP = "stop"  # end the trainer (SIGTERM, then SIGKILL), wait for it to exit, say so, and wait for START
    START = "start"  # every agent has stopped: run the trainer of the order's attempt
    EXIT = "exit"  # no restart in place: end the trainer and leave with its code (the pod fails, the gang goes)


class RestartOrder(_Record):
    """``attempts/<n>/restart.json``: the supervisor's order to the agents of attempt ``n``'s gang.

    Level 0 of the recovery ladder: every worker's trainer is restarted in its running pod as ``attempt``, a new
    JAX process group, once every old trainer has exited. One writer (the segment's supervisor); the agents read it.
    """

    action: AgentAction
    attempt: int = Field(description="The attempt the gang's trainers run next (STOP, START); EXIT: the current one.")
    restore_step: int = Field(default=-1, description="The step every trainer restores (-1: fresh start).")
    reason: str = ""
    at: float = Field(default_factory=now)


class AgentStateKind(enum.StrEnum):
    """Where one worker's agent stands."""

    RUNNING = "running"  # its trainer runs ``attempt``
    EXITED = "exited"  # its trainer of ``attempt`` exited with ``exit_code``; waiting for an order
    STOPPED = "stopped"  # its trainer has exited and released its devices; ready to start ``attempt``


class AgentState(_Record):
    """``attempts/<n>/agents/<i>.json``: worker ``i``'s agent in attempt ``n``'s gang (one writer: the agent)."""

    process_index: int
    state: AgentStateKind
    attempt: int = Field(description="RUNNING, EXITED: the attempt its trainer runs or ran; STOPPED: the next one.")
    exit_code: int | None = Field(
        default=None, description="The trainer's last exit code (a signal N: 128 + N, as a shell says it)."
    )
    at: float = Field(default_factory=now)


class WorkerSupervision(_Record):
    """One worker as the supervisor saw it last (times on the one clock, None when never seen)."""

    index: int
    pod: str | None = None
    node: str | None = None
    scheduled_at: float | None = Field(default=None, description="PodScheduled became True.")
    started_at: float | None = Field(default=None, description="The trainer container started running.")
    first_step_at: float | None = Field(default=None, description="From the worker's heartbeat.")
    last_step: int | None = None
    last_state: str = Field(default="", description="Phase, waiting or terminated reason, deletion, node state.")


class SupervisionRecord(_Record):
    """``attempts/<n>/supervision.json``: how the supervisor saw the attempt end, and when it stopped it."""

    attempt: int
    jobset: str
    outcome: _SupervisedOutcome = Field(
        description="succeeded, failed or stalled, or error when the supervisor could not supervise (exit_code "
        "says why)."
    )
    exit_code: int | None = Field(default=None, description="The supervisor's exit code when outcome is error.")
    stall_kind: StallKind | None = Field(default=None, description="Why a stalled attempt could not end by itself.")
    reason: str = Field(description="One line: why the attempt is over.")
    worker: int | None = Field(default=None, description="The worker the reason is about, if one.")
    created_at: float | None = Field(default=None, description="The JobSet's creationTimestamp.")
    reattached: bool = Field(default=False, description="The JobSet existed already: a retried supervisor.")
    detected_at: float = Field(description="When the supervisor decided the attempt was over.")
    stopped_at: float | None = Field(default=None, description="When no worker pod of the attempt was left.")
    last_step: int | None = None
    checkpoint_step: int | None = Field(default=None, description="Newest committed checkpoint any worker reported.")
    workers: list[WorkerSupervision] = Field(default_factory=list)
    evidence: list[str] = Field(default_factory=list, description="Each pod's and node's last state, before the stop.")
    force_deleted: list[str] = Field(default_factory=list, description="Pods force-deleted on a lost node.")
    placement: str | None = Field(
        default=None, description="Where the gang asked to run: the recovery ladder's level and why."
    )
    snapshot: ClusterSnapshot | None = Field(
        default=None,
        description="The JobSet, Jobs, pods and nodes as the supervisor last saw them before the stop (which "
        "deletes them): classify-failure's evidence when the API has nothing left.",
    )

    @property
    def decided(self) -> bool:
        """A supervisor decided the attempt (succeeded, failed or stalled); error says only that it could not."""
        return self.outcome in AttemptOutcome.SUPERVISOR_VERDICTS


class SupervisorLosses(_Record):
    """``attempts/<n>/supervisor-losses.json``: the attempt's gang found running with no supervisor's verdict.

    Each time classify-failure had it supervised again (bounded: a supervisor that keeps dying ends the attempt).
    """

    attempt: int
    at: list[float] = Field(default_factory=list, description="When each loss was found (epoch seconds).")
    reasons: list[str] = Field(default_factory=list, description="One line each: what was found.")

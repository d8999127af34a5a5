"""Plain records exchanged through the run store.

Worker exit reports, checkpoint manifests, attempt records, incidents and the ledger.

These are the data contracts between the trainer, the step programs and the local runner; the
decisions made over them live elsewhere (``classify``, ``restore``, ``retry``).
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from recovery_steps.kernel.contract import Decision, FailureClass


class _Record(BaseModel):
    # Records are read back by newer code: unknown fields are kept, not rejected.
    model_config = ConfigDict(extra="allow")


def now() -> float:
    """Wall-clock seconds since the epoch: the one clock every record uses."""
    return time.time()


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
    peak_rss_mib: float | None = Field(default=None, description="Peak resident set size of the worker, MiB.")
    params_digest: str | None = Field(
        default=None, description="sha256 of the final parameters (exits 0 and 143): resumes compare it."
    )


class ManifestFile(_Record):
    """One file of a checkpoint, as the manifest records it."""

    path: str = Field(description="Path relative to the checkpoint step directory.")
    size: int
    crc32c: str = Field(description="CRC32C of the contents, hex.")


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
    dataset_version: str
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
    recovered_at: float | None = Field(default=None, description="Back at the pre-failure step.")
    pre_failure_step: int | None = None
    restored_step: int | None = None
    steps_lost: int | None = None

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
    outcome: str = Field(description="'succeeded' or 'failed'.")
    failure_class: FailureClass | None = None
    reason: str = ""
    evidence: list[str] = Field(default_factory=list, description="Evidence lines the verdict used.")
    decision: Decision | None = None
    backoff_seconds: float = 0
    checkpoint_step_before: int | None = None
    checkpoint_step_after: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    closed_at: float | None = Field(default=None, description="When the attempt was closed in the ledger.")


class Ledger(_Record):
    """``ledger.json``: every closed attempt of the run, updated with generation preconditions."""

    run_id: str
    attempts: list[AttemptRecord] = Field(default_factory=list)
    final_status: str | None = Field(default=None, description="'Succeeded' or 'Failed' once the run ended.")
    final_reason: str | None = None

    def by_class(self) -> dict[str, int]:
        """Failed attempts so far, by class (every class present, zero included)."""
        counts = {c.value: 0 for c in FailureClass}
        for a in self.attempts:
            if a.failure_class is not None:
                counts[a.failure_class.value] += 1
        return counts

    def closed_attempts(self) -> set[int]:
        """Numbers of the attempts already closed (a checkpoint they write later is not trusted)."""
        return {a.attempt for a in self.attempts if a.closed_at is not None}

"""The restore decision: verify the checkpoints, quarantine the bad ones, record which step an attempt restores.

The ``restore-latest`` step runs it before every attempt; the trainer runs it again when its workers find a step
damaged while restoring it (``trainer.checkpointing``).

Destructive acts and their evidence: it deletes nothing. A step directory moves to ``quarantine/`` (with a file
saying why) only on positive evidence against it, read after every candidate was inspected (``verify.judge``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from jaxrec.adapters.documents import read_run_config
from jaxrec.adapters.store import DocumentError, RunLayout, RunStore
from jaxrec.adapters.verify import (
    Selection,
    Skip,
    StoreLayoutError,
    check_layout,
    closed_attempts,
    verify_checkpoints,
)
from jaxrec.model.config import ConfigError
from jaxrec.model.contract import ExitCode
from jaxrec.model.records import QuarantineReason, RestoreRecord, SkippedStep, now

log = logging.getLogger(__name__)


@dataclass
class RestoreResult:
    """What ``run`` decided and wrote."""

    code: ExitCode
    selection: Selection | None
    restore_path: str
    quarantined: list[str]
    message: str = ""


def _refused(message: str) -> RestoreResult:
    """A decision not to go on: the run's config or store is not usable as it is (exit 2), nothing written."""
    return RestoreResult(ExitCode.CONFIGURATION, None, "", [], message)


def _quarantine_targets(store: RunStore, name: str, attempt: int):
    """Candidate quarantine names for ``name``: ``<name>``, then ``<name>.attempt<n>.<k>``, free when listed."""
    existing = set(store.children(RunLayout.QUARANTINE))
    if name not in existing:
        yield f"{RunLayout.QUARANTINE}/{name}"
    for k in range(1, 1000):
        if f"{name}.attempt{attempt}.{k}" not in existing:
            yield f"{RunLayout.QUARANTINE}/{name}.attempt{attempt}.{k}"


CONCURRENT_MOVE_WAIT_S = 5.0
"""How long a mover that lost a quarantine name to a concurrent mover waits for that mover to take the step."""


def _being_moved_into(store: RunStore, name: str) -> bool:
    """``quarantine/<name>`` is there and holds nothing: a concurrent mover's name, the step not yet renamed in."""
    return name in store.children(RunLayout.QUARANTINE) and not store.list(f"{RunLayout.QUARANTINE}/{name}")


def _taken_by_another(store: RunStore, src: str) -> bool:
    """Whether the concurrent mover that took a name free when listed has moved step directory ``src`` there.

    A concurrent restore-latest quarantining the same step creates the name, then renames the step into it. True
    once the step is gone; False when it stays past ``CONCURRENT_MOVE_WAIT_S`` (the other died between its two
    calls: this mover takes the next name).
    """
    deadline = time.monotonic() + CONCURRENT_MOVE_WAIT_S
    while store.exists(src):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def quarantine(store: RunStore, skip: Skip, attempt: int) -> str | None:
    """Move one step directory to ``quarantine/`` (never deleted) and write its reason file.

    Safe to run twice at once: locally the move is one rename onto a name created exclusively, so two
    movers never share a target and the loser moves nothing; on GCS the copy-then-delete skips objects
    a concurrent mover took. A mover that moved nothing writes no reason file (no empty entries).

    Returns:
        The quarantine path, or None when the directory was already gone (another mover took it).
    """
    src = f"{RunLayout.CHECKPOINTS}/{skip.name}"
    if _being_moved_into(store, skip.name) and _taken_by_another(store, src):
        return None
    for target in _quarantine_targets(store, skip.name, attempt):
        try:
            moved = store.move(src, target)
        except FileExistsError:
            # Taken between listing and moving, by a concurrent mover of this step: it has the name the step
            # belongs under, and moves it there. Racing it for the step under the next name would leave the step
            # under a suffixed name with its own name free.
            if _taken_by_another(store, src):
                return None
            continue
        break
    else:
        raise StoreLayoutError(f"{store.url(RunLayout.QUARANTINE)}: no free name for {skip.name!r}")
    if moved == 0:
        return None
    reason = QuarantineReason(
        step=skip.step,
        from_=store.url(src),
        kind=skip.kind.value,
        reason=skip.reason,
        attempt=attempt,
        objects=moved,
        moved_at=now(),
    )
    store.write_record(RunLayout.quarantine_reason(target), reason)
    return target


def run(store: RunStore, attempt: int) -> RestoreResult:
    """Verify the run's checkpoints, quarantine bad ones, and record which step attempt ``attempt`` (next) restores.

    Returns:
        The decision; ``code`` is 0 (restore or fresh start), 2 (the run's config is missing or
        unreadable) or 3 (checkpoints exist but none is compatible with the config: nothing is moved).
    """
    try:
        cfg = read_run_config(store)
        closed = closed_attempts(store)
    except ConfigError as e:
        return _refused(e.render())
    except DocumentError as e:
        return _refused(str(e))

    try:
        sel, inspected = verify_checkpoints(store, cfg.model_dump(mode="json"), cfg.slice.num_hosts, closed)
        for c in inspected:
            if c.file_basis is not None:
                log.info("%s: files checked by %s", c.name, c.file_basis)
        if any(s.quarantine for s in sel.skipped) and not sel.incompatible:
            check_layout(store, RunLayout.QUARANTINE)
    except StoreLayoutError as e:
        return _refused(f"{e} (nothing was moved)")
    if sel.renamed is not None:
        name, step = sel.renamed
        now_at = f"step {sel.step}" if sel.step >= 0 else "a fresh start"
        return _refused(
            f"{store.url(RunLayout.CHECKPOINTS)}/{name} holds an intact checkpoint of step {step} under a name orbax "
            f"does not read (restoring would mean {now_at}); rename it to {store.url(RunLayout.checkpoint(step))} "
            f"(moving aside what is there) and rerun (nothing was moved)"
        )
    if sel.incompatible:
        lines = [f"checkpoints exist for run {store.run_id!r} but none is compatible with its config:"]
        lines += [f"  step {s.step}: {s.reason}" for s in sel.skipped]
        lines.append("restore the previous config, or start a new run id (nothing was moved)")
        result = RestoreResult(ExitCode.INCOMPATIBLE_CHECKPOINT, sel, "", [], "\n".join(lines))
    else:
        moved = [t for s in sel.skipped if s.quarantine and (t := quarantine(store, s, attempt)) is not None]
        # The directory that was verified (only canonical names are selected, so it is also the
        # path the trainer's orbax CheckpointManager builds for the step).
        path = store.url(f"{RunLayout.CHECKPOINTS}/{sel.name}") if sel.step >= 0 else ""
        result = RestoreResult(ExitCode.OK, sel, path, moved)
    write_restore_record(store, _record(store, attempt, cfg.config_hash(), result))
    return result


def write_restore_record(store: RunStore, record: RestoreRecord, *, tries: int = 20) -> RestoreRecord:
    """Write attempt ``record.attempt``'s decision, keeping every quarantine an earlier or concurrent run recorded.

    Two restore-latest runs of one attempt (a retried pod beside a slow one) each move what they found; the last
    writer must not drop the other's moves. Read-merge-write under a generation precondition, retried on a lost
    race.

    Returns:
        The record as written.
    """
    path = RunLayout.restore_record(record.attempt)

    def merge(current: RestoreRecord | None) -> RestoreRecord:
        if current is None or current.attempt != record.attempt:
            return record
        names = {s.name for s in record.skipped}
        return record.model_copy(
            update={
                "quarantined": sorted({*current.quarantined, *record.quarantined}),
                "skipped": [*record.skipped, *(s for s in current.skipped if s.name not in names)],
            }
        )

    try:
        return store.update_record(path, RestoreRecord, merge, tries=tries)
    except DocumentError as e:  # a damaged earlier record holds nothing to keep: this decision replaces it
        log.warning("%s; replaced by this decision", e)
        store.write_record(path, record)
        return record


def _record(store: RunStore, attempt: int, config_hash: str, r: RestoreResult) -> RestoreRecord:
    assert r.selection is not None
    return RestoreRecord(
        attempt=attempt,
        run_id=store.run_id,
        config_hash=config_hash,
        exit_code=int(r.code),
        restore_step=r.selection.step,
        restore_path=r.restore_path,
        skipped=[
            SkippedStep(step=s.step, name=s.name, reason=s.reason, kind=s.kind.value, quarantined=s.quarantine)
            for s in r.selection.skipped
        ],
        quarantined=r.quarantined,
        decided_at=now(),
    )

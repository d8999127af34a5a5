"""``restore-latest``: choose the newest verified checkpoint, quarantine bad ones, and say which step to restore.

Usage: ``python -m recovery_steps.restore_latest --store-root R --run-id ID --attempt N --output-dir D``.
Outputs: ``restore-step`` (-1 for a fresh start), ``restore-path`` and ``skipped`` (JSON list of
``{step, name, reason}``); the decision is also recorded in ``attempts/<n>/restore.json``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from recovery_steps.kernel.config import ConfigError
from recovery_steps.kernel.contract import ExitCode
from recovery_steps.kernel.documents import read_run_config
from recovery_steps.kernel.outputs import RestoreOutputs
from recovery_steps.kernel.records import QuarantineReason, RestoreRecord, SkippedStep, now
from recovery_steps.kernel.store import DocumentError, RunLayout, RunStore
from recovery_steps.verify import Selection, Skip, closed_attempts, verify_checkpoints

log = logging.getLogger(__name__)


@dataclass
class RestoreResult:
    """What ``run`` decided and wrote."""

    code: ExitCode
    selection: Selection | None
    restore_path: str
    quarantined: list[str]
    message: str = ""


def _quarantine_target(store: RunStore, name: str, attempt: int) -> str:
    target = f"{RunLayout.QUARANTINE}/{name}"
    existing = set(store.children(RunLayout.QUARANTINE))
    if name not in existing:
        return target
    n = 1
    while f"{name}.attempt{attempt}.{n}" in existing:
        n += 1
    return f"{target}.attempt{attempt}.{n}"


def quarantine(store: RunStore, skip: Skip, attempt: int) -> str:
    """Move one step directory to ``quarantine/`` (never deleted) and write its reason file; return the target."""
    target = _quarantine_target(store, skip.name, attempt)
    src = f"{RunLayout.CHECKPOINTS}/{skip.name}"
    moved = store.move(src, target)
    reason = QuarantineReason(
        step=skip.step, from_=store.url(src), kind=skip.kind.value, reason=skip.reason, attempt=attempt,
        objects=moved, moved_at=now(),
    )  # fmt: skip
    store.write_record(RunLayout.quarantine_reason(target), reason)
    return target


def run(store: RunStore, attempt: int) -> RestoreResult:
    """Verify the run's checkpoints, quarantine bad ones, and record which step attempt ``attempt`` restores.

    Args:
        store: The run store of the run.
        attempt: The attempt about to start.

    Returns:
        The decision; ``code`` is 0 (restore or fresh start), 2 (the run's config is missing or
        unreadable) or 3 (checkpoints exist but none is compatible with the config: nothing is moved).
    """
    try:
        cfg = read_run_config(store)
        closed = closed_attempts(store)
    except ConfigError as e:
        return RestoreResult(ExitCode.CONFIGURATION, None, "", [], e.render())
    except DocumentError as e:
        return RestoreResult(ExitCode.CONFIGURATION, None, "", [], str(e))

    sel, _ = verify_checkpoints(store, cfg.model_dump(mode="json"), cfg.slice.num_hosts, closed)
    if sel.incompatible:
        lines = [f"checkpoints exist for run {store.run_id!r} but none is compatible with its config:"]
        lines += [f"  step {s.step}: {s.reason}" for s in sel.skipped]
        lines.append("restore the previous config, or start a new run id (nothing was moved)")
        result = RestoreResult(ExitCode.INCOMPATIBLE_CHECKPOINT, sel, "", [], "\n".join(lines))
    else:
        moved = [quarantine(store, s, attempt) for s in sel.skipped if s.quarantine]
        path = store.url(RunLayout.checkpoint(sel.step)) if sel.step >= 0 else ""
        result = RestoreResult(ExitCode.OK, sel, path, moved)
    store.write_record(RunLayout.restore_record(attempt), _record(store, attempt, cfg.config_hash(), result))
    return result


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


def outputs(r: RestoreResult) -> RestoreOutputs:
    """The step's output parameters."""
    sel = r.selection or Selection()
    return RestoreOutputs(
        restore_step=sel.step, restore_path=r.restore_path, skipped=[s.as_output() for s in sel.skipped]
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m recovery_steps.restore_latest``."""
    p = argparse.ArgumentParser(prog="python -m recovery_steps.restore_latest", description=__doc__.splitlines()[0])
    p.add_argument("--store-root", required=True, help="gs://bucket/prefix or a local directory")
    p.add_argument("--run-id", required=True)
    p.add_argument("--attempt", required=True, type=int, help="the attempt about to start")
    p.add_argument("--output-dir", required=True, type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s restore-latest %(message)s")
    r = run(RunStore(args.store_root, args.run_id), args.attempt)
    outputs(r).write(args.output_dir)
    if r.message:
        print(r.message, file=sys.stderr)
    if r.selection is not None:
        for s in r.selection.skipped:
            log.info("skipped %s: %s%s", s.name, s.reason, " (quarantined)" if s.quarantine and r.code == 0 else "")
        log.info("restore step %d %s", r.selection.step, r.restore_path or "(fresh start)")
    return int(r.code)


if __name__ == "__main__":
    sys.exit(main())

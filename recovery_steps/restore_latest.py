"""``restore-latest``: choose the newest verified checkpoint, quarantine bad ones, and say which step to restore.

Usage: ``python -m recovery_steps.restore_latest --store-root R --run-id ID --attempt N --output-dir D``.
Outputs: ``restore-step`` (-1 for a fresh start), ``restore-path`` and ``skipped`` (JSON list of
``{step, name, reason}``); the decision is also recorded in ``attempts/<n>/restore.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from recovery_steps.kernel.config import ConfigError, config_from_json
from recovery_steps.kernel.contract import ExitCode
from recovery_steps.kernel.records import now
from recovery_steps.kernel.store import RunLayout, RunStore
from recovery_steps.verify import Selection, Skip, closed_attempts, verify_checkpoints

log = logging.getLogger(__name__)

REASON_FILE = "QUARANTINE_REASON.json"
"""Written into every quarantined directory: why it was moved, from where, by which attempt."""


def restore_record_path(attempt: int) -> str:
    """Where the decision of attempt ``attempt`` is recorded."""
    return f"{RunLayout.attempt(attempt)}/restore.json"


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
    store.write_json(
        f"{target}/{REASON_FILE}",
        {
            "step": skip.step,
            "from": store.url(src),
            "kind": skip.kind.value,
            "reason": skip.reason,
            "attempt": attempt,
            "objects": moved,
            "moved_at": now(),
        },
    )
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
    raw = store.read_bytes(RunLayout.CONFIG)
    if raw is None:
        msg = f"{store.url(RunLayout.CONFIG)}: no config for run {store.run_id!r}; run validate-config first"
        return RestoreResult(ExitCode.CONFIGURATION, None, "", [], msg)
    try:
        cfg = config_from_json(raw.decode(), store.url(RunLayout.CONFIG))
    except ConfigError as e:
        return RestoreResult(ExitCode.CONFIGURATION, None, "", [], e.render())
    except ValueError as e:
        return RestoreResult(ExitCode.CONFIGURATION, None, "", [], f"{store.url(RunLayout.CONFIG)}: not JSON ({e})")
    try:
        closed = closed_attempts(store)
    except (ValidationError, ValueError) as e:
        msg = f"{store.url(RunLayout.LEDGER)}: unreadable ledger ({str(e).splitlines()[0]})"
        return RestoreResult(ExitCode.CONFIGURATION, None, "", [], msg)

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
    store.write_json(restore_record_path(attempt), _record(store, attempt, cfg.config_hash(), result))
    return result


def _record(store: RunStore, attempt: int, config_hash: str, r: RestoreResult) -> dict[str, Any]:
    assert r.selection is not None
    return {
        "attempt": attempt,
        "run_id": store.run_id,
        "config_hash": config_hash,
        "exit_code": int(r.code),
        "restore_step": r.selection.step,
        "restore_path": r.restore_path,
        "skipped": [{**s.as_output(), "kind": s.kind.value, "quarantined": s.quarantine} for s in r.selection.skipped],
        "quarantined": r.quarantined,
        "decided_at": now(),
    }


def write_outputs(output_dir: Path, r: RestoreResult) -> None:
    """One file per output parameter."""
    output_dir.mkdir(parents=True, exist_ok=True)
    sel = r.selection or Selection()
    (output_dir / "restore-step").write_text(str(sel.step))
    (output_dir / "restore-path").write_text(r.restore_path)
    (output_dir / "skipped").write_text(json.dumps([s.as_output() for s in sel.skipped]))


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
    write_outputs(args.output_dir, r)
    if r.message:
        print(r.message, file=sys.stderr)
    if r.selection is not None:
        for s in r.selection.skipped:
            log.info("skipped %s: %s%s", s.name, s.reason, " (quarantined)" if s.quarantine and r.code == 0 else "")
        log.info("restore step %d %s", r.selection.step, r.restore_path or "(fresh start)")
    return int(r.code)


if __name__ == "__main__":
    sys.exit(main())

"""What the run store says about an attempt's checkpoints: the step it restored and the newest one committed.

classify-failure records both in the attempt's ledger entry; finalize reads them for a run that ends while an
attempt is still open.
"""

from __future__ import annotations

from jaxrec.adapters.checkpoints import newest_complete_step
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.records import Ledger, RestoreRecord, SupervisionRecord


def checkpoint_step_before(store: RunStore, attempt: int) -> int:
    """The step attempt ``attempt`` restored (its ``RestoreRecord``), or -1 (fresh start, or never decided)."""
    rec = store.read_record(RunLayout.restore_record(attempt), RestoreRecord)
    return rec.restore_step if rec is not None else -1


def newest_checkpoint_step(store: RunStore) -> int:
    """The newest checkpoint step that has a manifest (a complete checkpoint), or -1."""
    newest = newest_complete_step(store)
    return -1 if newest is None else newest


def left_open(store: RunStore, attempt: int) -> bool:
    """Whether ``attempt`` is neither decided by a supervisor nor closed in the ledger.

    A gang of such an attempt that still runs is healthy work nothing watches (its Workflow or supervisor was lost).
    """
    sup = store.read_record(RunLayout.supervision(attempt), SupervisionRecord)
    if sup is not None and sup.decided:
        return False
    ledger = store.read_record(RunLayout.LEDGER, Ledger)
    return not (ledger is not None and any(a.attempt == attempt for a in ledger.attempts))

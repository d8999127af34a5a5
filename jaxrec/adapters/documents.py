"""Readers every part shares for the run's documents: the pinned config, worker exit reports, the ledger."""

from __future__ import annotations

from jaxrec.adapters.store import DocumentError, R, RunLayout, RunStore
from jaxrec.model.config import JobConfig, parse_config
from jaxrec.model.records import Ledger, RunConfigDocument, WorkerExitReport


def read_run_config(store: RunStore) -> JobConfig:
    """The config validate-config pinned for the run.

    Raises:
        DocumentError: ``config.json`` is missing, unreadable or not a config document.
        ConfigError: The stored tree is not a valid config (one message per problem).
    """
    url = store.url(RunLayout.CONFIG)
    doc = store.read_record(RunLayout.CONFIG, RunConfigDocument)
    if doc is None:
        raise DocumentError(url, f"no config for run {store.run_id!r}; run validate-config first")
    return parse_config(doc.config, url)


def read_records(store: RunStore, folder: str, model: type[R]) -> tuple[list[R], list[str]]:
    """Every ``.json`` record directly under ``folder``, and one line per unreadable one (which hides no other)."""
    records, problems = [], []
    for name in store.children(folder):
        if not name.endswith(".json"):
            continue
        try:
            rec = store.read_record(f"{folder}/{name}", model)
        except DocumentError as e:
            problems.append(str(e))
            continue
        if rec is not None:
            records.append(rec)
    return records, problems


def read_worker_reports(store: RunStore, attempt: int) -> tuple[list[WorkerExitReport], list[str]]:
    """Every worker exit report of ``attempt``, by process index, and one line per unreadable one.

    A damaged report does not hide the others: the classifier and the totals use what can be read.
    """
    reports, problems = read_records(store, RunLayout.worker_reports(attempt), WorkerExitReport)
    return sorted(reports, key=lambda r: r.process_index), problems


def read_ledger(store: RunStore) -> Ledger | None:
    """The run's ledger, or None before the first attempt closed (DocumentError when damaged)."""
    return store.read_record(RunLayout.LEDGER, Ledger)

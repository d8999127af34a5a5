"""Every metric name the project exports, in one table.

Prometheus conventions: base units, ``_seconds``, ``_total``; labels ``run_id``, ``attempt``,
``process_index``, ``class``.

The trainer serves the per-worker metrics with prometheus-client; the per-run ones are Argo
template metrics (Argo prefixes custom metrics with ``argo_workflows_``) and, locally, are served by
``workflows.local``. Alert rules and the dashboard refer to these names only through this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricSpec:
    """One metric: name, type, help text, labels, and who exports it."""

    name: str
    kind: str  # "gauge" | "counter"
    help: str
    labels: tuple[str, ...]
    scope: str  # "worker" (trainer) | "run" (Argo template metric / local runner)


WORKER = ("run_id", "attempt", "process_index")
RUN = ("run_id",)

# fmt: skip below: one metric a row (name, kind, help, labels, scope) reads as the table it is; the formatter
# would spread each row over six lines.
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("jaxrec_train_step", "gauge", "Last training step completed by this worker.", WORKER, "worker"),
    MetricSpec("jaxrec_train_steps_per_second", "gauge", "Steps per second over the recent window.", WORKER,
               "worker"),
    MetricSpec("jaxrec_train_loss", "gauge", "Loss of the last step.", WORKER, "worker"),
    MetricSpec("jaxrec_last_step_timestamp_seconds", "gauge", "Unix time the last step completed.", WORKER,
               "worker"),
    MetricSpec("jaxrec_checkpoint_step", "gauge", "Step of the newest committed checkpoint.", WORKER, "worker"),
    MetricSpec("jaxrec_local_checkpoint_step", "gauge",
               "Step of the newest part this host saved to its own local disk (local tier).", WORKER, "worker"),
    MetricSpec("jaxrec_peer_checkpoint_step", "gauge",
               "Step of the newest peer's part this host copied to its local disk (peer tier).", WORKER, "worker"),
    MetricSpec("jaxrec_checkpoint_age_seconds", "gauge",
               "Seconds since the newest checkpoint committed (since start when none yet).", WORKER, "worker"),
    MetricSpec("jaxrec_checkpoint_last_commit_timestamp_seconds", "gauge",
               "Unix time the newest checkpoint committed.", WORKER, "worker"),
    MetricSpec("jaxrec_checkpoint_duration_seconds", "gauge",
               "Duration of the last checkpoint save, from start to commit.", WORKER, "worker"),
    MetricSpec("jaxrec_compile_seconds", "gauge", "Seconds to compile and run the first step.", WORKER,
               "worker"),
    MetricSpec("jaxrec_worker_up", "gauge", "1 while this worker is training (sum: active workers).", WORKER,
               "worker"),
    MetricSpec("jaxrec_expected_workers", "gauge", "Hosts the slice should have.", WORKER, "worker"),
    MetricSpec("jaxrec_run_lease_renewed_timestamp_seconds", "gauge",
               "Unix time the run lease was last renewed (its supervisor's renewals), as worker 0 last read it.",
               WORKER, "worker"),
    MetricSpec("jaxrec_attempts_total", "counter", "Attempts started for the run (restart count + 1).", RUN,
               "run"),
    MetricSpec("jaxrec_failures_total", "counter", "Failed attempts by failure class.", (*RUN, "class"), "run"),
    MetricSpec("jaxrec_last_failure_info", "gauge", "1 for the class and reason of the last failure.",
               (*RUN, "class", "reason"), "run"),
    MetricSpec("jaxrec_budget_exhausted", "gauge", "1 when the run stopped because a budget was spent.",
               (*RUN, "class"), "run"),
    MetricSpec("jaxrec_recovery_duration_seconds", "gauge",
               "Failure to back-at-the-pre-failure-step, for the last incident.", RUN, "run"),
    MetricSpec("jaxrec_steps_lost_total", "counter", "Steps recomputed because of failures.", RUN, "run"),
    MetricSpec("jaxrec_run_status", "gauge", "1 for the run's current status (Running, Succeeded, Failed).",
               (*RUN, "status"), "run"),
)  # fmt: skip

BY_NAME = {m.name: m for m in METRICS}

# Argo Workflows exposes every custom (template or workflow) metric with this prefix; the
# run-scope metrics above are therefore scraped on GKE as ``argo_workflows_<name>``.
ARGO_PREFIX = "argo_workflows_"


def spec(name: str) -> MetricSpec:
    """The spec of ``name`` (KeyError for a name outside the table)."""
    return BY_NAME[name]


def exposed_name(name: str, *, argo: bool) -> str:
    """The name a scrape sees for ``name``: ``argo_workflows_<name>`` for a run-scope metric served by Argo.

    ``argo``: run-scope metrics come from Argo template metrics (GKE), not from the local runner.
    """
    m = spec(name)
    return ARGO_PREFIX + m.name if argo and m.scope == "run" else m.name

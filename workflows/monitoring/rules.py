"""Alert rules of one job, in the Prometheus rule format, over the metric table's names."""

from __future__ import annotations

from dataclasses import dataclass

from jaxrec.model.config import JobConfig
from jaxrec.model.metrics import exposed_name

RUNBOOK = "docs/RUNBOOK.md"


def gke_name(name: str) -> str:
    """The scraped name of a table metric on GKE (run-scope ones carry Argo's prefix)."""
    return exposed_name(name, argo=True)


@dataclass(frozen=True)
class AlertRule:
    """One alerting rule, in the Prometheus rule format."""

    alert: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    runbook: str

    def as_dict(self) -> dict[str, object]:
        """The rule as Prometheus (and the GMP ``Rules`` CRD) spell it."""
        rule: dict[str, object] = {"alert": self.alert, "expr": self.expr}
        if self.for_ != "0s":
            rule["for"] = self.for_
        rule["labels"] = {"severity": self.severity}
        rule["annotations"] = {
            "summary": self.summary,
            "description": self.description,
            "runbook": f"{RUNBOOK}#{self.runbook}",
        }
        return rule


def worker_alerts(cfg: JobConfig) -> list[AlertRule]:
    """Alerts over the per-worker metrics (they live in the job's namespace).

    Args:
        cfg: The job config; thresholds come from ``cfg.monitoring``.

    Returns:
        The checkpoint-lag, no-step and missing-workers alerts of this run.
    """
    m = cfg.monitoring
    sel = f'{{run_id="{cfg.run_id}"}}'
    no_step_s = m.no_step_alert_minutes * 60
    return [
        AlertRule(
            alert="JaxrecCheckpointLag",
            expr=(
                f"max by (run_id) ({gke_name('jaxrec_train_step')}{sel})"
                f" - max by (run_id) ({gke_name('jaxrec_checkpoint_step')}{sel})"
                f" > {m.recovery_window_steps}"
            ),
            for_="5m",
            severity="warning",
            summary="Newest checkpoint of {{ $labels.run_id }} is behind the accepted recovery window",
            description=(
                "Training is {{ $value }} steps past the newest committed checkpoint (window: "
                f"{m.recovery_window_steps} steps); a failure now would lose that work. Check checkpoint "
                "saves and the store."
            ),
            runbook="infrastructure",
        ),
        AlertRule(
            alert="JaxrecNoStep",
            expr=(
                f"time() - max by (run_id) ({gke_name('jaxrec_last_step_timestamp_seconds')}{sel}) > {no_step_s}"
                f" and on (run_id) sum by (run_id) ({gke_name('jaxrec_worker_up')}{sel}) > 0"
            ),
            for_="1m",
            severity="critical",
            summary=f"No training step of {{{{ $labels.run_id }}}} for {m.no_step_alert_minutes} minutes",
            description=(
                "Workers are up but the last step completed {{ $value | humanizeDuration }} ago "
                f"(limit: {m.no_step_alert_minutes} minutes). The step watchdog should end the attempt "
                "with the hang code; if it does not, the gang is stuck."
            ),
            runbook="hang",
        ),
        AlertRule(
            alert="JaxrecWorkersBelowExpected",
            expr=(
                f"sum by (run_id) ({gke_name('jaxrec_worker_up')}{sel})"
                f" < max by (run_id) ({gke_name('jaxrec_expected_workers')}{sel})"
            ),
            for_="5m",
            severity="warning",
            summary="{{ $labels.run_id }} has fewer active workers than the slice has hosts",
            description=(
                "Only {{ $value }} workers report up for 5 minutes. A lost host should end the attempt "
                "within seconds; a lasting gap means the gang is not failing fast or a host never came up."
            ),
            runbook="infrastructure",
        ),
        _unsupervised_alert(cfg),
        *_local_tier_alerts(cfg),
    ]


def _unsupervised_alert(cfg: JobConfig) -> AlertRule:
    """A gang that trains while its run lease goes unrenewed: nothing supervises it.

    Its train-segment's pod is gone while the Workflow still shows the step Running, or the Workflow went without
    its exit handler.
    """
    sel = f'{{run_id="{cfg.run_id}"}}'
    every = cfg.retry.lease_renew_every_s
    limit = int(2 * every)
    return AlertRule(
        alert="JaxrecRunUnsupervised",
        expr=(
            # A worker exports 0 until it has read the lease once: only a reading counts.
            f"time() - max by (run_id) ({gke_name('jaxrec_run_lease_renewed_timestamp_seconds')}{sel} > 0)"
            f" > {limit} and on (run_id) sum by (run_id) ({gke_name('jaxrec_worker_up')}{sel}) > 0"
        ),
        for_="1m",
        severity="critical",
        summary="{{ $labels.run_id }} trains with nothing supervising it",
        description=(
            "Workers are up but the run lease was last renewed {{ $value | humanizeDuration }} ago; its supervisor "
            f"renews it every {every:g} s while a segment runs (limit: twice that). A failure of this gang now "
            "ends no attempt and starts no recovery."
        ),
        runbook="unsupervised",
    )


def _local_tier_alerts(cfg: JobConfig) -> list[AlertRule]:
    """With the local tiers: the GCS backup falling behind the hosts' newest local parts."""
    if not cfg.checkpoint.local.enabled:
        return []
    sel = f'{{run_id="{cfg.run_id}"}}'
    limit = 2 * cfg.checkpoint.interval_steps
    return [
        AlertRule(
            alert="JaxrecGcsBackupLag",
            expr=(
                f"max by (run_id) ({gke_name('jaxrec_local_checkpoint_step')}{sel})"
                f" - max by (run_id) ({gke_name('jaxrec_checkpoint_step')}{sel})"
                f" > {limit}"
            ),
            for_="10m",
            severity="warning",
            summary="The GCS checkpoints of {{ $labels.run_id }} lag behind the hosts' local ones",
            description=(
                "The newest local part is {{ $value }} steps past the newest GCS checkpoint (limit: two GCS "
                f"intervals, {limit} steps). Losing the slice now loses that work: the local tiers die with it. "
                "Check GCS saves and the store."
            ),
            runbook="infrastructure",
        )
    ]


def run_alerts(cfg: JobConfig) -> list[AlertRule]:
    """Alerts over the per-run Argo template metrics (scraped from the Argo controller's namespace).

    Args:
        cfg: The job config; thresholds come from ``cfg.monitoring``.

    Returns:
        The repeated-failures, budget-exhausted and run-failed alerts of this run.
    """
    m = cfg.monitoring
    rid = cfg.run_id
    fail = f'{gke_name("jaxrec_failures_total")}{{run_id="{rid}"}}'
    return [
        AlertRule(
            alert="JaxrecRepeatedFailures",
            expr=(
                # A series born within the hour counts whole (Argo creates the counter at 1, which
                # increase() cannot see); an older one counts its increase over the hour.
                f"sum by (run_id, class) (({fail} unless {fail} offset 1h) or increase({fail}[1h]))"
                f" >= {m.repeated_failures_threshold}"
            ),
            for_="0s",
            severity="warning",
            summary="{{ $labels.run_id }}: repeated {{ $labels.class }} failures",
            description=(
                "{{ $value }} attempts failed with class {{ $labels.class }} within the last hour "
                f"(threshold: {m.repeated_failures_threshold}). The run still retries while its budget lasts."
            ),
            runbook="{{ $labels.class }}",
        ),
        AlertRule(
            alert="JaxrecBudgetExhausted",
            expr=f'max by (run_id, class) ({gke_name("jaxrec_budget_exhausted")}{{run_id="{rid}"}}) == 1',
            for_="0s",
            severity="critical",
            summary="{{ $labels.run_id }} stopped: {{ $labels.class }} retry budget spent",
            description=(
                "The run ended Failed because failures of class {{ $labels.class }} used up its retry "
                "budget. It will not restart by itself."
            ),
            runbook="{{ $labels.class }}",
        ),
        AlertRule(
            alert="JaxrecRunFailed",
            expr=(
                f'max by (run_id) ({gke_name("jaxrec_run_status")}{{run_id="{rid}", status=~"Failed|Error"}}) == 1'
                f' unless on (run_id) ({gke_name("jaxrec_budget_exhausted")}{{run_id="{rid}"}} == 1)'
            ),
            for_="0s",
            severity="critical",
            summary="{{ $labels.run_id }} ended Failed",
            description=(
                "The run ended Failed without a spent class budget: the no-progress guard or the "
                "attempt cap stopped it. See the ledger and the last attempt record."
            ),
            runbook="no-progress",
        ),
    ]


def rule_interval(cfg: JobConfig) -> str:
    """Evaluation interval of the rules: the scrape interval."""
    return f"{cfg.monitoring.scrape_interval_s}s"


def _group(name: str, interval: str, rules: list[AlertRule]) -> dict[str, object]:
    return {"name": name, "interval": interval, "rules": [r.as_dict() for r in rules]}


def rule_groups(cfg: JobConfig) -> tuple[dict[str, object], dict[str, object]]:
    """The two rule groups of a run: worker-metric alerts, then run-metric alerts."""
    iv = rule_interval(cfg)
    return (
        _group(f"jaxrec-{cfg.run_id}-workers", iv, worker_alerts(cfg)),
        _group(f"jaxrec-{cfg.run_id}-run", iv, run_alerts(cfg)),
    )


def prometheus_rules(cfg: JobConfig) -> dict[str, object]:
    """The same alerts as a plain Prometheus rules file (``promtool check rules`` accepts it)."""
    return {"groups": list(rule_groups(cfg))}

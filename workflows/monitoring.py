"""GKE monitoring for one job: PodMonitoring, alert rules, a Grafana dashboard, and the rules' promtool tests.

Everything here is a pure function of the job config and the metric table
(``recovery_steps.metrics``): the same config always renders the same text.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from recovery_steps.config import ConfigError, JobConfig, load_config
from recovery_steps.k8s import RUN_ID_LABEL  # on every worker pod of a run; the PodMonitoring selects on it
from recovery_steps.metrics import METRICS, exposed_name

METRICS_PORT_NAME = "metrics"
"""Name of the worker container port that serves ``/metrics``."""

RUNBOOK = "docs/RUNBOOK.md"

MONITORING_API = "monitoring.googleapis.com/v1"

DOC_BEGIN = "<!-- metric-table:begin (generated from recovery_steps/metrics.py) -->"
DOC_END = "<!-- metric-table:end -->"


def _n(name: str) -> str:
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
                f"max by (run_id) ({_n('jaxrec_train_step')}{sel})"
                f" - max by (run_id) ({_n('jaxrec_checkpoint_step')}{sel})"
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
                f"time() - max by (run_id) ({_n('jaxrec_last_step_timestamp_seconds')}{sel}) > {no_step_s}"
                f" and on (run_id) sum by (run_id) ({_n('jaxrec_worker_up')}{sel}) > 0"
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
                f"sum by (run_id) ({_n('jaxrec_worker_up')}{sel})"
                f" < max by (run_id) ({_n('jaxrec_expected_workers')}{sel})"
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
    fail = f'{_n("jaxrec_failures_total")}{{run_id="{rid}"}}'
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
            expr=f'max by (run_id, class) ({_n("jaxrec_budget_exhausted")}{{run_id="{rid}"}}) == 1',
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
                f'max by (run_id) ({_n("jaxrec_run_status")}{{run_id="{rid}", status=~"Failed|Error"}}) == 1'
                f' unless on (run_id) ({_n("jaxrec_budget_exhausted")}{{run_id="{rid}"}} == 1)'
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


def _interval(cfg: JobConfig) -> str:
    return f"{cfg.monitoring.scrape_interval_s}s"


def _group(name: str, interval: str, rules: list[AlertRule]) -> dict[str, object]:
    return {"name": name, "interval": interval, "rules": [r.as_dict() for r in rules]}


def rule_groups(cfg: JobConfig) -> tuple[dict[str, object], dict[str, object]]:
    """The two rule groups of a run: worker-metric alerts, then run-metric alerts."""
    iv = _interval(cfg)
    return (
        _group(f"jaxrec-{cfg.run_id}-workers", iv, worker_alerts(cfg)),
        _group(f"jaxrec-{cfg.run_id}-run", iv, run_alerts(cfg)),
    )


def _labels(cfg: JobConfig) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": "jax-slice-recovery", RUN_ID_LABEL: cfg.run_id}


def pod_monitoring(cfg: JobConfig) -> dict[str, object]:
    """PodMonitoring (Google Cloud Managed Service for Prometheus) scraping the run's workers."""
    return {
        "apiVersion": MONITORING_API,
        "kind": "PodMonitoring",
        "metadata": {"name": f"{cfg.run_id}-workers", "namespace": cfg.namespace, "labels": _labels(cfg)},
        "spec": {
            "selector": {"matchLabels": {RUN_ID_LABEL: cfg.run_id}},
            "endpoints": [{"port": METRICS_PORT_NAME, "path": "/metrics", "interval": _interval(cfg)}],
        },
    }


def rules_resources(cfg: JobConfig) -> list[dict[str, object]]:
    """The alert rules as GMP resources.

    A namespaced ``Rules`` only sees metrics of its own namespace, so the worker alerts go in a
    ``Rules`` in the job's namespace and the alerts over Argo's metrics (exposed by the Argo
    controller, in its own namespace) go in a cluster-scoped ``ClusterRules``.
    """
    workers, run = rule_groups(cfg)
    return [
        {
            "apiVersion": MONITORING_API,
            "kind": "Rules",
            "metadata": {"name": f"{cfg.run_id}-alerts", "namespace": cfg.namespace, "labels": _labels(cfg)},
            "spec": {"groups": [workers]},
        },
        {
            "apiVersion": MONITORING_API,
            "kind": "ClusterRules",
            "metadata": {"name": f"{cfg.run_id}-run-alerts", "labels": _labels(cfg)},
            "spec": {"groups": [run]},
        },
    ]


def prometheus_rules(cfg: JobConfig) -> dict[str, object]:
    """The same alerts as a plain Prometheus rules file (``promtool check rules`` accepts it)."""
    return {"groups": list(rule_groups(cfg))}


def _dump(doc: object) -> str:
    return yaml.safe_dump(doc, sort_keys=False, width=1000, default_flow_style=False)


# ---- Grafana dashboard -----------------------------------------------------------------------

DASHBOARD_PANELS = (
    "Training step",
    "Checkpoint step",
    "Checkpoint age",
    "Checkpoint duration",
    "Active vs expected workers",
    "Job status",
    "Attempts (restart count + 1)",
    "Last failure class and reason",
    "Recovery duration",
    "Time since last successful step",
    "Steps lost",
)
"""Titles of the panels of each run row, in order."""


def _panel_queries() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """Panel title -> (panel type, [(legend, PromQL)]); ``$run_id`` is the row's run."""
    r = '{run_id="$run_id"}'
    return {
        "Training step": ("timeseries", [("step", f"max by (run_id) ({_n('jaxrec_train_step')}{r})")]),
        "Checkpoint step": (
            "timeseries",
            [("checkpoint step", f"max by (run_id) ({_n('jaxrec_checkpoint_step')}{r})")],
        ),
        "Checkpoint age": (
            "timeseries",
            [("age", f"max by (run_id) ({_n('jaxrec_checkpoint_age_seconds')}{r})")],
        ),
        "Checkpoint duration": (
            "timeseries",
            [("save to commit", f"max by (run_id) ({_n('jaxrec_checkpoint_duration_seconds')}{r})")],
        ),
        "Active vs expected workers": (
            "timeseries",
            [
                ("active", f"sum by (run_id) ({_n('jaxrec_worker_up')}{r})"),
                ("expected", f"max by (run_id) ({_n('jaxrec_expected_workers')}{r})"),
            ],
        ),
        "Job status": (
            "state-timeline",
            [("{{status}}", f"max by (run_id, status) ({_n('jaxrec_run_status')}{r}) == 1")],
        ),
        "Attempts (restart count + 1)": (
            "stat",
            [("attempts", f"max by (run_id) ({_n('jaxrec_attempts_total')}{r})")],
        ),
        "Last failure class and reason": (
            "table",
            [("{{class}}: {{reason}}", f"max by (run_id, class, reason) ({_n('jaxrec_last_failure_info')}{r}) == 1")],
        ),
        "Recovery duration": (
            "stat",
            [("failure to pre-failure step", f"max by (run_id) ({_n('jaxrec_recovery_duration_seconds')}{r})")],
        ),
        "Time since last successful step": (
            "stat",
            [("since last step", f"time() - max by (run_id) ({_n('jaxrec_last_step_timestamp_seconds')}{r})")],
        ),
        "Steps lost": ("stat", [("steps lost", f"max by (run_id) ({_n('jaxrec_steps_lost_total')}{r})")]),
    }


_UNITS = {
    "Checkpoint age": "s",
    "Checkpoint duration": "s",
    "Recovery duration": "s",
    "Time since last successful step": "s",
}


def dashboard(cfg: JobConfig) -> dict[str, object]:
    """A Grafana dashboard: one row per run (``run_id`` template variable, repeated rows).

    Args:
        cfg: The job config; its run id is the variable's default.

    Returns:
        The dashboard model, ready for Grafana's "Import dashboard".
    """
    queries = _panel_queries()
    assert tuple(queries) == DASHBOARD_PANELS
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels: list[dict[str, object]] = [
        {
            "type": "row",
            "id": 1,
            "title": "Run $run_id",
            "repeat": "run_id",
            "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": 0},
            "panels": [],
        }
    ]
    width, height = 6, 7
    for i, title in enumerate(DASHBOARD_PANELS):
        kind, targets = queries[title]
        panel: dict[str, object] = {
            "type": kind,
            "id": i + 2,
            "title": title,
            "datasource": ds,
            "gridPos": {"h": height, "w": width, "x": (i % 4) * width, "y": 1 + (i // 4) * height},
            "targets": [
                {"refId": chr(ord("A") + j), "datasource": ds, "expr": expr, "legendFormat": legend}
                for j, (legend, expr) in enumerate(targets)
            ],
            "fieldConfig": {"defaults": {"unit": _UNITS.get(title, "short")}, "overrides": []},
            "options": {},
        }
        if kind == "table":
            panel["targets"][0]["format"] = "table"  # type: ignore[index]
            panel["targets"][0]["instant"] = True  # type: ignore[index]
        panels.append(panel)
    return {
        "title": f"JAX slice recovery: {cfg.run_id}",
        "uid": f"jaxrec-{cfg.run_id}"[:40],
        "tags": ["jax-slice-recovery"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Data source",
                },
                {
                    "name": "run_id",
                    "label": "Run",
                    "type": "query",
                    "datasource": ds,
                    "query": {"query": f"label_values({_n('jaxrec_expected_workers')}, run_id)", "refId": "run_id"},
                    "definition": f"label_values({_n('jaxrec_expected_workers')}, run_id)",
                    "refresh": 2,
                    "multi": True,
                    "includeAll": True,
                    "current": {"selected": True, "text": [cfg.run_id], "value": [cfg.run_id]},
                    "sort": 1,
                },
            ]
        },
        "panels": panels,
    }


# ---- promtool tests of the rules -------------------------------------------------------------


def _humanize_seconds(s: int) -> str:
    """Prometheus' ``humanizeDuration`` for a whole number of seconds under a day."""
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h {m}m {sec}s" if h else f"{m}m {sec}s" if m else f"{sec}s"


def _expand(annotations: object, labels: dict[str, str], value: str) -> dict[str, str]:
    """Expected text of rule annotations for an alert with ``labels`` and ``value``.

    Covers the only template forms the rules use: ``{{ $labels.NAME }}``, ``{{ $value }}`` and
    ``{{ $value | humanizeDuration }}`` (``value`` is then already humanized).
    """
    assert isinstance(annotations, dict)
    out = {}
    for key, text in annotations.items():
        text = text.replace("{{ $value | humanizeDuration }}", value).replace("{{ $value }}", value)
        for name, v in labels.items():
            text = text.replace(f"{{{{ $labels.{name} }}}}", v)
        assert "{{" not in text, f"unexpanded template in annotation {key}: {text}"
        out[key] = text
    return out


def rule_tests(cfg: JobConfig, rules_file: str) -> dict[str, object]:
    """``promtool test rules`` cases: series that must fire each alert, and series that must not.

    Args:
        cfg: The job config whose thresholds the rules were rendered with.
        rules_file: Path of the plain rules file, relative to the test file.

    Returns:
        The promtool test document.
    """
    m = cfg.monitoring
    rid = cfg.run_id
    w = m.recovery_window_steps
    hosts = cfg.slice.num_hosts
    no_step = m.no_step_alert_minutes
    thr = m.repeated_failures_threshold

    def wl(i: int = 0) -> str:
        return f'run_id="{rid}",attempt="0",process_index="{i}"'

    def ann(rule: AlertRule, value: str = "", **labels: str) -> dict[str, object]:
        exp = {"severity": rule.severity, "run_id": rid, **labels}
        return {"exp_labels": exp, "exp_annotations": _expand(rule.as_dict()["annotations"], exp, value)}

    wa = {r.alert: r for r in worker_alerts(cfg)}
    ra = {r.alert: r for r in run_alerts(cfg)}
    # Steps advance 1 per minute from 0; checkpoints lag behind by `lag`.
    lag_fire = w + 5
    spread: list[dict[str, str]] = []
    if thr >= 2:
        failures = _n("jaxrec_failures_total")
        spread = [
            # One failure fewer than the threshold, close together.
            {"series": f'{failures}{{run_id="{rid}",class="preemption"}}', "values": f"0 1+1x{thr - 2} {thr - 1}x40"},
            # `thr` application failures, each an hour and more apart.
            {
                "series": f'{failures}{{run_id="{rid}",class="application"}}',
                "values": " ".join(f"{k}x12" for k in range(thr + 1)),
            },
        ]
    tests: list[dict[str, object]] = [
        {
            "name": "checkpoint lag beyond the recovery window fires; within it does not",
            "interval": "1m",
            "input_series": [
                {"series": f"{_n('jaxrec_train_step')}{{{wl(0)}}}", "values": f"{lag_fire}+1x30"},
                {"series": f"{_n('jaxrec_checkpoint_step')}{{{wl(0)}}}", "values": "0+1x30"},
            ],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": "JaxrecCheckpointLag", "exp_alerts": []},
                {
                    "eval_time": "10m",
                    "alertname": "JaxrecCheckpointLag",
                    "exp_alerts": [ann(wa["JaxrecCheckpointLag"], str(lag_fire))],
                },
            ],
        },
        {
            "name": "checkpoint lag exactly at the window does not fire",
            "interval": "1m",
            "input_series": [
                {"series": f"{_n('jaxrec_train_step')}{{{wl(0)}}}", "values": f"{w}+1x30"},
                {"series": f"{_n('jaxrec_checkpoint_step')}{{{wl(0)}}}", "values": "0+1x30"},
            ],
            "alert_rule_test": [{"eval_time": "20m", "alertname": "JaxrecCheckpointLag", "exp_alerts": []}],
        },
        {
            "name": "no step while workers are up fires after the limit; not while steps continue or workers are gone",
            "interval": "1m",
            "input_series": [
                # Steps every minute until minute 5, then none (timestamps in epoch seconds).
                {
                    "series": f"{_n('jaxrec_last_step_timestamp_seconds')}{{{wl(0)}}}",
                    "values": f"0+60x5 300x{no_step * 2 + 10}",
                },
                {"series": f"{_n('jaxrec_worker_up')}{{{wl(0)}}}", "values": f"1x{no_step * 2 + 15}"},
            ],
            "alert_rule_test": [
                {"eval_time": f"{5 + no_step - 1}m", "alertname": "JaxrecNoStep", "exp_alerts": []},
                {
                    "eval_time": f"{5 + no_step + 3}m",
                    "alertname": "JaxrecNoStep",
                    "exp_alerts": [ann(wa["JaxrecNoStep"], _humanize_seconds((no_step + 3) * 60))],
                },
            ],
        },
        {
            "name": "no step with every worker down does not fire (the attempt has ended)",
            "interval": "1m",
            "input_series": [
                {
                    "series": f"{_n('jaxrec_last_step_timestamp_seconds')}{{{wl(0)}}}",
                    "values": f"0+60x5 300x{no_step * 2 + 10}",
                },
                {"series": f"{_n('jaxrec_worker_up')}{{{wl(0)}}}", "values": f"1x5 0x{no_step * 2 + 10}"},
            ],
            "alert_rule_test": [{"eval_time": f"{5 + no_step + 3}m", "alertname": "JaxrecNoStep", "exp_alerts": []}],
        },
        {
            "name": "fewer workers than expected for 5 minutes fires; a full gang does not",
            "interval": "1m",
            "input_series": [
                *[
                    {
                        "series": f"{_n('jaxrec_worker_up')}{{{wl(i)}}}",
                        "values": "1x3 " + ("0x20" if i == 0 else "1x20"),
                    }
                    for i in range(hosts)
                ],
                *[
                    {"series": f"{_n('jaxrec_expected_workers')}{{{wl(i)}}}", "values": f"{hosts}x23"}
                    for i in range(hosts)
                ],
            ],
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "JaxrecWorkersBelowExpected", "exp_alerts": []},
                {"eval_time": "6m", "alertname": "JaxrecWorkersBelowExpected", "exp_alerts": []},
                {
                    "eval_time": "10m",
                    "alertname": "JaxrecWorkersBelowExpected",
                    "exp_alerts": [ann(wa["JaxrecWorkersBelowExpected"], str(hosts - 1))],
                },
            ],
        },
        {
            "name": "repeated failures of one class within an hour fire; fewer, or spread over hours, do not",
            "interval": "5m",
            "input_series": [
                # `thr` hang failures 5 minutes apart.
                {
                    "series": f'{_n("jaxrec_failures_total")}{{run_id="{rid}",class="hang"}}',
                    "values": f"0 1+1x{thr - 1} {thr}x40",
                },
                *spread,
            ],
            "alert_rule_test": [
                {
                    "eval_time": f"{5 * thr + 5}m",
                    "alertname": "JaxrecRepeatedFailures",
                    "exp_alerts": [
                        {
                            "exp_labels": {
                                "severity": ra["JaxrecRepeatedFailures"].severity,
                                "run_id": rid,
                                "class": "hang",
                            },
                            "exp_annotations": {
                                "summary": f"{rid}: repeated hang failures",
                                "description": (
                                    f"{thr} attempts failed with class hang within the last hour "
                                    f"(threshold: {thr}). The run still retries while its budget lasts."
                                ),
                                "runbook": f"{RUNBOOK}#hang",
                            },
                        }
                    ],
                },
                # Two hours later the hang failures have aged out of the window.
                {"eval_time": f"{5 * thr + 5 + 120}m", "alertname": "JaxrecRepeatedFailures", "exp_alerts": []},
            ],
        },
        {
            "name": "a failure counter first seen at 1 (as Argo creates it) counts its first failure",
            "interval": "5m",
            "input_series": [
                {
                    "series": f'{_n("jaxrec_failures_total")}{{run_id="{rid}",class="capacity"}}',
                    "values": f"_x2 1+1x{thr - 1} {thr}x20",
                },
            ],
            "alert_rule_test": [
                {"eval_time": f"{5 * thr}m", "alertname": "JaxrecRepeatedFailures", "exp_alerts": []},
                {
                    "eval_time": f"{5 * thr + 10}m",
                    "alertname": "JaxrecRepeatedFailures",
                    "exp_alerts": [ann(ra["JaxrecRepeatedFailures"], str(thr), **{"class": "capacity"})],
                },
            ],
        },
        {
            "name": "a spent budget fires with its class; a run that succeeded does not fire anything",
            "interval": "1m",
            "input_series": [
                {
                    "series": f'{_n("jaxrec_budget_exhausted")}{{run_id="{rid}",class="application"}}',
                    "values": "0x3 1x10",
                },
                {"series": f'{_n("jaxrec_budget_exhausted")}{{run_id="{rid}",class="hang"}}', "values": "0x13"},
                {"series": f'{_n("jaxrec_run_status")}{{run_id="{rid}",status="Failed"}}', "values": "0x3 1x10"},
                {"series": f'{_n("jaxrec_run_status")}{{run_id="{rid}",status="Running"}}', "values": "1x3 0x10"},
            ],
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "JaxrecBudgetExhausted", "exp_alerts": []},
                {
                    "eval_time": "5m",
                    "alertname": "JaxrecBudgetExhausted",
                    "exp_alerts": [
                        {
                            "exp_labels": {"severity": "critical", "run_id": rid, "class": "application"},
                            "exp_annotations": {
                                "summary": f"{rid} stopped: application retry budget spent",
                                "description": (
                                    "The run ended Failed because failures of class application used up its "
                                    "retry budget. It will not restart by itself."
                                ),
                                "runbook": f"{RUNBOOK}#application",
                            },
                        }
                    ],
                },
                # The budget alert covers this failure: no second page.
                {"eval_time": "5m", "alertname": "JaxrecRunFailed", "exp_alerts": []},
            ],
        },
        {
            "name": "a run that ended in Error without a spent budget fires JaxrecRunFailed",
            "interval": "1m",
            "input_series": [
                {"series": f'{_n("jaxrec_budget_exhausted")}{{run_id="{rid}",class="hang"}}', "values": "0x13"},
                {"series": f'{_n("jaxrec_run_status")}{{run_id="{rid}",status="Error"}}', "values": "0x3 1x10"},
                {"series": f'{_n("jaxrec_run_status")}{{run_id="{rid}",status="Succeeded"}}', "values": "0x13"},
            ],
            "alert_rule_test": [
                {"eval_time": "2m", "alertname": "JaxrecRunFailed", "exp_alerts": []},
                {
                    "eval_time": "5m",
                    "alertname": "JaxrecRunFailed",
                    "exp_alerts": [ann(ra["JaxrecRunFailed"])],
                },
                {"eval_time": "5m", "alertname": "JaxrecBudgetExhausted", "exp_alerts": []},
            ],
        },
        {
            "name": "a succeeded run fires nothing",
            "interval": "1m",
            "input_series": [
                {"series": f'{_n("jaxrec_run_status")}{{run_id="{rid}",status="Succeeded"}}', "values": "0x3 1x10"},
                {"series": f'{_n("jaxrec_run_status")}{{run_id="{rid}",status="Failed"}}', "values": "0x13"},
                {"series": f'{_n("jaxrec_budget_exhausted")}{{run_id="{rid}",class="hang"}}', "values": "0x13"},
            ],
            "alert_rule_test": [
                {"eval_time": "10m", "alertname": name, "exp_alerts": []}
                for name in ("JaxrecRunFailed", "JaxrecBudgetExhausted", "JaxrecRepeatedFailures")
            ],
        },
    ]
    return {"rule_files": [rules_file], "evaluation_interval": "1m", "tests": tests}


# ---- rendering ---------------------------------------------------------------------------------


def render_monitoring(cfg: JobConfig, stem: str | None = None) -> dict[str, str]:
    """Monitoring files of a GKE job (nothing for a local job).

    Args:
        cfg: The job config.
        stem: File-name stem, normally the config file's stem (defaults to the run id).

    Returns:
        Output file name -> file text: ``<stem>.monitoring.yaml`` (PodMonitoring, Rules,
        ClusterRules), ``<stem>.rules.yaml`` (plain Prometheus rules) and ``<stem>.dashboard.json``.
    """
    if cfg.slice.is_local:
        return {}
    stem = stem or cfg.run_id
    header = f"# Generated from the job config {stem} by workflows.monitoring; do not edit.\n"
    manifests = [pod_monitoring(cfg), *rules_resources(cfg)]
    return {
        f"{stem}.monitoring.yaml": header + "---\n".join(_dump(d) for d in manifests),
        f"{stem}.rules.yaml": header + _dump(prometheus_rules(cfg)),
        f"{stem}.dashboard.json": json.dumps(dashboard(cfg), indent=2, sort_keys=False) + "\n",
    }


def render_rule_tests(cfg: JobConfig, stem: str) -> str:
    """The promtool test file of ``<stem>.rules.yaml`` (expected next to it)."""
    header = f"# Generated from the job config {stem} by workflows.monitoring; do not edit.\n"
    return header + _dump(rule_tests(cfg, f"{stem}.rules.yaml"))


def metric_table_markdown() -> str:
    """The metric table of docs/MONITORING.md, generated from ``recovery_steps.metrics``."""
    rows = [
        "| metric | type | labels | exported by | GKE scrape name | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for m in METRICS:
        source = "trainer (each worker)" if m.scope == "worker" else "Argo template metric; local runner"
        rows.append(
            f"| `{m.name}` | {m.kind} | {', '.join(f'`{x}`' for x in m.labels)} | {source} | "
            f"`{exposed_name(m.name, argo=True)}` | {m.help} |"
        )
    return "\n".join(rows)


def run(config_paths: Sequence[str | Path], out_dir: str | Path, *, with_tests: bool = False) -> list[Path]:
    """Render the monitoring files of each config into ``out_dir``.

    Args:
        config_paths: Job config files.
        out_dir: Output directory (created if missing).
        with_tests: Also write ``<stem>.test.yaml`` promtool tests and the rules they test.

    Returns:
        The paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in config_paths:
        cfg = load_config(path)
        stem = Path(path).stem
        files = render_monitoring(cfg, stem)
        if with_tests and files:
            files = {
                f"{stem}.rules.yaml": files[f"{stem}.rules.yaml"],
                f"{stem}.test.yaml": render_rule_tests(cfg, stem),
            }
        for name, text in files.items():
            (out / name).write_text(text)
            written.append(out / name)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m workflows.monitoring CONFIG... --out DIR [--promtool-tests]``."""
    p = argparse.ArgumentParser(prog="python -m workflows.monitoring", description=__doc__)
    p.add_argument("configs", nargs="+", help="job config files")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--promtool-tests", action="store_true", help="write promtool rule tests instead")
    args = p.parse_args(argv)
    try:
        for path in run(args.configs, args.out, with_tests=args.promtool_tests):
            print(path)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

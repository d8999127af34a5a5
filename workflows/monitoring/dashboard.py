"""The Grafana dashboard of one job: one row per run, panels over the metric table's names."""

from __future__ import annotations

from jaxrec.model.config import JobConfig
from workflows.monitoring.rules import gke_name

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

    def top(metric: str) -> str:
        return f"max by (run_id) ({gke_name(metric)}{r})"

    return {
        "Training step": ("timeseries", [("step", top("jaxrec_train_step"))]),
        "Checkpoint step": ("timeseries", [("checkpoint step", top("jaxrec_checkpoint_step"))]),
        "Checkpoint age": ("timeseries", [("age", top("jaxrec_checkpoint_age_seconds"))]),
        "Checkpoint duration": ("timeseries", [("save to commit", top("jaxrec_checkpoint_duration_seconds"))]),
        "Active vs expected workers": (
            "timeseries",
            [
                ("active", f"sum by (run_id) ({gke_name('jaxrec_worker_up')}{r})"),
                ("expected", top("jaxrec_expected_workers")),
            ],
        ),
        "Job status": (
            "state-timeline",
            [("{{status}}", f"max by (run_id, status) ({gke_name('jaxrec_run_status')}{r}) == 1")],
        ),
        "Attempts (restart count + 1)": ("stat", [("attempts", top("jaxrec_attempts_total"))]),
        "Last failure class and reason": (
            "table",
            [
                (
                    "{{class}}: {{reason}}",
                    f"max by (run_id, class, reason) ({gke_name('jaxrec_last_failure_info')}{r}) == 1",
                )
            ],
        ),
        "Recovery duration": ("stat", [("failure to pre-failure step", top("jaxrec_recovery_duration_seconds"))]),
        "Time since last successful step": (
            "stat",
            [("since last step", f"time() - {top('jaxrec_last_step_timestamp_seconds')}")],
        ),
        "Steps lost": ("stat", [("steps lost", top("jaxrec_steps_lost_total"))]),
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
    panels += [_panel(i, title, *queries[title], ds) for i, title in enumerate(DASHBOARD_PANELS)]
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
        "templating": {"list": _variables(cfg, ds)},
        "panels": panels,
    }


def _panel(i: int, title: str, kind: str, targets: list[tuple[str, str]], ds: dict[str, str]) -> dict[str, object]:
    """Panel ``i`` of a run's row: four to a line, one query target per (legend, expression)."""
    width, height = 6, 7
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
    return panel


def _variables(cfg: JobConfig, ds: dict[str, str]) -> list[dict[str, object]]:
    """The dashboard's variables: the data source, and the runs (the config's run id selected)."""
    runs = f"label_values({gke_name('jaxrec_expected_workers')}, run_id)"
    return [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
        {
            "name": "run_id",
            "label": "Run",
            "type": "query",
            "datasource": ds,
            "query": {"query": runs, "refId": "run_id"},
            "definition": runs,
            "refresh": 2,
            "multi": True,
            "includeAll": True,
            "current": {"selected": True, "text": [cfg.run_id], "value": [cfg.run_id]},
            "sort": 1,
        },
    ]

"""promtool unit tests of one job's alert rules: each rule fires, and stays quiet, where it should.

``tests/promtool/`` holds the rules and their tests per GKE config, for running promtool by hand; after a threshold
or rule change, regenerate them:

    .venv/bin/python tests/support/promtool.py configs/v5e-4x4.yaml configs/v5p-64.yaml configs/v6e-8x8.yaml
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from jaxrec.model.config import JobConfig, load_config
from workflows.monitoring import render_monitoring
from workflows.monitoring.manifests import dump_yaml
from workflows.monitoring.rules import RUNBOOK, AlertRule, gke_name, run_alerts, worker_alerts

FOLDER = Path(__file__).resolve().parents[1] / "promtool"


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


@dataclass(frozen=True)
class _Cases:
    """What the test cases of one job's rules are written from."""

    rid: str
    w: int  # monitoring.recovery_window_steps
    hosts: int
    no_step: int  # monitoring.no_step_alert_minutes
    thr: int  # monitoring.repeated_failures_threshold
    wa: dict[str, AlertRule]  # worker alerts by name
    ra: dict[str, AlertRule]  # run alerts by name

    def wl(self, i: int = 0) -> str:
        """The labels of worker ``i``'s series in attempt 0."""
        return f'run_id="{self.rid}",attempt="0",process_index="{i}"'

    def ann(self, rule: AlertRule, value: str = "", **labels: str) -> dict[str, object]:
        """The alert ``rule`` fires with: its labels and its annotations expanded."""
        exp = {"severity": rule.severity, "run_id": self.rid, **labels}
        return {"exp_labels": exp, "exp_annotations": _expand(rule.as_dict()["annotations"], exp, value)}


def rule_tests(cfg: JobConfig, rules_file: str) -> dict[str, object]:
    """``promtool test rules`` cases: series that must fire each alert, and series that must not.

    Args:
        cfg: The job config whose thresholds the rules were rendered with.
        rules_file: Path of the plain rules file, relative to the test file.

    Returns:
        The promtool test document.
    """
    m = cfg.monitoring
    c = _Cases(
        rid=cfg.run_id,
        w=m.recovery_window_steps,
        hosts=cfg.slice.num_hosts,
        no_step=m.no_step_alert_minutes,
        thr=m.repeated_failures_threshold,
        wa={r.alert: r for r in worker_alerts(cfg)},
        ra={r.alert: r for r in run_alerts(cfg)},
    )
    tests = [*_checkpoint_lag_cases(c), *_no_step_cases(c), *_workers_cases(c), *_failure_cases(c), *_run_end_cases(c)]
    tests += _unsupervised_cases(c, int(2 * cfg.retry.lease_renew_every_s))
    if "JaxrecGcsBackupLag" in c.wa:
        tests += _backup_lag_cases(c, 2 * cfg.checkpoint.interval_steps)
    return {"rule_files": [rules_file], "evaluation_interval": "1m", "tests": tests}


def _checkpoint_lag_cases(c: _Cases) -> list[dict[str, object]]:
    """JaxrecCheckpointLag: beyond the recovery window, and exactly at it."""
    w, wl, ann, wa = c.w, c.wl, c.ann, c.wa
    # Steps advance 1 per minute from 0; checkpoints lag behind by `lag`.
    lag_fire = w + 5
    return [
        {
            "name": "checkpoint lag beyond the recovery window fires; within it does not",
            "interval": "1m",
            "input_series": [
                {"series": f"{gke_name('jaxrec_train_step')}{{{wl(0)}}}", "values": f"{lag_fire}+1x30"},
                {"series": f"{gke_name('jaxrec_checkpoint_step')}{{{wl(0)}}}", "values": "0+1x30"},
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
                {"series": f"{gke_name('jaxrec_train_step')}{{{wl(0)}}}", "values": f"{w}+1x30"},
                {"series": f"{gke_name('jaxrec_checkpoint_step')}{{{wl(0)}}}", "values": "0+1x30"},
            ],
            "alert_rule_test": [{"eval_time": "20m", "alertname": "JaxrecCheckpointLag", "exp_alerts": []}],
        },
    ]


def _backup_lag_cases(c: _Cases, limit: int) -> list[dict[str, object]]:
    """JaxrecGcsBackupLag: local parts beyond two GCS intervals ahead of GCS fire; at the limit they do not."""
    wl, ann, wa = c.wl, c.ann, c.wa
    local, gcs = gke_name("jaxrec_local_checkpoint_step"), gke_name("jaxrec_checkpoint_step")
    return [
        {
            "name": "GCS lagging the local tier by more than two intervals fires; at two it does not",
            "interval": "1m",
            "input_series": [
                {"series": f"{local}{{{wl(0)}}}", "values": f"{limit + 1}+1x30"},
                {"series": f"{gcs}{{{wl(0)}}}", "values": "0+1x30"},
                {"series": f"{local}{{{wl(1)}}}", "values": f"{limit}+1x30"},
            ],
            "alert_rule_test": [
                {"eval_time": "9m", "alertname": "JaxrecGcsBackupLag", "exp_alerts": []},
                {
                    "eval_time": "15m",
                    "alertname": "JaxrecGcsBackupLag",
                    "exp_alerts": [ann(wa["JaxrecGcsBackupLag"], str(limit + 1))],
                },
            ],
        },
        {
            "name": "GCS lagging the local tier by exactly two intervals does not fire",
            "interval": "1m",
            "input_series": [
                {"series": f"{local}{{{wl(0)}}}", "values": f"{limit}+1x30"},
                {"series": f"{gcs}{{{wl(0)}}}", "values": "0+1x30"},
            ],
            "alert_rule_test": [{"eval_time": "20m", "alertname": "JaxrecGcsBackupLag", "exp_alerts": []}],
        },
    ]


def _no_step_cases(c: _Cases) -> list[dict[str, object]]:
    """JaxrecNoStep: while workers are up, and with every worker down."""
    no_step, wl, ann, wa = c.no_step, c.wl, c.ann, c.wa
    return [
        {
            "name": "no step while workers are up fires after the limit; not while steps continue or workers are gone",
            "interval": "1m",
            "input_series": [
                # Steps every minute until minute 5, then none (timestamps in epoch seconds).
                {
                    "series": f"{gke_name('jaxrec_last_step_timestamp_seconds')}{{{wl(0)}}}",
                    "values": f"0+60x5 300x{no_step * 2 + 10}",
                },
                {"series": f"{gke_name('jaxrec_worker_up')}{{{wl(0)}}}", "values": f"1x{no_step * 2 + 15}"},
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
                    "series": f"{gke_name('jaxrec_last_step_timestamp_seconds')}{{{wl(0)}}}",
                    "values": f"0+60x5 300x{no_step * 2 + 10}",
                },
                {"series": f"{gke_name('jaxrec_worker_up')}{{{wl(0)}}}", "values": f"1x5 0x{no_step * 2 + 10}"},
            ],
            "alert_rule_test": [{"eval_time": f"{5 + no_step + 3}m", "alertname": "JaxrecNoStep", "exp_alerts": []}],
        },
    ]


def _unsupervised_cases(c: _Cases, limit: int) -> list[dict[str, object]]:
    """JaxrecRunUnsupervised: the lease last renewed at 5 min with workers up; never read; workers down."""
    wl, ann, wa = c.wl, c.ann, c.wa
    quiet = (limit + 300) // 60  # time() - 300 <= limit here
    fire = quiet + 3
    lease = gke_name("jaxrec_run_lease_renewed_timestamp_seconds")
    up = gke_name("jaxrec_worker_up")
    return [
        {
            "name": "a lease unrenewed past twice its period while workers are up fires; not before",
            "interval": "1m",
            "input_series": [
                {"series": f"{lease}{{{wl(0)}}}", "values": f"300x{fire + 2}"},
                {"series": f"{up}{{{wl(0)}}}", "values": f"1x{fire + 2}"},
            ],
            "alert_rule_test": [
                {"eval_time": f"{quiet}m", "alertname": "JaxrecRunUnsupervised", "exp_alerts": []},
                {
                    "eval_time": f"{fire}m",
                    "alertname": "JaxrecRunUnsupervised",
                    "exp_alerts": [ann(wa["JaxrecRunUnsupervised"], _humanize_seconds(fire * 60 - 300))],
                },
            ],
        },
        *(
            {
                "name": name,
                "interval": "1m",
                "input_series": [
                    {"series": f"{lease}{{{wl(0)}}}", "values": f"{renewed}x{fire + 2}"},
                    {"series": f"{up}{{{wl(0)}}}", "values": f"{workers}x{fire + 2}"},
                ],
                "alert_rule_test": [{"eval_time": f"{fire}m", "alertname": "JaxrecRunUnsupervised", "exp_alerts": []}],
            }
            for name, renewed, workers in (
                ("a lease never read (the gauge's 0) does not fire", 0, 1),
                ("an unrenewed lease with every worker down does not fire (no gang runs)", 300, 0),
            )
        ),
    ]


def _workers_cases(c: _Cases) -> list[dict[str, object]]:
    """JaxrecWorkersBelowExpected: one worker gone for 5 minutes."""
    hosts, wl, ann, wa = c.hosts, c.wl, c.ann, c.wa
    return [
        {
            "name": "fewer workers than expected for 5 minutes fires; a full gang does not",
            "interval": "1m",
            "input_series": [
                *[
                    {
                        "series": f"{gke_name('jaxrec_worker_up')}{{{wl(i)}}}",
                        "values": "1x3 " + ("0x20" if i == 0 else "1x20"),
                    }
                    for i in range(hosts)
                ],
                *[
                    {"series": f"{gke_name('jaxrec_expected_workers')}{{{wl(i)}}}", "values": f"{hosts}x23"}
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
    ]


def _failure_cases(c: _Cases) -> list[dict[str, object]]:
    """JaxrecRepeatedFailures: within an hour, fewer or spread out, and a counter first seen at 1."""
    rid, thr, ann, ra = c.rid, c.thr, c.ann, c.ra
    spread: list[dict[str, str]] = []
    if thr >= 2:
        failures = gke_name("jaxrec_failures_total")
        spread = [
            # One failure fewer than the threshold, close together.
            {"series": f'{failures}{{run_id="{rid}",class="preemption"}}', "values": f"0 1+1x{thr - 2} {thr - 1}x40"},
            # `thr` application failures, each an hour and more apart.
            {
                "series": f'{failures}{{run_id="{rid}",class="application"}}',
                "values": " ".join(f"{k}x12" for k in range(thr + 1)),
            },
        ]
    return [
        {
            "name": "repeated failures of one class within an hour fire; fewer, or spread over hours, do not",
            "interval": "5m",
            "input_series": [
                # `thr` hang failures 5 minutes apart.
                {
                    "series": f'{gke_name("jaxrec_failures_total")}{{run_id="{rid}",class="hang"}}',
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
                    "series": f'{gke_name("jaxrec_failures_total")}{{run_id="{rid}",class="capacity"}}',
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
    ]


def _run_end_cases(c: _Cases) -> list[dict[str, object]]:
    """JaxrecBudgetExhausted and JaxrecRunFailed: how a run ended pages once, or not at all."""
    rid, ann, ra = c.rid, c.ann, c.ra
    return [
        {
            "name": "a spent budget fires with its class; a run that succeeded does not fire anything",
            "interval": "1m",
            "input_series": [
                {
                    "series": f'{gke_name("jaxrec_budget_exhausted")}{{run_id="{rid}",class="application"}}',
                    "values": "0x3 1x10",
                },
                {"series": f'{gke_name("jaxrec_budget_exhausted")}{{run_id="{rid}",class="hang"}}', "values": "0x13"},
                {"series": f'{gke_name("jaxrec_run_status")}{{run_id="{rid}",status="Failed"}}', "values": "0x3 1x10"},
                {"series": f'{gke_name("jaxrec_run_status")}{{run_id="{rid}",status="Running"}}', "values": "1x3 0x10"},
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
                {"series": f'{gke_name("jaxrec_budget_exhausted")}{{run_id="{rid}",class="hang"}}', "values": "0x13"},
                {"series": f'{gke_name("jaxrec_run_status")}{{run_id="{rid}",status="Error"}}', "values": "0x3 1x10"},
                {"series": f'{gke_name("jaxrec_run_status")}{{run_id="{rid}",status="Succeeded"}}', "values": "0x13"},
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
                {
                    "series": f'{gke_name("jaxrec_run_status")}{{run_id="{rid}",status="Succeeded"}}',
                    "values": "0x3 1x10",
                },
                {"series": f'{gke_name("jaxrec_run_status")}{{run_id="{rid}",status="Failed"}}', "values": "0x13"},
                {"series": f'{gke_name("jaxrec_budget_exhausted")}{{run_id="{rid}",class="hang"}}', "values": "0x13"},
            ],
            "alert_rule_test": [
                {"eval_time": "10m", "alertname": name, "exp_alerts": []}
                for name in ("JaxrecRunFailed", "JaxrecBudgetExhausted", "JaxrecRepeatedFailures")
            ],
        },
    ]


def render_rule_tests(cfg: JobConfig, stem: str) -> str:
    """The promtool test file of ``<stem>.rules.yaml`` (expected next to it)."""
    header = f"# Generated from the job config {stem} by tests/support/promtool.py; do not edit.\n"
    return header + dump_yaml(rule_tests(cfg, f"{stem}.rules.yaml"))


def committed(cfg: JobConfig, stem: str) -> dict[str, str]:
    """The files ``tests/promtool/`` holds for one config: its plain rules and their tests."""
    return {
        f"{stem}.rules.yaml": render_monitoring(cfg, stem)[f"{stem}.rules.yaml"],
        f"{stem}.test.yaml": render_rule_tests(cfg, stem),
    }


if __name__ == "__main__":
    for path in sys.argv[1:]:
        for name, text in committed(load_config(path), Path(path).stem).items():
            (FOLDER / name).write_text(text)
            print(FOLDER / name)

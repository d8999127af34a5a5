"""GKE monitoring for one job: PodMonitoring, alert rules and a Grafana dashboard.

Everything here is a pure function of the job config and the metric table
(``jaxrec.model.metrics``): the same config always renders the same text.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxrec.model.config import ConfigError, JobConfig, load_config
from jaxrec.model.metrics import METRICS, exposed_name
from workflows.monitoring.dashboard import dashboard
from workflows.monitoring.manifests import dump_yaml, pod_monitoring, rules_resources
from workflows.monitoring.rules import prometheus_rules, run_alerts, worker_alerts

DOC_BEGIN = "<!-- metric-table:begin (generated from jaxrec/model/metrics.py) -->"
DOC_END = "<!-- metric-table:end -->"

__all__ = [
    "DOC_BEGIN",
    "DOC_END",
    "main",
    "metric_table_markdown",
    "prometheus_rules",
    "render_monitoring",
    "run",
    "run_alerts",
    "worker_alerts",
]


def render_monitoring(cfg: JobConfig, stem: str | None = None) -> dict[str, str]:
    """Monitoring files of a GKE job (nothing for a local job).

    Args:
        cfg: The job config.
        stem: File-name stem, normally the config file's stem (defaults to the run id).

    Returns:
        Output file name -> file text: ``<stem>.monitoring.yaml`` (PodMonitoring, Rules,
        ClusterRules), ``<stem>.rules.yaml`` (plain Prometheus rules) and ``<stem>.dashboard.json``.
    """
    if cfg.slice.is_cpu:
        return {}
    stem = stem or cfg.run_id
    header = f"# Generated from the job config {stem} by workflows.monitoring; do not edit.\n"
    manifests = [pod_monitoring(cfg), *rules_resources(cfg)]
    return {
        f"{stem}.monitoring.yaml": header + "---\n".join(dump_yaml(d) for d in manifests),
        f"{stem}.rules.yaml": header + dump_yaml(prometheus_rules(cfg)),
        f"{stem}.dashboard.json": json.dumps(dashboard(cfg), indent=2, sort_keys=False) + "\n",
    }


def metric_table_markdown() -> str:
    """The metric table of docs/MONITORING.md, generated from ``jaxrec.model.metrics``."""
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


def run(config_paths: Sequence[str | Path], out_dir: str | Path) -> list[Path]:
    """Render the monitoring files of each config into ``out_dir``.

    Args:
        config_paths: Job config files.
        out_dir: Output directory (created if missing).

    Returns:
        The paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in config_paths:
        for name, text in render_monitoring(load_config(path), Path(path).stem).items():
            (out / name).write_text(text)
            written.append(out / name)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m workflows.monitoring CONFIG... --out DIR``."""
    p = argparse.ArgumentParser(prog="python -m workflows.monitoring", description=__doc__)
    p.add_argument("configs", nargs="+", help="job config files")
    p.add_argument("--out", required=True, help="output directory")
    args = p.parse_args(argv)
    try:
        for path in run(args.configs, args.out):
            print(path)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return 2
    return 0

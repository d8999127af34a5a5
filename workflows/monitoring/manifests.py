"""Cluster manifests of one job's monitoring: the PodMonitoring that scrapes workers, and the GMP Rules."""

from __future__ import annotations

import yaml

from jaxrec.model.config import JobConfig
from jaxrec.model.names import RUN_ID_LABEL
from workflows.monitoring.rules import rule_groups, rule_interval

METRICS_PORT_NAME = "metrics"
"""Name of the worker container port that serves ``/metrics``."""

MONITORING_API = "monitoring.googleapis.com/v1"


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
            "endpoints": [{"port": METRICS_PORT_NAME, "path": "/metrics", "interval": rule_interval(cfg)}],
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


def dump_yaml(doc: object) -> str:
    """Block-style YAML, keys in the order given."""
    return yaml.safe_dump(doc, sort_keys=False, width=1000, default_flow_style=False)

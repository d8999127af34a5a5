"""RBAC for the workflow's ServiceAccount: only the verbs the steps, the Argo executor and the workers use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jaxrec.model.config import JobConfig
from jaxrec.model.names import STEP_PRIORITY_CLASS, STEP_VERBS

ROLE = "jaxrec-workflow"
RBAC_GROUP = "rbac.authorization.k8s.io"
RBAC_API = f"{RBAC_GROUP}/v1"
NODE_READER = "jaxrec-node-reader"


def _rules(cluster_scoped: bool) -> list[dict[str, Any]]:
    """RBAC rules from the table of verbs (model.names): one rule per (API group, resource), verbs in table order."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for use in STEP_VERBS:
        if use.cluster_scoped == cluster_scoped:
            verbs = grouped.setdefault((use.group, use.resource), [])
            if use.verb not in verbs:
                verbs.append(use.verb)
    return [{"apiGroups": [g], "resources": [r], "verbs": v} for (g, r), v in grouped.items()]


# Namespaced: what the steps and the Argo executor do in the run's namespace (see STEP_VERBS for who and why).
ROLE_RULES: list[dict[str, Any]] = _rules(cluster_scoped=False)

# Cluster-scoped: nodes (provision-slice, classify-failure) and the run's namespace (preflight).
NODE_RULES: list[dict[str, Any]] = _rules(cluster_scoped=True)


def _accounts(cfgs: Iterable[JobConfig], *, workers: bool = False) -> list[tuple[str, str]]:
    """Distinct (namespace, service account) pairs of the GKE configs: the steps' (or the workers'), sorted."""
    return sorted(
        {(c.namespace, c.worker_service_account if workers else c.service_account) for c in cfgs if not c.slice.is_cpu}
    )


def _object(api_version: str, kind: str, metadata: dict[str, str], **fields: Any) -> dict[str, Any]:
    """A Kubernetes object: its apiVersion, kind and metadata, then ``fields`` in the order given."""
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata, **fields}


def _subject(ns: str, sa: str) -> dict[str, str]:
    return {"kind": "ServiceAccount", "name": sa, "namespace": ns}


def rbac_objects(cfgs: Iterable[JobConfig]) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding per namespace, and one ClusterRole + ClusterRoleBinding.

    Local configs need no cluster and are left out.

    Args:
        cfgs: Every job config that is built.

    Returns:
        Kubernetes objects in apply order.
    """
    cfgs = list(cfgs)
    accounts = _accounts(cfgs)
    objs = [_object("v1", "ServiceAccount", {"name": sa, "namespace": ns}) for ns, sa in accounts]
    # The workers' accounts get no Role and no API token: they only reach the bucket (Workload Identity).
    for ns, sa in _accounts(cfgs, workers=True):
        if (ns, sa) not in accounts:
            meta = {"name": sa, "namespace": ns}
            objs.append(_object("v1", "ServiceAccount", meta, automountServiceAccountToken=False))
    for ns in sorted({ns for ns, _ in accounts}):
        objs.append(_object(RBAC_API, "Role", {"name": ROLE, "namespace": ns}, rules=ROLE_RULES))
        role = {"apiGroup": RBAC_GROUP, "kind": "Role", "name": ROLE}
        subjects = [_subject(ns, sa) for ns2, sa in accounts if ns2 == ns]
        objs.append(_object(RBAC_API, "RoleBinding", {"name": ROLE, "namespace": ns}, roleRef=role, subjects=subjects))
    if accounts:
        objs.append(_object(RBAC_API, "ClusterRole", {"name": NODE_READER}, rules=NODE_RULES))
        role = {"apiGroup": RBAC_GROUP, "kind": "ClusterRole", "name": NODE_READER}
        subjects = [_subject(ns, sa) for ns, sa in accounts]
        objs.append(_object(RBAC_API, "ClusterRoleBinding", {"name": NODE_READER}, roleRef=role, subjects=subjects))
        objs.append(
            {
                "apiVersion": "scheduling.k8s.io/v1",
                "kind": "PriorityClass",
                "metadata": {"name": STEP_PRIORITY_CLASS},
                # Above ordinary pods (0), far below the system classes (2e9): the kubelet evicts the supervisor
                # of a gang after other pods under memory pressure. It never preempts anyone to be scheduled.
                "value": 100000,
                "preemptionPolicy": "Never",
                "globalDefault": False,
                "description": "train-segment: the pod that supervises a training gang (jax-slice-recovery).",
            }
        )
    return objs

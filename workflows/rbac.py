"""RBAC for the workflow's ServiceAccount: only the verbs the steps, the Argo executor and the workers use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from recovery_steps.kernel.config import JobConfig
from recovery_steps.kernel.k8s import JOBSET_GROUP

ROLE = "jaxrec-workflow"
NODE_READER = "jaxrec-node-reader"

# Namespaced rules, one line per reason.
ROLE_RULES: list[dict[str, Any]] = [
    # Argo executor (emissary): watch its own pod, report outputs through WorkflowTaskResults.
    # train-segment (the supervisor) watches the gang's pods and force-deletes one stuck Terminating on a
    # lost node (grace period 0): "delete".
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch", "delete"]},
    {"apiGroups": ["argoproj.io"], "resources": ["workflowtaskresults"], "verbs": ["create", "patch"]},
    # train-segment creates (or re-attaches to), watches and deletes the attempt's JobSet; provision-slice
    # deletes old ones; classify-failure reads the JobSet status.
    {
        "apiGroups": [JOBSET_GROUP],
        "resources": ["jobsets"],
        "verbs": ["create", "get", "list", "watch", "patch", "delete"],
    },
    # classify-failure: the Jobs of the JobSet and the events of its pods; train-segment watches the Jobs
    # (their FailureTarget condition ends the attempt before JobSet does).
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["get", "list"]},
]

# Cluster-scoped: provision-slice checks the slice's nodes, classify-failure and train-segment read node
# conditions (Ready, the unreachable taint).
NODE_RULES: list[dict[str, Any]] = [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]}]


def _accounts(cfgs: Iterable[JobConfig]) -> list[tuple[str, str]]:
    """Distinct (namespace, service account) pairs of the GKE configs, sorted."""
    return sorted({(c.namespace, c.service_account) for c in cfgs if not c.slice.is_local})


def rbac_objects(cfgs: Iterable[JobConfig]) -> list[dict[str, Any]]:
    """ServiceAccount, Role and RoleBinding per namespace, and one ClusterRole + ClusterRoleBinding.

    Local configs need no cluster and are left out.

    Args:
        cfgs: Every job config that is built.

    Returns:
        Kubernetes objects in apply order.
    """
    accounts = _accounts(cfgs)
    objs: list[dict[str, Any]] = []
    for ns, sa in accounts:
        objs.append({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa, "namespace": ns}})
    for ns in sorted({ns for ns, _ in accounts}):
        objs.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": ROLE, "namespace": ns},
                "rules": ROLE_RULES,
            }
        )
        objs.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": ROLE, "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROLE},
                "subjects": [
                    {"kind": "ServiceAccount", "name": sa, "namespace": ns} for ns2, sa in accounts if ns2 == ns
                ],
            }
        )
    if accounts:
        objs.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": NODE_READER},
                "rules": NODE_RULES,
            }
        )
        objs.append(
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": NODE_READER},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": NODE_READER},
                "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns} for ns, sa in accounts],
            }
        )
    return objs

"""RBAC: every verb the workflow's ServiceAccount holds is one a named step uses, and nothing more."""

from __future__ import annotations

from pathlib import Path

import yaml

from jaxrec.model.names import STEP_VERBS
from workflows.rbac import NODE_RULES, ROLE_RULES

REPO = Path(__file__).resolve().parents[1]

# Each verb the workflow's ServiceAccount may use, with the step that needs it (read off the steps' API calls).
EXPECTED = {
    ("argoproj.io", "workflowtaskresults", "create"): "argo-executor",
    ("argoproj.io", "workflowtaskresults", "patch"): "argo-executor",
    ("jobset.x-k8s.io", "jobsets", "create"): "train-segment",
    ("jobset.x-k8s.io", "jobsets", "get"): "train-segment",
    ("jobset.x-k8s.io", "jobsets", "watch"): "train-segment",
    ("jobset.x-k8s.io", "jobsets", "list"): "provision-slice",
    ("jobset.x-k8s.io", "jobsets", "delete"): "train-segment",
    ("", "pods", "list"): "train-segment",
    ("", "pods", "watch"): "train-segment",
    ("", "pods", "delete"): "train-segment",
    ("", "nodes", "list"): "provision-slice",
    ("batch", "jobs", "list"): "train-segment",
    ("batch", "jobs", "watch"): "train-segment",
    ("", "events", "list"): "train-segment",
    ("", "nodes", "get"): "train-segment",
    ("", "namespaces", "get"): "preflight",
    ("argoproj.io", "workflows", "get"): "validate-config",
    ("argoproj.io", "workflows", "create"): "hand-over",
    ("argoproj.io", "workflows", "patch"): "give-up",
    ("", "serviceaccounts", "get"): "preflight",
    # A dry run only (admission judges one worker pod; nothing is stored). It grants nothing the steps do not hold
    # already: a JobSet they create makes pods of any spec and account in the namespace.
    ("", "pods", "create"): "preflight",
}


def _granted(rules):
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def test_each_granted_verb_has_the_step_that_needs_it():
    first_user = {}
    for use in STEP_VERBS:
        first_user.setdefault((use.group, use.resource, use.verb), use.step)
    assert first_user == EXPECTED
    assert _granted(ROLE_RULES) | _granted(NODE_RULES) == set(EXPECTED)
    # Nothing the steps never call: no pod patch, no writes to Jobs or nodes; the one Workflow patch is give-up's, on
    # its own Workflow (its class label and description; spec.shutdown, as argo stop sends, when it is replayed).
    own_stop = {("argoproj.io", "workflows", "patch")}
    for verb in ("patch", "update", "deletecollection", "*"):
        granted = _granted(ROLE_RULES) - own_stop
        assert not any(v == verb for g, r, v in granted if r != "workflowtaskresults")
    assert not _granted(NODE_RULES) - {("", "nodes", "get"), ("", "nodes", "list"), ("", "namespaces", "get")}


def test_workers_have_their_own_account_with_no_api_access():
    docs = list(yaml.safe_load_all((REPO / "argo" / "rbac.yaml").read_text()))
    accounts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert set(accounts) == {"jax-recovery", "jax-recovery-worker"}
    assert accounts["jax-recovery-worker"]["automountServiceAccountToken"] is False
    bound = {s["name"] for d in docs if d["kind"].endswith("Binding") for s in d["subjects"]}
    assert bound == {"jax-recovery"}


def test_the_lease_and_the_exit_handler_have_their_verbs_in_the_table():
    uses = {(u.step, u.group, u.resource, u.verb, u.cluster_scoped) for u in STEP_VERBS}
    # The run lease's cluster id (kube-system's uid) and its holder check, wherever the lease is taken.
    for step in ("validate-config", "provision-slice"):
        assert (step, "", "namespaces", "get", True) in uses
        assert (step, "argoproj.io", "workflows", "get", False) in uses
    # The exit handler stops the gang of a run that did not succeed.
    assert {("exit-handler", "jobset.x-k8s.io", "jobsets", v, False) for v in ("list", "delete")} <= uses
    granted = _granted(ROLE_RULES) | _granted(NODE_RULES)
    assert {(g, r, v) for _, g, r, v, _ in uses} <= granted

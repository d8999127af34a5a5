"""Every JobSet and Workflow the build generates is accepted by the real API server: CRD schemas, CEL rules and
the JobSet webhooks, by server-side dry run (nothing is created)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from realcluster import RealCluster
from support.segment import segment_jobset

pytestmark = pytest.mark.k8s

REPO = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted(
    p
    for p in (REPO / "argo").glob("*.yaml")
    if any(d and d.get("kind") == "Workflow" for d in yaml.safe_load_all(p.read_text()))
)
# What Argo substitutes for the inputs of the train-segment template in a first attempt.
INPUTS = {"attempt": "0", "restore-step": "-1", "coordinator-port": "8476", "metrics-port": "9431"}


def _substitute(text: str, wf: dict) -> str:
    params = {p["name"]: str(p.get("value", "")) for p in (wf["spec"].get("arguments") or {}).get("parameters") or []}
    run_id = params["run-id"]
    values = {f"workflow.parameters.{k}": v for k, v in params.items()}
    values |= {f"inputs.parameters.{k}": v for k, v in INPUTS.items()}
    values["inputs.parameters.jobset-name"] = f"{run_id}-a0"

    def one(m: re.Match) -> str:
        key = m.group(1).strip()
        if key not in values:
            raise AssertionError(f"placeholder {{{{{key}}}}} in the train-segment arguments has no value here")
        return values[key]

    return re.sub(r"\{\{([^}]+)\}\}", one, text)


def _jobset_of(wf: dict) -> dict:
    """The JobSet train-segment renders for ``wf`` (from its pinned config), its arguments as Argo gives them."""
    return segment_jobset(wf, lambda text: _substitute(text, wf))


def _ensure_namespace(rc: RealCluster, name: str) -> None:
    rc.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_generated_jobset_is_accepted_and_defaulted_by_the_real_webhooks(real_cluster, path):
    wf = yaml.safe_load(path.read_text())
    manifest = _jobset_of(wf)
    _ensure_namespace(real_cluster, manifest["metadata"]["namespace"])
    stored = real_cluster.apply(manifest, dry_run=True)
    # The JobSet's own defaulting webhook ran (jobset v0.12.0 pkg/webhooks/jobset_webhook.go Default): what the
    # project relies on arrives as the controller will see it.
    rjob = stored["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert rjob["completionMode"] == "Indexed"
    assert rjob["template"]["spec"]["restartPolicy"] == "Never"
    assert stored["spec"]["failurePolicy"]["maxRestarts"] == 0
    assert stored["spec"]["network"]["enableDNSHostnames"] is True
    assert len(rjob["podFailurePolicy"]["rules"]) == len(
        manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    )


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_generated_workflow_is_accepted_by_the_real_apiserver(real_cluster, argo_crds, path):
    wf = yaml.safe_load(path.read_text())
    _ensure_namespace(real_cluster, wf["metadata"]["namespace"])
    stored = real_cluster.apply(wf, dry_run=True)
    assert stored["metadata"]["name"].startswith(wf["metadata"]["generateName"])
    assert [t["name"] for t in stored["spec"]["templates"]] == [t["name"] for t in wf["spec"]["templates"]]


def test_a_jobset_name_over_the_webhook_limit_is_refused_by_the_real_webhook(real_cluster):
    """JobSet's validating webhook refuses a JobSet whose pod names would exceed 63 characters (jobset v0.12.0
    pkg/webhooks/jobset_webhook.go): the limit the run id and attempt number must respect."""
    from kubernetes.client.exceptions import ApiException

    wf = yaml.safe_load((REPO / "argo" / "v5e-4x4.yaml").read_text())
    manifest = _jobset_of(wf)
    _ensure_namespace(real_cluster, manifest["metadata"]["namespace"])
    manifest["metadata"]["name"] = "r" * 45 + "-a1000"
    with pytest.raises(ApiException) as e:
        real_cluster.apply(manifest, dry_run=True)
    body = e.value.body.decode() if isinstance(e.value.body, bytes) else e.value.body
    assert e.value.status == 422 and "63" in body, body

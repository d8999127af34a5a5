"""Every generated manifest against the Argo, JobSet and core Kubernetes schemas, offline and strict."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from support.schemas import argo_errors, core_errors, jobset_errors, substitute
from support.segment import segment_jobset

REPO = Path(__file__).resolve().parents[1]
WORKFLOW_FILES = sorted(p for p in (REPO / "argo").glob("*.yaml") if "\nkind: Workflow\n" in p.read_text())


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _jobset(wf: dict) -> dict:
    """The JobSet train-segment renders for ``wf``, its arguments given realistic values."""
    return segment_jobset(wf, substitute)


def test_every_config_has_a_workflow():
    stems = {p.stem for p in (REPO / "configs").glob("*.yaml")}
    assert stems and stems == {p.stem for p in WORKFLOW_FILES}


@pytest.mark.parametrize("path", WORKFLOW_FILES, ids=lambda p: p.name)
def test_workflow_matches_argo_schema(path):
    assert argo_errors(_load(path)) == []


@pytest.mark.parametrize("path", WORKFLOW_FILES, ids=lambda p: p.name)
def test_jobset_matches_crd_after_substitution(path):
    manifest = _jobset(_load(path))
    assert "{{" not in yaml.safe_dump(manifest)
    assert jobset_errors(manifest) == []


def test_rbac_objects_are_valid_core_objects():
    docs = list(yaml.safe_load_all((REPO / "argo" / "rbac.yaml").read_text()))
    assert {d["kind"] for d in docs} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ClusterRole",
        "ClusterRoleBinding",
        "PriorityClass",
    }
    for d in docs:
        assert core_errors(d) == [], d["kind"]


# Negative cases: a misspelt key must fail each validator, or the checks above prove nothing.


def test_misspelt_key_fails_argo_schema():
    wf = _load(WORKFLOW_FILES[0])
    bad = copy.deepcopy(wf)
    provision = next(t for t in bad["spec"]["templates"] if t["name"] == "provision-slice")
    provision["retryStrategy"]["limitt"] = provision["retryStrategy"].pop("limit")
    errors = argo_errors(bad)
    assert any("limitt" in e for e in errors), errors
    bad = copy.deepcopy(wf)
    bad["spec"]["entrypont"] = bad["spec"].pop("entrypoint")
    assert any("entrypont" in e for e in argo_errors(bad))


def test_argo_schema_accepts_integer_int_or_string_but_rejects_wrong_types():
    wf = _load(WORKFLOW_FILES[0])
    provision = next(t for t in wf["spec"]["templates"] if t["name"] == "provision-slice")
    assert isinstance(provision["retryStrategy"]["limit"], int)
    provision["retryStrategy"]["limit"] = [3]
    assert argo_errors(wf) != []


def test_misspelt_key_fails_jobset_crd():
    manifest = _jobset(_load(WORKFLOW_FILES[0]))
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    job["backofLimit"] = job.pop("backoffLimit")
    errors = jobset_errors(manifest)
    assert any("backofLimit" in e for e in errors), errors
    manifest = _jobset(_load(WORKFLOW_FILES[0]))
    manifest["spec"]["failurePolicy"]["maxRestarts"] = "zero"
    assert jobset_errors(manifest) != []


def test_misspelt_key_fails_core_validation():
    docs = list(yaml.safe_load_all((REPO / "argo" / "rbac.yaml").read_text()))
    role = copy.deepcopy(next(d for d in docs if d["kind"] == "Role"))
    role["rules"][0]["verb"] = role["rules"][0].pop("verbs")
    assert core_errors(role) != []


def test_vendored_schemas_are_the_published_files():
    import hashlib

    from support.schemas import ARGO_SCHEMA, JOBSET_CRD

    expected = {
        ARGO_SCHEMA: "3f84c5722c48a5aa815fe69119a9375fc3635114f8046da20ede55a8596529f5",
        JOBSET_CRD: "d022b87624512cf0b6741b31b24a2bea9945b5a838b50713af29332c878bb6fe",
    }
    for path, sha in expected.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha, f"{path} differs from the published file"

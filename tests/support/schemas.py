"""Offline schema checks for generated manifests: Argo Workflows, JobSet, and core Kubernetes objects.

The schemas are published upstream files, kept unmodified in tests/data/schemas (see their README.txt
files: source, tag, sha256). Each validator is strict: unknown keys are errors, so a misspelt field
fails instead of being silently dropped.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

SCHEMAS = Path(__file__).resolve().parents[1] / "data" / "schemas"
ARGO_SCHEMA = SCHEMAS / "argo" / "argo-workflows-v4.1.2-schema.json"
JOBSET_CRD = SCHEMAS / "k8s" / "jobset.x-k8s.io_jobsets.yaml"
K8S_VERSION = "1.33.0"

# Values that stand in for Argo placeholders when a manifest is checked after substitution.
REALISTIC = {
    "workflow.parameters.run-id": "lm-v5e-4x4",
    "workflow.parameters.store-root": "gs://my-training-bucket/jax-recovery",
    "inputs.parameters.jobset-name": "lm-v5e-4x4-a3",
    "inputs.parameters.attempt": "3",
    "inputs.parameters.restore-step": "1500",
    "inputs.parameters.coordinator-port": "41234",
    "inputs.parameters.metrics-port": "9431",
}
_PLACEHOLDER = re.compile(r"\{\{\s*([^}]+?)\s*\}\}")


def require(path: Path) -> Path:
    """The schema file at ``path`` (a clear failure, not a skip, when it is missing)."""
    if not path.exists():
        pytest.fail(f"schema {path} is missing from the repository")
    return path


def _strict(node: Any) -> None:
    """Set additionalProperties: false on every object schema that lists properties (in place)."""
    if isinstance(node, dict):
        if (
            "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for v in node.values():
            _strict(v)
    elif isinstance(node, list):
        for v in node:
            _strict(v)


@functools.cache
def _argo_registry() -> tuple[Any, str]:
    from referencing import Registry, Resource

    schema = json.loads(require(ARGO_SCHEMA).read_text())
    strict = copy.deepcopy(schema)
    _strict(strict["definitions"])
    # Argo accepts integers where the schema types IntOrString as a string (retryStrategy.limit: 3).
    strict["definitions"]["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] = {"type": ["string", "integer"]}
    resource = Resource.from_contents(strict)
    return Registry().with_resource(strict["$id"], resource), strict["$id"]


def argo_errors(obj: dict[str, Any], kind: str | None = None) -> list[str]:
    """Problems of an Argo object against the strict v4.1.2 schema of its kind (empty: valid)."""
    from jsonschema import Draft202012Validator

    registry, schema_id = _argo_registry()
    kind = kind or obj.get("kind", "Workflow")
    validator = Draft202012Validator(
        {"$ref": f"{schema_id}#/definitions/io.argoproj.workflow.v1alpha1.{kind}"}, registry=registry
    )
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj))


@functools.cache
def _jobset_schema() -> dict[str, Any]:
    crd = yaml.safe_load(require(JOBSET_CRD).read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2")
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    _strict(schema)
    return schema


def jobset_errors(obj: dict[str, Any]) -> list[str]:
    """Problems of a JobSet manifest (placeholders already substituted) against the v1alpha2 CRD schema."""
    from jsonschema import Draft7Validator

    validator = Draft7Validator(_jobset_schema())
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj))


def core_errors(obj: dict[str, Any]) -> list[str]:
    """Problems of a core Kubernetes object (kubernetes-validate, strict: unknown keys are errors)."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'/'.join(map(str, e.path))}: {e.message}"]
    return []


def substitute(text: str, values: dict[str, str] | None = None) -> str:
    """Replace every ``{{name}}`` placeholder by a realistic value; an unknown placeholder is an error."""
    values = {**REALISTIC, **(values or {})}

    def repl(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in values:
            raise KeyError(f"no realistic value for placeholder {{{{{key}}}}}")
        return values[key]

    return _PLACEHOLDER.sub(repl, text)

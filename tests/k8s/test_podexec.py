"""The process kubelet's readings of Argo's pod layout and executor rules (argo-workflows v4.0.5): the emissary
command prefix (``workflow/controller/workflowpod.go``), output parameters as ``SaveParameters`` saves them
(``workflow/executor/executor.go``: one trailing newline trimmed, a default for a missing file, the first missing
file without one is an error and ends the saving), the downward-API fields Argo and JobSet pods use."""

from __future__ import annotations

import sys

import pytest
from podexec import field_value, main_command, main_container, mount_points, mounts_token, save_parameters

pytestmark = pytest.mark.k8s

POD = {
    "metadata": {
        "name": "wf-train-segment-1",
        "namespace": "training",
        "uid": "u-1",
        "annotations": {"batch.kubernetes.io/job-completion-index": "3"},
        "labels": {"app": "x"},
    },
    "spec": {"nodeName": "argo-steps", "serviceAccountName": "jax-recovery"},
}


@pytest.mark.parametrize(
    ("container", "argv"),
    [
        (
            {"command": ["/var/run/argo/argoexec", "emissary", "--loglevel", "info", "--", "python", "-m", "m"],
             "args": ["--a", "1"]},
            [sys.executable, "-m", "m", "--a", "1"],
        ),
        ({"command": ["python3", "-c", "pass"]}, [sys.executable, "-c", "pass"]),
        ({"command": ["/bin/true"], "args": ["--"]}, ["/bin/true", "--"]),  # no emissary prefix: taken as it is
    ],
)  # fmt: skip
def test_the_main_command_is_what_follows_the_emissary_prefix(container, argv):
    assert main_command(container) == argv


def test_output_parameters_are_saved_as_argo_saves_them(tmp_path):
    (tmp_path / "tmp/outputs").mkdir(parents=True)
    (tmp_path / "tmp/outputs/a").write_text("one\n\n")
    (tmp_path / "tmp/outputs/b").write_text("two")
    template = {
        "outputs": {
            "parameters": [
                {"name": "a", "valueFrom": {"path": "/tmp/outputs/a"}},
                {"name": "b", "valueFrom": {"path": "/tmp/outputs/b"}},
                {"name": "c", "valueFrom": {"path": "/tmp/outputs/c", "default": "dflt"}},
                {"name": "d", "valueFrom": {"path": "/tmp/outputs/d"}},
                {"name": "e", "valueFrom": {"path": "/tmp/outputs/b"}},
            ]
        }
    }
    params, error = save_parameters(template, tmp_path)
    assert [p.get("value") for p in params] == ["one\n", "two", "dflt", None, None]  # saving stops at d
    assert error == "open /tmp/outputs/d: no such file or directory"
    assert mount_points(template) == ["/tmp/outputs"]


def test_downward_api_fields(tmp_path):
    assert field_value(POD, "metadata.annotations['batch.kubernetes.io/job-completion-index']") == "3"
    assert field_value(POD, "metadata.labels['app']") == "x"
    assert field_value(POD, "metadata.name") == "wf-train-segment-1"
    assert field_value(POD, "spec.serviceAccountName") == "jax-recovery"
    with pytest.raises(ValueError, match="status.podIPs"):
        field_value(POD, "status.podIPs")


@pytest.mark.parametrize(
    ("containers", "main"),
    [
        ([{"name": "wait"}, {"name": "main"}], "main"),  # an Argo step pod: its main container, not the wait sidecar
        ([{"name": "trainer"}], "trainer"),  # a JobSet worker: its only container
    ],
)
def test_the_container_run_is_argos_main_else_the_pods_only_one(containers, main):
    assert main_container({"spec": {"containers": containers}})["name"] == main


@pytest.mark.parametrize(
    ("volumes", "mounted"),
    [
        ([{"name": "kube-api-access-x", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}], True),
        ([{"name": "data", "emptyDir": {}}], False),  # automountServiceAccountToken: false (the workers' account)
        (None, False),
    ],
)  # fmt: skip
def test_a_token_is_given_only_when_admission_mounted_one(volumes, mounted):
    assert mounts_token({"spec": {"volumes": volumes}}) is mounted

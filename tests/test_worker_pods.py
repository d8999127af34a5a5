"""Worker pods: CPU and memory requests from the TPU table (not BestEffort), overridable; their account; the agent."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jaxrec.model.config import parse_config
from jaxrec.model.jobset import JobSetParams, jobset_manifest
from jaxrec.model.tpu import TPU_TYPES

REPO = Path(__file__).resolve().parents[1]
TPU_CONFIGS = ["v5e-4x4.yaml", "v5p-64.yaml", "v6e-8x8.yaml"]


def _pod(cfg):
    js = jobset_manifest(
        cfg,
        JobSetParams(
            name="r-a0",
            run_id="r",
            store_root="gs://b/p",
            attempt="0",
            restore_step="-1",
            coordinator_port="8476",
            metrics_port="9431",
        ),
    )
    return js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _data(name):
    return yaml.safe_load((REPO / "configs" / name).read_text())


def _qos(pod) -> str:
    """The QoS class Kubernetes gives the pod (docs "Pod Quality of Service Classes"; extended resources ignored)."""
    (c,) = pod["containers"]
    req = {k: v for k, v in c.get("resources", {}).get("requests", {}).items() if k in ("cpu", "memory")}
    lim = {k: v for k, v in c.get("resources", {}).get("limits", {}).items() if k in ("cpu", "memory")}
    if not req and not lim:
        return "BestEffort"
    return "Guaranteed" if req == lim and set(req) == {"cpu", "memory"} else "Burstable"


@pytest.mark.parametrize("name", TPU_CONFIGS)
def test_tpu_workers_request_cpu_and_memory_from_the_tpu_table(name):
    cfg = parse_config(_data(name))
    pod = _pod(cfg)
    vm = TPU_TYPES[cfg.slice.accelerator].vm(cfg.slice.topology)
    req = pod["containers"][0]["resources"]["requests"]
    assert req["cpu"] == f"{int(vm.vcpus * 0.8)}" and req["memory"] == f"{int(vm.memory_gib * 0.8)}Gi"
    assert 0 < float(req["cpu"]) < vm.vcpus
    assert req["google.com/tpu"] == vm.chips
    assert _qos(pod) != "BestEffort"
    assert pod["serviceAccountName"] == cfg.worker_service_account != cfg.service_account


def test_requests_are_overridable_in_the_config():
    data = _data("v5e-4x4.yaml")
    data["slice"].update(worker_cpu=40, worker_memory_gib=96.5)
    req = _pod(parse_config(data))["containers"][0]["resources"]["requests"]
    assert (req["cpu"], req["memory"]) == ("40", "96.5Gi")


def test_local_workers_request_nothing():
    pod = _pod(parse_config(_data("local-cpu.yaml")))
    assert "resources" not in pod["containers"][0]


@pytest.mark.parametrize("name", TPU_CONFIGS)
def test_a_preferred_pool_is_a_node_affinity_preference_the_jobset_crd_takes(name):
    """The pool the last attempt left healthy is preferred, never required (another pool serves when it is full);
    no pool, no affinity (JobSet's exclusive placement adds its own pod affinities to the leader)."""
    from dataclasses import replace

    from support.schemas import jobset_errors

    cfg = parse_config(_data(name))
    params = JobSetParams("r-a1", "r", "gs://b/p", "1", "10", "8476", "9431")
    assert "affinity" not in _spec(jobset_manifest(cfg, params))
    js = jobset_manifest(cfg, replace(params, prefer_pool="tpu-pool-b"))
    node = _spec(js)["affinity"]["nodeAffinity"]
    assert set(node) == {"preferredDuringSchedulingIgnoredDuringExecution"}
    (term,) = node["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["preference"]["matchExpressions"] == [
        {"key": "cloud.google.com/gke-nodepool", "operator": "In", "values": ["tpu-pool-b"]}
    ]
    assert jobset_errors(js) == []
    # Level 2: any pool but the one that failed the last attempt is preferred, still nothing required.
    js = jobset_manifest(cfg, replace(params, avoid_pool="tpu-pool-a"))
    (term,) = _spec(js)["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["preference"]["matchExpressions"] == [
        {"key": "cloud.google.com/gke-nodepool", "operator": "NotIn", "values": ["tpu-pool-a"]}
    ]
    assert jobset_errors(js) == []


def _spec(js):
    return js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize(("standby", "flags"), [(True, []), (False, ["--no-standby"])])
def test_the_agent_runs_the_trainer_with_or_without_a_standby_as_the_config_says(standby, flags):
    data = _data("v5e-4x4.yaml")
    data["retry"]["in_place_standby"] = standby
    (c,) = _pod(parse_config(data))["containers"]
    assert c["command"] == ["python", "-m", "trainer.agent"]
    assert c["args"][: c["args"].index("--")] == ["--hold-s", "60", *flags]
    data["retry"]["in_place_budget"] = 0  # no restart in place: no agent, the trainer is the container's process
    (c,) = _pod(parse_config(data))["containers"]
    assert c["command"] == ["python", "-m", "trainer"] and "--no-standby" not in c["args"]

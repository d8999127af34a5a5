"""The JobSet manifest of one training segment (the gang of workers), as train-segment creates it.

The step renders it when it runs, from the run's pinned config and the attempt's parameters (its arguments): the
Workflow carries the parameters, not the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxrec.model.config import JobConfig
from jaxrec.model.contract import EXIT_CODES, FailureClass
from jaxrec.model.names import (
    ATTEMPT_LABEL,
    JOBSET_GROUP,
    JOBSET_VERSION,
    NODEPOOL_LABEL,
    RUN_ID_LABEL,
    SPOT_LABEL,
    TPU_RESOURCE,
    gke_node_selector,
)

REPLICATED_JOB = "workers"
CONTAINER = "trainer"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
COMPLETION_INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def pod_failure_policy() -> dict[str, Any]:
    """The Job ``podFailurePolicy``: one FailJob rule per trainer exit code, then disruptions.

    One rule per code (in the order of the exit-code table) makes the Job's failure message name
    the rule index, which ``classify-failure`` can read back as evidence.
    """
    rules: list[dict[str, Any]] = [
        {
            "action": row.pod_failure_action,
            "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [int(row.code)]},
        }
        for row in EXIT_CODES
        if row.pod_failure_action is not None
    ]
    # A pod evicted or preempted (node drain, Spot reclaim, maintenance) ends the whole attempt too:
    # "Ignore" would let the Job recreate one worker into a gang that cannot take it back.
    rules.append({"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]})
    return {"rules": rules}


def _on_tpu_nodes(cfg: JobConfig, container: dict[str, Any], pod_spec: dict[str, Any]) -> None:
    """Put the worker on the slice's TPU nodes: its chips, its metrics port, the node selector and tolerations."""
    sl = cfg.slice
    chips = sl.devices_per_process
    container["ports"] = [{"name": "metrics", "containerPort": cfg.monitoring.metrics_port}]
    # CPU and memory requests keep the workers out of BestEffort (extended resources such as google.com/tpu
    # do not count for QoS; Kubernetes docs "Pod Quality of Service Classes"), so node memory pressure evicts
    # other pods first. No CPU limit: CFS throttling would slow the input pipeline.
    requests: dict[str, Any] = {**sl.worker_requests(), TPU_RESOURCE: chips}
    container["resources"] = {"requests": requests, "limits": {TPU_RESOURCE: chips}}
    pod_spec["nodeSelector"] = gke_node_selector(sl)
    tolerations = [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    if sl.spot:
        tolerations.append({"key": SPOT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
    pod_spec["tolerations"] = tolerations


def _local_tier(cfg: JobConfig, container: dict[str, Any], pod_spec: dict[str, Any]) -> None:
    """The host-local checkpoint directory (the node's, surviving the pod) and what the peers need to find each other.

    A ``hostPath`` directory outlives the pod and the JobSet's recreation of it, as the local tier needs; an
    ``emptyDir`` dies with the pod (Kubernetes docs "Volumes"). GKE's Multi-Tier Checkpointing CSI volume
    (``multitier-checkpoint.csi.storage.gke.io``) would serve too, but comes with its own replicator and is
    multislice-only (docs/CHECKPOINTS.md). ``NODE_NAME`` names where a part was written, ``POD_IP`` is where
    this worker's part server listens for its peers.
    """
    lt = cfg.checkpoint.local
    container["env"] += [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if cfg.slice.is_cpu:  # one machine: each worker is given its node's directory (TRAINER_LOCAL_DIR)
        return
    container["volumeMounts"] = [{"name": "jaxrec-local", "mountPath": lt.directory}]
    pod_spec["volumes"] = [{"name": "jaxrec-local", "hostPath": {"path": lt.host_path, "type": "DirectoryOrCreate"}}]


SHARED_PROCESS_NAMESPACE = True
"""Worker pods share their process namespace: the pod's pause process is PID 1 and the trainer an ordinary process
(kubernetes.io/docs/tasks/configure-pod-container/share-process-namespace: "Container processes no longer have PID
1"), so that the drill's kill-worker can SIGKILL it from an exec (the kernel drops signals sent from inside a PID
namespace to its init unless the init handles them, SIGKILL included) and the trainer's test hooks that SIGKILL
their own process work. What else changes, per that page: the pod's processes, their /proc entries (arguments,
environment) and filesystems (/proc/<pid>/root) are visible to its other containers (a worker has one), and
``kill -HUP 1`` reaches the pause process. And the trainer gets the default action of every signal it does not
handle: a SIGTERM before its handler is installed ends it at once (exit 143), where as PID 1 it would be ignored
until the SIGKILL after the grace period (137)."""


def pool_affinity(pool: str, *, avoid: bool = False) -> dict[str, Any]:
    """A pod affinity that prefers ``pool``'s nodes (``avoid``: any other pool's) and requires nothing.

    Another pool serves when the preferred ones are full, and ``pool`` itself when no other has room.

    JobSet's exclusive placement keeps it: its pod webhook adds the pod (anti-)affinity terms to the leader's
    ``affinity`` and leaves its node affinity (kubernetes-sigs/jobset ``pkg/webhooks/pod_mutating_webhook.go``,
    ``setExclusiveAffinities``); the followers go to the leader's pool.
    """
    term = {"key": NODEPOOL_LABEL, "operator": "NotIn" if avoid else "In", "values": [pool]}
    preferred = [{"weight": 100, "preference": {"matchExpressions": [term]}}]
    return {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": preferred}}


@dataclass(frozen=True)
class Placement:
    """Where the next attempt's gang asks to run: the infrastructure rungs of the recovery ladder.

    Level 1 recreates the JobSet preferring the pool the last attempt left healthy, where its hosts' local
    checkpoint parts and caches are. Level 2 asks for other hosts: it prefers any pool but the one whose node
    failed or was reclaimed under the last attempt, or where attempts keep failing (``SAME_POOL_TRIES``), so a
    spare slice serves at once where that one's repair or reclaim takes minutes. Both are preferences
    (``pool_affinity``): the one pool there is serves either way.
    """

    level: int
    prefer: str = ""
    avoid: str = ""
    why: str = ""


SAME_POOL_TRIES = 2
"""Failed attempts in a row on one node pool, of a class a host may cause and none advancing the checkpoint, after
which the next gang leaves that pool (level 1 escalates to level 2): a host that fails without ever looking
unhealthy (a chip that errs, a link that drops) fails its gang every time the gang returns to it."""
HOST_SUSPECT = frozenset({FailureClass.INFRASTRUCTURE, FailureClass.HANG, FailureClass.UNKNOWN})
"""The classes a failing host may cause while its node looks healthy."""


def placement(
    last_class: FailureClass | None, last_pool: str | None, healthy: bool | None, failed_here: int = 0
) -> Placement:
    """The placement after an attempt of class ``last_class`` that ran on ``last_pool`` (``snapshot.gang_pool``).

    A preempted attempt, or one whose supervisor last saw a host of it lost, cordoned or under notice (``healthy``
    False), goes to level 2, as does the ``SAME_POOL_TRIES``-th attempt in a row to fail on one pool without
    progress (``failed_here``, counted over ``HOST_SUSPECT`` failures). Any other goes to level 1: on its pool when
    each of its hosts was seen healthy, with no preference when that is not known or there is no one known pool.
    """
    if last_pool is None:
        return Placement(1, why="the last attempt ran on no one known node pool: no pool preferred")
    if last_class == FailureClass.PREEMPTION or healthy is False:
        what = "was preempted" if last_class == FailureClass.PREEMPTION else "lost or drained a host"
        return Placement(2, avoid=last_pool, why=f"the last attempt {what} on node pool {last_pool}: others preferred")
    if failed_here >= SAME_POOL_TRIES:
        why = f"{failed_here} attempts in a row failed on node pool {last_pool} without the checkpoint advancing"
        return Placement(2, avoid=last_pool, why=f"{why}: others preferred")
    if healthy is None:
        return Placement(1, why=f"not every host of the last attempt on node pool {last_pool} was seen: none preferred")
    return Placement(1, prefer=last_pool, why=f"the last attempt left node pool {last_pool} healthy: it is preferred")


IN_PLACE_CLASSES = frozenset(
    {FailureClass.APPLICATION, FailureClass.HANG, FailureClass.INFRASTRUCTURE, FailureClass.UNKNOWN}
)
"""The classes a restart in place (level 0) may answer: an error in the program, a hang, a killed process, a lost
peer. Preemption and capacity are the platform's (the hosts go), configuration is refused by every level alike."""


@dataclass(frozen=True)
class InPlace:
    """What level 0 needs known at the failure: only the segment's supervisor, beside the running gang, knows it.

    Attributes:
        running: Every worker's pod still runs its agent: only trainers ended (a pod that failed, a node lost,
            a gang without agents cannot restart in place).
        row: Restarts in place in a row, the last ones of the run, that did not advance the checkpoint.
        left: Restarts in place the run's budget still allows (``retry.in_place_budget`` less those done).
        tries: ``retry.in_place_tries``.
    """

    running: bool
    row: int
    left: int
    tries: int


def ladder(
    last_class: FailureClass | None,
    last_pool: str | None,
    healthy: bool | None,
    failed_here: int = 0,
    in_place: InPlace | None = None,
) -> Placement:
    """The recovery ladder's rung after a failure of class ``last_class``: one decision for the three levels.

    Level 0 (restart every trainer in its pod) when ``in_place`` says the gang still runs, every host was seen
    healthy, the class is one of ``IN_PLACE_CLASSES``, and neither the budget nor ``tries`` restarts in a row
    without progress are spent; else ``placement`` (level 1 or 2), saying why level 0 was not taken. ``in_place``
    None: the gang is gone (a new segment places its gang).
    """
    if in_place is None:
        return placement(last_class, last_pool, healthy, failed_here)
    if not in_place.running:
        no = "a worker's pod ended with its trainer"
    elif healthy is not True:
        no = "a host of the gang is lost, drained or not seen" if healthy is False else "not every host was seen"
    elif last_class not in IN_PLACE_CLASSES:
        no = f"a {last_class.value if last_class else 'unclassified'} failure is not restarted in place"
    elif in_place.left <= 0:
        no = "the run's restarts in place (retry.in_place_budget) are spent"
    elif in_place.row >= in_place.tries:
        no = f"{in_place.row} restarts in place in a row did not advance the checkpoint"
    else:
        return Placement(0, why=f"every host is healthy: the trainers restart in their pods ({in_place.left} left)")
    p = placement(last_class, last_pool, healthy, failed_here)
    return Placement(p.level, p.prefer, p.avoid, f"{no}; {p.why}")


@dataclass(frozen=True)
class JobSetParams:
    """The values one attempt's JobSet is rendered with.

    train-segment gives the values of its arguments (``train_segment.segment_params``); tests pass realistic
    values to validate the result against the JobSet CRD.

    Attributes:
        name: JobSet name (``<run-id>-a<attempt>``, from provision-slice).
        restore_step: Step every worker restores (``-1``: fresh start).
        coordinator_port: Local backend: the JAX coordinator port.
        metrics_port: Port of worker 0's metrics endpoint (local workers add their index).
        prefer_pool: A GKE node pool the gang prefers (``""``: none): the one the run's last attempt left healthy.
        avoid_pool: A GKE node pool the gang prefers not to use (``""``: none): the one whose node failed the last
            attempt or was reclaimed under it, or where attempts keep failing.
    """

    name: str
    run_id: str
    store_root: str
    attempt: str
    restore_step: str
    coordinator_port: str
    metrics_port: str
    prefer_pool: str = ""
    avoid_pool: str = ""


def jobset_manifest(cfg: JobConfig, params: JobSetParams) -> dict[str, Any]:
    """The JobSet of one attempt, rendered from the job config and ``params``, as a plain dict (stable key order)."""
    sl, hosts = cfg.slice, cfg.slice.num_hosts
    labels = {RUN_ID_LABEL: params.run_id, ATTEMPT_LABEL: params.attempt}
    env: list[dict[str, Any]] = [
        {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX_FIELD}}}
    ]
    flags = {
        "--store-root": params.store_root,
        "--run-id": params.run_id,
        "--attempt": params.attempt,
        "--restore-step": params.restore_step,
        "--metrics-port": params.metrics_port,
    }
    args = [arg for flag in flags.items() for arg in flag]
    command = ["python", "-m", "trainer"]
    if cfg.retry.in_place_budget > 0:  # level 0: the agent runs the trainer and restarts it in place on order
        own = ["--hold-s", f"{cfg.retry.in_place_hold_s:g}", *([] if cfg.retry.in_place_standby else ["--no-standby"])]
        command, args = ["python", "-m", "trainer.agent"], [*own, "--", *args]
    container: dict[str, Any] = {"name": CONTAINER, "image": cfg.image, "command": command, "args": args, "env": env}
    pod_spec: dict[str, Any] = {
        # The workers' own account: no Kubernetes API access, only the bucket through Workload Identity.
        "serviceAccountName": cfg.worker_service_account,
        "restartPolicy": "Never",
        # SIGTERM to SIGKILL when the pod is deleted (JobSet teardown, eviction); a node shutdown may give less
        # (slice.shutdown_window_s, which the trainer budgets its save on; GKE docs "Spot VMs").
        "terminationGracePeriodSeconds": sl.termination_grace_s,
        # The pause process is PID 1, the trainer an ordinary process (SHARED_PROCESS_NAMESPACE says why).
        "shareProcessNamespace": SHARED_PROCESS_NAMESPACE,
        "containers": [container],
    }
    jobset_meta: dict[str, Any] = {"name": params.name, "namespace": cfg.namespace, "labels": labels}
    if cfg.checkpoint.local.enabled:
        _local_tier(cfg, container, pod_spec)
    if sl.is_cpu:
        env += [
            {"name": "TRAINER_COORDINATOR_ADDRESS", "value": f"127.0.0.1:{params.coordinator_port}"},
            {"name": "TRAINER_NUM_PROCESSES", "value": str(hosts)},
        ]
        if sl.local_devices == "cpu":  # else JAX finds this machine's own accelerator
            env.append({"name": "JAX_PLATFORMS", "value": "cpu"})
    else:
        _on_tpu_nodes(cfg, container, pod_spec)
        jobset_meta["annotations"] = {EXCLUSIVE_TOPOLOGY: NODEPOOL_LABEL}
    # A preference on any nodes: on CPU hosts without the pool label, NotIn matches every node and In none.
    if params.prefer_pool or params.avoid_pool:
        pod_spec["affinity"] = pool_affinity(params.prefer_pool or params.avoid_pool, avoid=not params.prefer_pool)
    return _jobset(jobset_meta, hosts, {"metadata": {"labels": dict(labels)}, "spec": pod_spec})


def _jobset(meta: dict[str, Any], hosts: int, pod_template: dict[str, Any]) -> dict[str, Any]:
    """One replicated Job of ``hosts`` indexed pods that fails as a whole: the gang."""
    job_spec = {
        "parallelism": hosts,
        "completions": hosts,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "podFailurePolicy": pod_failure_policy(),
        "template": pod_template,
    }
    return {
        "apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}",
        "kind": "JobSet",
        "metadata": meta,
        "spec": {
            "failurePolicy": {"maxRestarts": 0},
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job_spec}}],
        },
    }

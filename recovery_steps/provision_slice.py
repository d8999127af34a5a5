"""``provision-slice``: clear what earlier attempts left behind and check that the slice can take the gang.

Every slice: delete the run's old JobSets through the Kubernetes API and wait until their pods are gone. A TPU
slice: check its nodes. The CPU slice: pick free ports.

Exit codes: 0 ready; 75 capacity not there yet (Argo retries with backoff); 2 configuration
(the run has no validated config, RBAC or the JobSet CRD missing: retrying cannot help). Zero matching nodes
counts as ready unless ``--require-nodes`` (docs/DEPLOY.md: autoscaled TPU pools scale from zero).

Destructive acts and their evidence: it deletes JobSets labelled with the run id and no others: a finished one,
and a live one of an earlier attempt that a supervisor decided or the ledger closed (both read from the step's
``--store-root``). A live gang of an earlier attempt that nothing decided is refused (exit 2, named, with the
command that deletes it by hand): it may be healthy work. This attempt's live JobSet is kept for train-segment to
re-attach. The run lease is renewed for this Workflow before anything is deleted (another live holder: exit 2,
nothing touched); a JobSet list or store read that fails ends the step (69 or 1) with nothing deleted.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from jaxrec.adapters import cli
from jaxrec.adapters.kube import Kube, delete_run_jobsets
from jaxrec.adapters.store import AttemptRef, RunLayout, RunStore
from jaxrec.model.config import JobConfig
from jaxrec.model.contract import ExitCode
from jaxrec.model.names import (
    ACTIVE_MAINTENANCE_LABEL,
    ATTEMPT_LABEL,
    JOBSET_NAME_LABEL,
    RUN_ID_LABEL,
    SCHEDULED_MAINTENANCE_LABEL,
    SPOT_LABEL,
    TPU_RESOURCE,
    gke_node_selector,
    jobset_name,
)
from jaxrec.model.outputs import ProvisionOutputs
from jaxrec.model.records import ProvisionRecord, now
from jaxrec.model.snapshot import NodeEvidence, PodPhase, node_from_api
from recovery_steps import lease
from recovery_steps.step import Step, StepError, api_error, api_failures, k8s_client, load_run_config

log = logging.getLogger(__name__)

GKE_COORDINATOR_PORT = 8476
# The label GKE sets on a node while host maintenance runs: a value other than these means "active".
_INACTIVE = {"", "false", "none", "0"}


# --- the node check: pure ---------------------------------------------------------------------


@dataclass(frozen=True)
class SlicePolicy:
    """What the node check requires beyond health: chips per host and the maintenance window."""

    chips_per_host: int = 0
    now: float = 0.0
    maintenance_window_s: float = 0.0
    wait_for_maintenance: bool = True


@dataclass(frozen=True)
class ProvisionOptions:
    """How provision-slice clears and checks the slice.

    ``require_nodes``: zero matching nodes is a capacity problem (``--require-nodes``); ``pod_timeout_s``: how long
    old worker pods are waited for (``--pod-timeout``).
    """

    require_nodes: bool = False
    pod_timeout_s: float = 300


def maintenance_due(node: NodeEvidence, policy: SlicePolicy) -> str | None:
    """Why ``node``'s scheduled maintenance rules it out now, or None.

    GKE sets ``cloud.google.com/scheduled-maintenance-time`` to the epoch seconds of the scheduled start (GKE docs
    "Handle disruption for GPU and TPU nodes"); a time already past still means maintenance is imminent.
    """
    value = node.labels.get(SCHEDULED_MAINTENANCE_LABEL)
    if value is None or not policy.wait_for_maintenance:
        return None
    try:
        at = float(value)
    except ValueError:
        return f"scheduled maintenance ({SCHEDULED_MAINTENANCE_LABEL}={value})"
    if at - policy.now <= policy.maintenance_window_s:
        minutes = max(0, int((at - policy.now) // 60))
        return f"maintenance scheduled in {minutes} min (within {int(policy.maintenance_window_s)} s)"
    return None


@dataclass(frozen=True)
class SliceCheck:
    """The verdict of the node check."""

    ok: bool
    reason: str


def node_problems(
    node: NodeEvidence, tolerated: Sequence[str], policy: SlicePolicy | None = None, other_runs: Sequence[str] = ()
) -> list[str]:
    """Why ``node`` cannot run a worker now (empty: healthy).

    ``tolerated``: taint keys the workers tolerate (GKE's ``google.com/tpu`` taint, Spot); ``policy``: chips each
    worker needs and the maintenance window (None: health only); ``other_runs``: the other runs whose live worker
    pods sit on the node (with ``policy``).
    """
    problems = []
    if node.ready is not True:
        problems.append("not Ready")
    if node.unschedulable:
        problems.append("cordoned")
    for key, effect in node.taint_effects:
        if effect in ("NoSchedule", "NoExecute") and key not in tolerated:
            problems.append(f"taint {key}:{effect}")
    value = node.labels.get(ACTIVE_MAINTENANCE_LABEL)
    if value is not None and value.lower() not in _INACTIVE:
        problems.append(f"under maintenance ({ACTIVE_MAINTENANCE_LABEL}={value})")
    if policy is not None:
        if node.allocatable_tpu is not None and node.allocatable_tpu < policy.chips_per_host:
            problems.append(f"allocatable {TPU_RESOURCE} {node.allocatable_tpu} < {policy.chips_per_host}")
        if other_runs:
            problems.append(f"running pods of run(s) {', '.join(sorted(set(other_runs)))}")
        due = maintenance_due(node, policy)
        if due:
            problems.append(due)
    return problems


def check_slice(
    nodes: Sequence[NodeEvidence],
    hosts: int,
    tolerated: Sequence[str],
    *,
    require_nodes: bool,
    policy: SlicePolicy | None = None,
    other_runs: Mapping[str, Sequence[str]] | None = None,
) -> SliceCheck:
    """Decide whether the matching nodes can host a gang of ``hosts`` workers.

    Nodes are grouped by node pool (the exclusive-topology unit): one pool with ``hosts`` healthy
    nodes is enough. No nodes at all is accepted unless ``require_nodes`` (autoscaled pools
    scale up from zero for the pending pods). ``other_runs``: by node name, the other runs on it.
    """
    if not nodes:
        if require_nodes:
            return SliceCheck(False, "no nodes match the slice's selectors")
        return SliceCheck(True, "no nodes yet; the node pool scales up for the pending workers")

    def problems(n: NodeEvidence) -> list[str]:
        return node_problems(n, tolerated, policy, (other_runs or {}).get(n.name, ()))

    pools: dict[str, list[NodeEvidence]] = {}
    for n in nodes:
        pools.setdefault(n.pool or "<none>", []).append(n)
    details = []
    for pool, members in sorted(pools.items()):
        healthy = [n for n in members if not problems(n)]
        if len(healthy) >= hosts:
            return SliceCheck(True, f"node pool {pool}: {len(healthy)} healthy nodes for {hosts} hosts")
        bad = [f"{n.name} {', '.join(problems(n))}" for n in members if problems(n)]
        details.append(f"node pool {pool}: {len(healthy)}/{hosts} healthy" + (f" ({'; '.join(bad)})" if bad else ""))
    return SliceCheck(False, "; ".join(details))


# --- Kubernetes adapters --------------------------------------------------------------------------


def unsupervised_gang(store: RunStore, attempt: int) -> Callable[[dict[str, Any]], bool]:
    """``keep`` for delete_run_jobsets: never delete a live gang that no supervisor has decided.

    A running JobSet of this very attempt (a resubmitted run continues at the attempt its lost Workflow left
    unclosed) is kept: train-segment re-attaches to it. A running JobSet of an earlier attempt that is neither
    decided by a supervisor nor closed in the ledger is a gang nothing watches: StepError (configuration),
    naming it, instead of killing what may be healthy work.
    """
    from jaxrec.model.snapshot import jobset_from_api
    from recovery_steps.attempts import left_open

    def keep(obj: dict[str, Any]) -> bool:
        if jobset_from_api(obj).finished:
            return False
        meta = obj.get("metadata") or {}
        label = (meta.get("labels") or {}).get(ATTEMPT_LABEL, "")
        if not label.isdigit():
            return False
        k = int(label)
        if k == attempt:
            log.info("JobSet %s of this attempt is running: kept for train-segment to re-attach", meta.get("name"))
            return True
        if not left_open(store, k):
            return False
        raise StepError(
            ExitCode.CONFIGURATION,
            f"JobSet {meta.get('name')} of attempt {k} is running and no supervisor decided it nor was the attempt "
            f"closed: not deleting what may be healthy work. If nothing supervises it, delete it "
            f"(kubectl -n {meta.get('namespace')} delete jobset {meta.get('name')}) and resubmit",
        )

    return keep


def wait_pods_gone(
    api_client: Any, namespace: str, run_id: str, *, timeout_s: float, poll_s: float = 2.0, keep: Sequence[str] = ()
) -> None:
    """Wait until no worker pod of the run is left but those of the ``keep`` JobSets.

    Raises:
        StepError: (capacity) on timeout.
    """
    kube = Kube(api_client, namespace)
    selector = f"{RUN_ID_LABEL}={run_id},{JOBSET_NAME_LABEL}"
    if keep:
        selector += f",{JOBSET_NAME_LABEL} notin ({','.join(keep)})"
    deadline = time.monotonic() + timeout_s
    while True:
        pods = kube.list_pods_where(selector)
        if not pods:
            return
        if time.monotonic() >= deadline:
            names = ", ".join(sorted(p["metadata"]["name"] for p in pods))
            raise StepError(ExitCode.CAPACITY, f"worker pods of earlier attempts still present: {names}")
        time.sleep(poll_s)


def list_slice_nodes(api_client: Any, selector: dict[str, str]) -> list[NodeEvidence]:
    """Nodes that carry every label of ``selector``."""
    label_selector = ",".join(f"{k}={v}" for k, v in selector.items())
    return [node_from_api(n) for n in Kube(api_client, "").list_nodes(label_selector)]


def other_runs_by_node(api_client: Any, namespace: str, run_id: str) -> dict[str, list[str]]:
    """By node name, the other runs whose live worker pods (of this namespace) sit on it.

    Only the run's namespace is read (the Role's pods list); another namespace's pods hold their TPUs through the
    scheduler's accounting, which the allocatable check cannot see: those show as Pending pods (capacity).
    """
    pods = Kube(api_client, namespace).list_pods_where(f"{RUN_ID_LABEL},{RUN_ID_LABEL}!={run_id}")
    by_node: dict[str, list[str]] = {}
    for p in pods:
        node = (p.get("spec") or {}).get("nodeName")
        phase = (p.get("status") or {}).get("phase")
        if node and phase not in (PodPhase.SUCCEEDED, PodPhase.FAILED):
            by_node.setdefault(node, []).append(((p.get("metadata") or {}).get("labels") or {}).get(RUN_ID_LABEL, "?"))
    return by_node


def clear_old_gangs(cfg: JobConfig, attempt: int, store: RunStore, api_client: Any, *, pod_timeout_s: float) -> None:
    """Delete the run's finished or decided JobSets and wait for their pods to go (this attempt's live one kept).

    What is decided is read from ``store``, the step's own ``--store-root`` (the pinned config names the file's
    root, which ``-p store-root=`` overrides: read there, every earlier gang would look undecided).
    """
    _, _, kept = delete_run_jobsets(api_client, cfg.namespace, cfg.run_id, unsupervised_gang(store, attempt))
    wait_pods_gone(api_client, cfg.namespace, cfg.run_id, timeout_s=pod_timeout_s, keep=kept)


def provision_gke(
    cfg: JobConfig,
    attempt: int,
    api_client: Any,
    *,
    store: RunStore,
    options: ProvisionOptions = ProvisionOptions(),
    clock: Callable[[], float] = time.time,
) -> ProvisionOutputs:
    """The GKE backend: clear old JobSets, check the nodes, return the outputs."""
    try:
        clear_old_gangs(cfg, attempt, store, api_client, pod_timeout_s=options.pod_timeout_s)
        nodes = list_slice_nodes(api_client, gke_node_selector(cfg.slice))
        others = other_runs_by_node(api_client, cfg.namespace, cfg.run_id)
    except api_failures() as e:
        raise api_error(e) from None
    tolerated = [TPU_RESOURCE] + ([SPOT_LABEL] if cfg.slice.spot else [])
    policy = SlicePolicy(
        chips_per_host=cfg.slice.devices_per_process,
        now=clock(),
        maintenance_window_s=cfg.slice.maintenance_window_s,
        wait_for_maintenance=cfg.slice.on_scheduled_maintenance == "wait",
    )
    verdict = check_slice(
        nodes, cfg.slice.num_hosts, tolerated, require_nodes=options.require_nodes, policy=policy, other_runs=others
    )
    if not verdict.ok:
        raise StepError(ExitCode.CAPACITY, f"slice not ready: {verdict.reason}")
    log.info("slice ready: %s", verdict.reason)
    return ProvisionOutputs(
        jobset_name=jobset_name(cfg.run_id, attempt),
        coordinator_port=GKE_COORDINATOR_PORT,
        metrics_port=cfg.monitoring.metrics_port,
    )


# --- the CPU slice's ports ---------------------------------------------------------------------


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(count: int, *, attempts: int = 50, exclude: Sequence[int] = ()) -> int:
    """A base port ``p`` such that ``p .. p+count-1`` are all free (and none in ``exclude``)."""
    for _ in range(attempts):
        base = free_port()
        ports = range(base, base + count)
        if base + count <= 65536 and not set(ports) & set(exclude) and all(_port_free(p) for p in ports):
            return base
    raise StepError(ExitCode.CAPACITY, f"no {count} consecutive free ports found")


def provision_local(
    cfg: JobConfig, attempt: int, store_root: str, api_client: Any, *, pod_timeout_s: float = 300
) -> ProvisionOutputs:
    """The CPU slice: clear the earlier attempts' JobSets as on GKE, pick the coordinator and metrics ports."""
    try:
        clear_old_gangs(cfg, attempt, RunStore(store_root, cfg.run_id), api_client, pod_timeout_s=pod_timeout_s)
    except api_failures() as e:
        raise api_error(e) from None
    # A gang of one joins no coordinator, and metrics port 0 serves none: no port taken (a TPU VM may let no
    # process open a socket).
    coordinator = free_port() if cfg.slice.num_hosts > 1 else 0
    metrics = 0 if cfg.monitoring.metrics_port == 0 else free_port_range(cfg.slice.num_hosts, exclude=[coordinator])
    return ProvisionOutputs(
        jobset_name=jobset_name(cfg.run_id, attempt), coordinator_port=coordinator, metrics_port=metrics
    )


# --- the step program -------------------------------------------------------------------------


def run(
    ref: AttemptRef,
    output_dir: Path,
    *,
    api_client: Any = None,
    k8s_host: str | None = None,
    options: ProvisionOptions = ProvisionOptions(),
    holder: lease.Claimant | None = None,
) -> dict[str, str]:
    """Provision the slice of attempt ``ref.attempt``; write the outputs and return them.

    ``api_client``: built from ``k8s_host`` or the pod's service account when None. ``holder``: the workflow (its
    uid and name) the run lease is renewed for before anything is deleted, naming where it runs as read here
    (another live holder: StepError, configuration, and nothing is touched).

    Raises:
        StepError: Not provisioned; its ``code`` is the exit code.
    """
    cfg = load_run_config(ref.store_root, ref.run_id)
    if holder is not None:
        # The client is made only for a replayed Workflow, to stop it.
        lease.refuse_replay(
            ref.store(), holder.uid, holder.name, cfg.namespace, lambda: api_client or k8s_client(k8s_host)
        )
        api_client = api_client or k8s_client(k8s_host)
        site, alive = lease.on_gke(api_client, cfg.namespace)
        try:
            lease.acquire(ref.store(), replace(holder, site=site), cfg.retry.lease_ttl_s, is_alive=alive)
        except lease.LeaseHeld as e:
            raise StepError(ExitCode.CONFIGURATION, str(e)) from None
    api_client = api_client or k8s_client(k8s_host)
    if cfg.slice.is_cpu:
        outputs = provision_local(cfg, ref.attempt, ref.store_root, api_client, pod_timeout_s=options.pod_timeout_s)
    else:
        outputs = provision_gke(cfg, ref.attempt, api_client, store=ref.store(), options=options)
    outputs.write(output_dir)
    return outputs.files()


def parser() -> argparse.ArgumentParser:
    """The step's arguments."""
    ap = cli.StepArgumentParser(prog="python -m recovery_steps.provision_slice", description=__doc__.split("\n")[0])
    ap.add_argument("--store-root", required=True, type=cli.store_root)
    ap.add_argument("--run-id", required=True, type=cli.run_id)
    ap.add_argument("--attempt", type=cli.attempt, required=True)
    ap.add_argument("--output-dir", type=cli.output_dir, default=Path("/tmp/outputs"))
    ap.add_argument(
        "--k8s-host", default=None, type=cli.http_url, help="Kubernetes API URL (default: in-cluster config)"
    )
    ap.add_argument("--require-nodes", action="store_true", help="zero matching nodes is a capacity problem")
    ap.add_argument("--pod-timeout", type=cli.seconds, default=300, help="seconds to wait for old worker pods")
    ap.add_argument("--holder", default=None, help="renew the run lease for this workflow uid first")
    ap.add_argument("--holder-name", default=None, help="the workflow's name")
    return ap


def act(args: argparse.Namespace) -> tuple[int, str]:
    """Provision the slice; record this try's outcome for classify-failure; the outputs line."""
    outputs = run(
        AttemptRef.of(args),
        args.output_dir,
        k8s_host=args.k8s_host,
        options=ProvisionOptions(require_nodes=args.require_nodes, pod_timeout_s=args.pod_timeout),
        holder=lease.Claimant(args.holder, args.holder_name or args.holder) if args.holder else None,
    )
    record_outcome(args.store_root, args.run_id, args.attempt, 0, "slice ready")
    return 0, " ".join(f"{k}={v}" for k, v in outputs.items())


def record_failure(args: argparse.Namespace, e: StepError) -> None:
    """The step's failure record: this try's exit code and line, where classify-failure reads them."""
    record_outcome(args.store_root, args.run_id, args.attempt, int(e.code), str(e))


# A run store that refuses (not a transient answer: those are 69, retried) ends the step with 1.
STEP = Step("provision-slice", parser, act, ProvisionOutputs, record_failure, store_code=1)
main = STEP.main


def record_outcome(store_root: str, run_id: str, attempt: int, code: int, message: str) -> None:
    """Write this try's outcome where classify-failure finds it when the attempt ends before training.

    Nothing is written for a run validate-config never pinned (a mistyped root or run id): no document for a run
    that does not exist.
    """
    try:
        store = RunStore(store_root, run_id)
        if not store.exists(RunLayout.CONFIG):
            return
        store.write_record(
            RunLayout.provision_record(attempt), ProvisionRecord(exit_code=code, message=message, at=now())
        )
    except Exception as e:  # noqa: BLE001 - the exit code still tells Argo what happened
        print(f"provision-slice: could not record the outcome in the run store: {e}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

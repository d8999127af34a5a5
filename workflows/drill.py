"""Failure drill on a real cluster: submit a generated workflow, inject one failure, print what it cost.

    python -m workflows.drill --workflow argo/v5e-4x4.yaml --context <kubeconfig context> --inject delete-worker

docs/RUNBOOK.md (section 7) says what it does, what it refuses and what to expect. Every destructive act needs a run
of the drill's own (``refuse_run_in_use``: a read that fails refuses too) and acts only on that run's objects.
"""

from __future__ import annotations

import argparse
import enum
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from jaxrec.adapters.documents import read_ledger
from jaxrec.adapters.incidents import TimedIncident, incidents_from_facts, read_attempt_facts
from jaxrec.adapters.kube import api_error_line
from jaxrec.adapters.store import RunLayout, RunStore, first_line, store_errors
from jaxrec.model.contract import WORKFLOW_FINISHED, NodePhase
from jaxrec.model.jobset import CONTAINER
from jaxrec.model.names import (
    ATTEMPT_LABEL,
    JOBSET_GROUP,
    JOBSET_NAME_LABEL,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    RUN_ID_LABEL,
    STANDBY_COMM,
)
from jaxrec.model.snapshot import PodPhase
from workflows.faults import FAULTS, act, corrupt_newest_checkpoint
from workflows.report import elapsed

ARGO = ("argoproj.io", "v1alpha1", "workflows")
WORKFLOW_LABEL = "workflows.argoproj.io/workflow"  # Argo puts it on every pod of a Workflow (workflow/common)
NODE_NAME_ANNOTATION = "workflows.argoproj.io/node-name"
JOBSET = (JOBSET_GROUP, JOBSET_VERSION)
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"  # on a static pod's mirror (kubernetes pkg/kubelet/types)


# The faults the drill injects: the rows of the one fault table (``workflows.faults``) with a way to act on a cluster.
Fault = enum.StrEnum("Fault", [(f.name.upper().replace("-", "_"), f.name) for f in FAULTS if f.on_cluster])
ROWS = {f.name: f for f in FAULTS if f.on_cluster}


class DrillError(Exception):
    """A drill that cannot go on (one line)."""


@dataclass(frozen=True)
class Target:
    """The run the drill submits: its Workflow document, namespace, run id and store root."""

    doc: dict[str, Any]
    namespace: str
    run_id: str
    store_root: str


def load_target(path: Path, params: Sequence[str], namespace: str | None) -> Target:
    """The workflow file with ``-p name=value`` overrides applied to its declared parameters.

    Raises:
        DrillError: the file is not a generated Workflow, or a parameter is not declared.
    """
    try:
        docs = list(yaml.safe_load_all(path.read_text()))
    except (OSError, yaml.YAMLError) as e:
        first = str(e).splitlines()[0]
        hint = "give a file `python -m workflows.build` wrote"
        raise DrillError(f"--workflow {path}: cannot read it ({first}); {hint}") from None
    doc = docs[0] if len(docs) == 1 else None
    if not isinstance(doc, dict) or doc.get("kind") != "Workflow":
        raise DrillError(f"--workflow {path}: not an Argo Workflow; give one of the files in argo/")
    declared = {p["name"]: p for p in doc.get("spec", {}).get("arguments", {}).get("parameters", [])}
    for item in params:
        name, sep, value = item.partition("=")
        if not sep or name not in declared:
            raise DrillError(f"-p {item}: not name=value of a declared parameter ({', '.join(declared)})")
        declared[name]["value"] = value
    run_id, root = declared.get("run-id", {}).get("value"), declared.get("store-root", {}).get("value")
    if not run_id or not root:
        raise DrillError(f"--workflow {path}: no run-id or store-root parameter; give a file from argo/")
    ns = namespace or doc.get("metadata", {}).get("namespace") or "default"
    doc.setdefault("metadata", {})["namespace"] = ns
    return Target(doc=doc, namespace=ns, run_id=str(run_id), store_root=str(root))


def choose_context(contexts: Sequence[str], current: str | None, context: str | None, yes: bool) -> str:
    """The kubeconfig context to use: the one named, or the current one when ``--yes`` confirms it.

    Raises:
        DrillError: nothing names the cluster, or the named context does not exist.
    """
    if context is not None:
        if context not in contexts:
            raise DrillError(f"--context {context}: no such context in the kubeconfig ({', '.join(contexts)})")
        return context
    if yes and current:
        return current
    raise DrillError(
        f"the drill deletes pods and evicts nodes: name the cluster with --context <name> "
        f"(current context: {current or 'none'}) or confirm the current one with --yes"
    )


class Cluster:
    """The drill's view of the cluster: the run's Workflow, pods and nodes, nothing else."""

    def __init__(self, api_client: Any, namespace: str):
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.ns = namespace
        self.cordoned: list[str] = []  # nodes the drill cordoned (uncordoned when it ends)

    def submit(self, doc: dict[str, Any]) -> str:
        """Create the Workflow; its name."""
        created = self.custom.create_namespaced_custom_object(*ARGO[:2], self.ns, ARGO[2], doc)
        return created["metadata"]["name"]

    def workflow(self, name: str) -> dict[str, Any]:
        """The Workflow as the API returns it now."""
        return self.custom.get_namespaced_custom_object(*ARGO[:2], self.ns, ARGO[2], name)

    def stop_workflow(self, name: str) -> None:
        """``argo stop`` the Workflow the drill submitted: Argo stops its steps and runs its exit handler."""
        patch = {"spec": {"shutdown": "Stop"}}
        self.custom.patch_namespaced_custom_object(*ARGO[:2], self.ns, ARGO[2], name, patch)

    def in_use(self, run_id: str) -> list[str]:
        """The JobSets and pods in the namespace that carry the run's label (kind/name)."""
        sel = f"{RUN_ID_LABEL}={run_id}"
        jobsets = self.custom.list_namespaced_custom_object(*JOBSET, self.ns, JOBSET_PLURAL, label_selector=sel)
        pods = self.core.list_namespaced_pod(self.ns, label_selector=sel).items
        return [f"jobset/{j['metadata']['name']}" for j in jobsets.get("items", [])] + [
            f"pod/{p.metadata.name}" for p in pods
        ]

    def delete_workflow(self, name: str) -> None:
        """Delete the Workflow the drill submitted (its exit handler does not run)."""
        self.custom.delete_namespaced_custom_object(*ARGO[:2], self.ns, ARGO[2], name)

    def pods(self, selector: str) -> list[Any]:
        """Running pods matching a label selector, oldest first."""
        items = self.core.list_namespaced_pod(self.ns, label_selector=selector).items
        live = [p for p in items if p.status.phase == PodPhase.RUNNING and not p.metadata.deletion_timestamp]
        return sorted(live, key=lambda p: (p.metadata.creation_timestamp, p.metadata.name))

    def running(self, selector: str) -> list[str]:
        """Pods matching a label selector whose containers still run (being deleted or not)."""
        items = self.core.list_namespaced_pod(self.ns, label_selector=selector).items
        return [p.metadata.name for p in items if p.status.phase in (PodPhase.PENDING, PodPhase.RUNNING)]

    def delete_pod(self, name: str, grace_s: int | None = None) -> None:
        """Delete one pod (with its own grace period unless ``grace_s`` says otherwise)."""
        self.core.delete_namespaced_pod(name, self.ns, grace_period_seconds=grace_s)

    def evict(self, name: str) -> None:
        """Evict one pod through the Eviction API, as a node drain does."""
        from kubernetes import client

        body = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=self.ns))
        self.core.create_namespaced_pod_eviction(name, self.ns, body)

    def cordon(self, node: str) -> None:
        """Mark a node unschedulable; remembered for ``uncordon_mine`` unless it was cordoned already."""
        if self.core.read_node(node).spec.unschedulable:
            return
        self.core.patch_node(node, {"spec": {"unschedulable": True}})
        self.cordoned.append(node)

    def uncordon_mine(self) -> list[str]:
        """Mark schedulable again every node the drill cordoned; the names."""
        done = []
        while self.cordoned:
            self.core.patch_node(self.cordoned[0], {"spec": {"unschedulable": False}})
            done.append(self.cordoned.pop(0))
        return done

    def others_on(self, node: str, run_id: str) -> list[str]:
        """Pods on ``node`` (any namespace) that are not the run's, a DaemonSet's or a static pod's mirror.

        Those ``kubectl drain`` leaves too (it ignores DaemonSet pods with ``--ignore-daemonsets`` and never evicts
        a mirror pod, annotated ``kubernetes.io/config.mirror``).
        """
        items = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items
        out = []
        for p in items:
            owners = [o.kind for o in (p.metadata.owner_references or [])]
            mirror = MIRROR_ANNOTATION in (p.metadata.annotations or {})
            if (p.metadata.labels or {}).get(RUN_ID_LABEL) != run_id and "DaemonSet" not in owners and not mirror:
                out.append(f"{p.metadata.namespace}/{p.metadata.name}")
        return out

    def kill_trainer(self, pod: str) -> None:
        """SIGKILL the trainer process of one worker pod (exec into its container).

        Raises:
            DrillError: the trainer is its container's PID 1: a signal sent from inside the pod cannot kill it
                (the kernel drops SIGKILL sent to a PID namespace's init from inside the namespace). The worker
                pods this project generates share their process namespace (``model.jobset``): the pause
                process is PID 1 there; a step image from before that has the trainer as PID 1.
        """
        from kubernetes.stream import stream

        resp = stream(
            self.core.connect_get_namespaced_pod_exec,
            pod,
            self.ns,
            container=CONTAINER,
            command=["python", "-c", _KILL_TRAINER],
            stderr=True,
            stdout=True,
            stdin=False,
            tty=False,
            _preload_content=False,
        )
        resp.run_forever(timeout=60)
        code = resp.returncode
        resp.close()
        if code == 3:
            raise DrillError(
                f"pod {pod}: the trainer is PID 1 of its container, which a signal from inside the pod cannot kill "
                "(its pod spec has no shareProcessNamespace: true; regenerate the Workflow with python -m "
                "workflows.build); use --inject delete-worker"
            )
        if code:
            raise DrillError(f"pod {pod}: the kill command exited {code} (no trainer process found?)")


# Finds the process running ``python -m trainer`` (not a standby: ``STANDBY_COMM``) and SIGKILLs it; exit 3 when
# it is PID 1, 4 when none is found.
_KILL_TRAINER = """
import os, signal, sys
me = os.getpid()
for d in os.listdir("/proc"):
    if not d.isdigit() or int(d) == me:
        continue
    try:
        argv = open(f"/proc/{d}/cmdline", "rb").read().split(b"\\0")
    except OSError:
        continue
    if b"-m" in argv and b"trainer" in argv[argv.index(b"-m") + 1:argv.index(b"-m") + 2]:
        try:
            if open(f"/proc/{d}/comm").read().strip() == STANDBY_COMM:  # a standby, not the trainer running
                continue
        except OSError:
            continue
        if int(d) == 1:
            sys.exit(3)
        os.kill(int(d), signal.SIGKILL)
        sys.exit(0)
sys.exit(4)
""".replace("STANDBY_COMM", repr(STANDBY_COMM))


def wait_until(what: str, probe: Callable[[], Any], deadline: float, *, every: float = 2.0) -> Any:
    """Poll ``probe`` until it returns something truthy; DrillError with ``what`` at the deadline."""
    while True:
        got = probe()
        if got:
            return got
        if time.time() > deadline:
            raise DrillError(f"timed out waiting for {what}")
        time.sleep(every)


def current_progress(store: RunStore) -> tuple[int, int] | None:
    """The newest attempt that has a heartbeat, and the newest step its workers reported."""
    for facts in reversed(read_attempt_facts(store)):
        if facts.progress is not None:
            return facts.attempt, facts.progress
    return None


def has_checkpoint(store: RunStore, at_least: int) -> bool:
    """The run has a checkpoint step at or past ``at_least`` whose manifest is written (its save is complete)."""
    return any(store.exists(RunLayout.checkpoint_manifest(s)) for s in store.checkpoint_steps() if s >= at_least)


CORRUPT_WAIT_S = 600.0
"""How long corrupt-latest waits for the attempt's workers to stop after the deletion."""


def workers_selector(run_id: str, attempt: int) -> str:
    """The label selector of the attempt's worker pods, and of nothing else.

    The run and attempt labels are on the attempt's step pods too (train-segment, the supervisor, carries them), so
    they alone may pick the supervisor as a victim. What makes a pod a worker is that its JobSet made it: the JobSet
    controller labels every pod of its Jobs with ``jobset.sigs.k8s.io/jobset-name`` (JobSet v0.12.0,
    ``pkg/controllers/jobset_controller.go`` ``labelAndAnnotateObject``); no step pod carries it.
    """
    return f"{RUN_ID_LABEL}={run_id},{ATTEMPT_LABEL}={attempt},{JOBSET_NAME_LABEL}"


@dataclass
class Scene:
    """A running attempt on a cluster as the faults' verbs (``workflows.faults.Verbs``) act on it.

    The run, its store, its Workflow (``resubmit`` names the new one), the attempt and its worker pods; the victim is
    the last worker.
    """

    cluster: Cluster
    store: RunStore
    target: Target
    workflow: str
    attempt: int
    workers: list[Any]
    deadline: float = 0.0  # when ``resubmit`` stops waiting for the deleted Workflow to go

    @property
    def victim_pod(self) -> Any:
        """The worker pod a fault on one worker hits: the last one."""
        if not self.workers:
            raise DrillError(f"no running worker pod of run {self.target.run_id} attempt {self.attempt}")
        return self.workers[-1]

    @property
    def victim(self) -> str:
        """The victim pod's name."""
        return self.victim_pod.metadata.name

    def delete_pod(self) -> str:
        """Delete the victim pod (its own grace period)."""
        self.cluster.delete_pod(self.victim)
        return f"deleted worker pod {self.victim}"

    def kill_trainer(self) -> str:
        """SIGKILL the victim's trainer by exec into its pod."""
        self.cluster.kill_trainer(self.victim)
        return f"SIGKILLed the trainer in {self.victim}"

    def drain_node(self) -> str:
        """Cordon the victim's node and evict the run's pods on it; refused when others run there."""
        node = self.victim_pod.spec.node_name
        others = self.cluster.others_on(node, self.target.run_id)
        if others:
            raise DrillError(f"node {node} also runs {', '.join(others[:3])}: the drill drains only the run's nodes")
        self.cluster.cordon(node)
        for p in self.workers:
            if p.spec.node_name == node:
                self.cluster.evict(p.metadata.name)
        return f"drained node {node} (cordoned; the run's pods on it evicted)"

    def evict_supervisor(self) -> str:
        """Evict the Workflow's train-segment pod, as a drain of its node does."""
        sup = [p for p in self.cluster.pods(f"{WORKFLOW_LABEL}={self.workflow}") if _is_supervisor(p)]
        if not sup:
            raise DrillError(f"no running train-segment pod of workflow {self.workflow}")
        self.cluster.evict(sup[-1].metadata.name)
        return f"evicted supervisor pod {sup[-1].metadata.name}"

    def resubmit(self) -> str:
        """Delete the Workflow (no exit handler runs), wait until it is gone, and submit the same file again."""
        self.cluster.delete_workflow(self.workflow)
        gone = self.workflow
        wait_until(f"workflow {gone} to go", lambda: not _exists(self.cluster, gone), self.deadline)
        self.workflow = self.cluster.submit(self.target.doc)
        return f"deleted the workflow and submitted it again as {self.workflow}"

    def corrupt_latest(self) -> str:
        """Delete a worker pod; once every worker of the attempt has stopped, damage the newest checkpoint.

        The damage comes after the stop because no deletion leaves the gang without time to save: the kubelet gives
        a container at least 2 s after SIGTERM even for a pod deleted with grace 0 (kubernetes v1.36.3,
        ``pkg/kubelet/kuberuntime/kuberuntime_container.go``, ``minimumGracePeriodInSeconds``), and the trainer
        saves at a SIGTERM when the save fits. Damaged before the stop, the step could then be superseded by the
        save at the stop and never read. The next attempt's restore-latest runs seconds after the stop (the
        supervisor's record, classify-failure, provision-slice), so the byte is flipped as soon as the last worker
        stopped.
        """
        victim, attempt, run_id, store = self.victim, self.attempt, self.target.run_id, self.store
        self.cluster.delete_pod(victim)
        selector = workers_selector(run_id, attempt)
        stopped = lambda: not self.cluster.running(selector)  # noqa: E731
        wait_until(f"the workers of attempt {attempt} to stop", stopped, time.time() + CORRUPT_WAIT_S, every=0.2)
        rel = corrupt_newest_checkpoint(store)
        if rel is None:
            raise DrillError(f"run {run_id} has no checkpoint with a manifest yet; raise --after-step")
        return f"deleted worker pod {victim}; once the attempt's workers stopped, flipped bytes of {store.url(rel)}"


def scene(cluster: Cluster, store: RunStore, target: Target, workflow: str, attempt: int, deadline: float) -> Scene:
    """The attempt's scene: its running worker pods, oldest first."""
    workers = cluster.pods(workers_selector(target.run_id, attempt))
    return Scene(cluster, store, target, workflow, attempt, workers, deadline)


def inject(cluster: Cluster, store: RunStore, target: Target, workflow: str, fault: Fault, attempt: int) -> str:
    """Inject ``fault`` into the run's attempt with its row's verb; one line saying what was done."""
    return act(scene(cluster, store, target, workflow, attempt, time.time() + CORRUPT_WAIT_S), ROWS[str(fault)])


def _is_supervisor(pod: Any) -> bool:
    node = (pod.metadata.annotations or {}).get(NODE_NAME_ANNOTATION, "")
    return "train-segment" in node or "-train-segment-" in pod.metadata.name


def measures_table(incidents: Sequence[TimedIncident]) -> list[str]:
    """The design's measures per incident, in seconds from the failure (injected, else detected)."""
    head = (
        "attempt  fault               class           detect  stop  provision  start  restore  compile  back  lost"
        "  restored"
    )
    lines = [head]
    for t in incidents:
        i = t.incident
        t0 = i.injected_at or i.detected_at
        back = elapsed(t0, i.recovered_at) + ("~" if t.recovered_estimated else "")
        compile_s = f"{i.compile_seconds:.1f}" if i.compile_seconds is not None else "-"
        lines.append(
            f"{i.attempt:<8} {(i.scenario or '-'):<19} {(i.failure_class or '-'):<15} "
            f"{elapsed(t0, i.detected_at):>6} {elapsed(t0, i.stopped_at):>5} {elapsed(t0, i.slice_ready_at):>10} "
            f"{elapsed(t0, i.workers_started_at):>6} {elapsed(t0, i.restored_at):>8} "
            f"{compile_s:>8} {back:>5} {i.steps_lost if i.steps_lost is not None else '-':>5} "
            f"{i.restored_step if i.restored_step is not None else '-':>9}"
        )
    if any(t.recovered_estimated for t in incidents):
        lines.append("~ estimated from the next attempt's first step and its steps per second")
    return lines


@dataclass
class DrillResult:
    """What the drill did and saw."""

    workflow: str
    injected: str
    phase: str
    final_status: str | None
    incidents: list[TimedIncident]


def _phase(cluster: Cluster, name: str) -> str | None:
    phase = cluster.workflow(name).get("status", {}).get("phase")
    return phase if phase in WORKFLOW_FINISHED else None


def refuse_run_in_use(cluster: Cluster, store: RunStore, run_id: str) -> None:
    """Refuse a run id that has a store or objects already: a drill acts only on a run of its own.

    Raises:
        DrillError: the run's store holds a config, lease or attempt, a JobSet or pod carries the run's label, or
            either could not be read (a failed read is no evidence that the run is free).
    """
    from recovery_steps.step import api_failures

    fresh = "give the drill a run of its own: -p run-id=drill-$(date +%s) (and -p store-root=gs://<bucket>/drills)"
    try:
        held = [rel for rel in (RunLayout.CONFIG, RunLayout.LEASE) if store.read_bytes(rel) is not None]
        held += [f"attempts/{n}" for n in store.attempts()[:3]]
    except store_errors() as e:
        raise DrillError(f"run store {store.url()}: cannot read it ({first_line(e)}); not drilled; {fresh}") from None
    if held:
        raise DrillError(f"run {run_id} already has {', '.join(held)} in {store.url()}: not drilled; {fresh}")
    try:
        objects = cluster.in_use(run_id)
    except api_failures() as e:
        raise DrillError(
            f"cannot list run {run_id}'s JobSets and pods in {cluster.ns} ({api_error_line(e)}); not drilled"
        ) from None
    if objects:
        raise DrillError(f"run {run_id} is in use in namespace {cluster.ns} ({', '.join(objects[:3])}); {fresh}")


@dataclass(frozen=True)
class Injection:
    """The fault a drill injects and when: once the run passed ``after_step``.

    ``after_checkpoint``: and only once a checkpoint at or past that step is complete too (None: no such wait).
    """

    fault: Fault
    after_step: int
    after_checkpoint: int | None = None


def run_drill(
    cluster: Cluster,
    target: Target,
    injection: Injection,
    *,
    timeout_s: float,
    say: Callable[[str], None] = print,
    store: RunStore | None = None,
) -> DrillResult:
    """Submit, wait for progress, inject ``injection.fault`` when it is due, wait for the end, and measure."""
    fault, after_step, after_checkpoint = injection.fault, injection.after_step, injection.after_checkpoint
    store = store or RunStore(target.store_root, target.run_id)
    deadline = time.time() + timeout_s
    refuse_run_in_use(cluster, store, target.run_id)
    name = cluster.submit(target.doc)
    say(f"drill: submitted workflow {name} (run {target.run_id}, store {store.url()})")
    ended = False
    try:

        def progress() -> tuple[int, int] | None:
            p = current_progress(store)
            if p is None or p[1] < after_step:
                return None
            return p if after_checkpoint is None or has_checkpoint(store, after_checkpoint) else None

        waited = f"run {target.run_id} to pass step {after_step}"
        waited += f" with a checkpoint at or past step {after_checkpoint}" if after_checkpoint is not None else ""
        attempt, step = wait_until(waited, progress, deadline)
        at = time.time()
        sc = scene(cluster, store, target, name, attempt, deadline)
        what = act(sc, ROWS[str(fault)])
        name = sc.workflow  # resubmit: the new one
        say(f"drill: at step {step} of attempt {attempt}: {what}")
        phase = wait_until(f"workflow {name} to finish", lambda: _phase(cluster, name), deadline, every=5.0)
        ended = True
    finally:
        _clean_up(cluster, name, ended, say)
    ledger = read_ledger(store)
    incidents = incidents_from_facts(read_attempt_facts(store), {attempt: (str(fault), at)})
    return DrillResult(name, what, phase, ledger.final_status if ledger else None, incidents)


def _clean_up(cluster: Cluster, name: str, ended: bool, say: Callable[[str], None]) -> None:
    """Stop the drill's own Workflow when the drill did not see it end; uncordon the nodes it cordoned."""
    if not ended:
        try:
            if _exists(cluster, name) and _phase(cluster, name) is None:
                cluster.stop_workflow(name)
                say(f"drill: stopped workflow {name} (argo stop: its exit handler stops the run's gang)")
        except Exception as e:  # noqa: BLE001 - the drill's own error is the one to raise
            say(f"drill: could not stop workflow {name} ({first_line(e)}): argo stop -n {cluster.ns} {name}")
    try:
        for node in cluster.uncordon_mine():
            say(f"drill: uncordoned node {node}")
    except Exception as e:  # noqa: BLE001 - as above
        say(f"drill: could not uncordon {', '.join(cluster.cordoned)} ({first_line(e)}): kubectl uncordon them")


def _exists(cluster: Cluster, name: str) -> bool:
    from kubernetes.client.exceptions import ApiException

    try:
        cluster.workflow(name)
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


def _client(kubeconfig: str | None, context: str | None, yes: bool) -> Any:
    from kubernetes import config

    try:
        contexts, current = config.list_kube_config_contexts(config_file=kubeconfig)
    except (config.ConfigException, OSError) as e:
        hint = "point KUBECONFIG or --kubeconfig at the cluster's kubeconfig"
        raise DrillError(f"--kubeconfig: cannot read it ({e}); {hint}") from None
    chosen = choose_context([c["name"] for c in contexts], current["name"] if current else None, context, yes)
    return config.new_client_from_config(config_file=kubeconfig, context=chosen)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; exit 0 when the drill ran and the run ended Succeeded, 1 when it ended otherwise, 2 on error."""
    ap = argparse.ArgumentParser(prog="python -m workflows.drill", description=__doc__.splitlines()[0])
    ap.add_argument("--workflow", type=Path, required=True, help="A file from argo/, submitted as it is.")
    ap.add_argument(
        "--inject",
        type=Fault,
        choices=list(Fault),
        required=True,
        help="; ".join(f"{f.name}: {f.on_cluster}" for f in FAULTS if f.on_cluster),
    )
    ap.add_argument("--context", help="The kubeconfig context of the cluster to drill (required unless --yes).")
    ap.add_argument("--yes", action="store_true", help="Drill the current kubeconfig context.")
    ap.add_argument("--kubeconfig", help="Default: $KUBECONFIG or ~/.kube/config.")
    ap.add_argument("--namespace", help="Default: the workflow file's.")
    ap.add_argument("-p", dest="params", action="append", default=[], help="name=value of a workflow parameter.")
    ap.add_argument("--after-step", type=int, default=20, help="Inject once the run has passed this step.")
    ap.add_argument(
        "--after-checkpoint",
        type=int,
        help="And once a checkpoint at or past this step is complete (its manifest written): the drill then "
        "measures the steps a failure costs after a save, not a save still in flight.",
    )
    ap.add_argument("--timeout", type=float, default=3600, help="Seconds for the whole drill.")
    args = ap.parse_args(argv)
    try:
        target = load_target(args.workflow, args.params, args.namespace)
        cluster = Cluster(_client(args.kubeconfig, args.context, args.yes), target.namespace)
        injection = Injection(args.inject, after_step=args.after_step, after_checkpoint=args.after_checkpoint)
        res = run_drill(cluster, target, injection, timeout_s=args.timeout)
    except DrillError as e:
        print(f"drill: {e}", file=sys.stderr)
        return 2
    for line in measures_table(res.incidents):
        print(line)
    print(f"drill: workflow {res.workflow} ended {res.phase}; the run's ledger says {res.final_status or 'nothing'}")
    return 0 if res.phase == NodePhase.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main())

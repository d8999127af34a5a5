"""Run a compiled Argo Workflow on this machine: ``python -m workflows.local argo/<job>.yaml [--inject ...]``."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jaxrec.adapters.incidents import incidents_from_facts, read_attempt_facts
from jaxrec.adapters.store import STORE_RETRY_DEADLINE_ENV, DocumentError, RunLayout, RunStore
from jaxrec.model import records
from jaxrec.model.config import (
    ConfigError,
    JobConfig,
    largest_attempt,
    longest_run_id,
    parse_config,
    run_id_pod_name_problem,
    run_id_problem,
)
from jaxrec.model.outputs import STEP_OUTPUTS
from jaxrec.model.records import now
from workflows.local.apiserver import ApiServer, iso
from workflows.local.cluster import ClusterSetup, LocalCluster
from workflows.local.controllers import LocalControllers
from workflows.local.engine import NodeInfo, NodePhase, NodeResult, WorkflowError, WorkflowRun
from workflows.local.events import EventTail
from workflows.local.executor import LocalExecutor
from workflows.local.inject import SCENARIOS, Injector, parse_injections
from workflows.local.outage import OutagePlan, OutageProxy, parse_outages
from workflows.local.slices import FIRST_POOL, MAX_NODE_POOLS, node_pools

REPO_ROOT = Path(__file__).resolve().parents[2]
EMULATOR_BUCKET = "local-runs"
RUN_ID_STAMP = "%Y%m%d-%H%M%S"
"""The timestamp a default local run id ends with (after a '-')."""
REFERENCE_SUFFIX = "-ref"
"""What the uninterrupted reference run's id adds to the run id."""
_KEY_OUTPUTS = frozenset(name for declared in STEP_OUTPUTS for name in declared.shown())


class LocalRunError(Exception):
    """Input the local runner cannot use; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass
class LocalRunResult:
    """What a local run ended with."""

    status: str
    run_id: str
    store_url: str
    work_dir: Path
    incidents: list[records.Incident] = field(default_factory=list)
    params_digest: str | None = None
    reference_digest: str | None = None
    restarts: int = 0
    workflows: list[str] = field(default_factory=list)  # every Workflow that ran, continuations included
    ledger: records.Ledger | None = None
    report_paths: list[str] = field(default_factory=list)
    fired: list[Any] = field(default_factory=list)  # injected faults that fired (inject.Injected)
    corrupted: list[str] = field(default_factory=list)  # checkpoint files the corrupt-latest fault damaged
    local_copy: str | None = None
    # The nodes of every Workflow that ran: steps and suspends, and DAG nodes and left-out tasks (engine.WorkflowRun).
    nodes: list[tuple[NodeInfo, NodeResult]] = field(default_factory=list)
    inner: list[tuple[NodeInfo, NodeResult]] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0 when the workflow Succeeded, 1 otherwise."""
        return 0 if self.status == "Succeeded" else 1

    @property
    def params_match(self) -> bool | None:
        """Whether the final parameters equal the reference run's (None without a reference)."""
        if self.reference_digest is None or self.params_digest is None:
            return None
        return self.params_digest == self.reference_digest


def load_workflow(path: Path) -> tuple[dict[str, Any], JobConfig]:
    """Read a compiled Workflow and the job config it carries (the raw artifact of validate-config).

    Raises:
        LocalRunError: with one line per problem.
    """
    try:
        wf = yaml.safe_load(path.read_text())
    except OSError as e:
        raise LocalRunError([f"{path}: cannot read the workflow: {e.strerror}"]) from None
    except yaml.YAMLError as e:
        raise LocalRunError([f"{path}: not YAML: {e}"]) from None
    if not isinstance(wf, dict) or wf.get("kind") != "Workflow":
        raise LocalRunError(
            [f"{path}: not an Argo Workflow (kind: Workflow); build one with python -m workflows.build"]
        )
    art = _config_artifact(wf)
    if art is None:
        raise LocalRunError(
            [f"{path}: no raw 'config' input artifact on a template; rebuild with python -m workflows.build"]
        )
    try:
        cfg = parse_config(yaml.safe_load(art["raw"]["data"]), f"{path} (config artifact)")
    except ConfigError as e:
        raise LocalRunError(e.problems) from None
    if not cfg.slice.is_cpu:
        # Its workers need TPU nodes and its store is a real bucket: nothing here can stand in for them.
        where = f"a {cfg.slice.accelerator} {cfg.slice.topology} slice on GKE"
        raise LocalRunError(
            [
                f"{path}: job {cfg.run_id!r} runs on {where}, not on local processes; submit it with "
                f"`argo submit -n {cfg.namespace} {path}`, or rehearse the same workflow here with "
                "`python -m workflows.local argo/local-cpu.yaml`"
            ]
        )
    return wf, cfg


def _config_artifact(wf: dict[str, Any]) -> dict[str, Any] | None:
    for t in wf.get("spec", {}).get("templates", []):
        for a in t.get("inputs", {}).get("artifacts", []) or []:
            if a.get("name") == "config" and "raw" in a:
                return a
    return None


def with_parameters(wf: dict[str, Any], values: dict[str, str]) -> dict[str, Any]:
    """A copy of the workflow with these workflow parameters set (like ``argo submit -p NAME=VALUE``)."""
    wf = json.loads(json.dumps(wf))
    params = wf.setdefault("spec", {}).setdefault("arguments", {}).setdefault("parameters", [])
    for name, value in values.items():
        for p in params:
            if p["name"] == name:
                p["value"] = value
                break
        else:
            params.append({"name": name, "value": value})
    return wf


def retarget(wf: dict[str, Any], run_id: str, store_root: str) -> dict[str, Any]:
    """The workflow with its run id and store root replaced (parameters and the config artifact)."""
    wf = with_parameters(wf, {"run-id": run_id, "store-root": store_root})
    art = _config_artifact(wf)
    if art is not None:
        data = yaml.safe_load(art["raw"]["data"])
        data["run_id"] = run_id
        data.setdefault("storage", {})["root"] = store_root
        art["raw"]["data"] = yaml.safe_dump(data, sort_keys=True)
    return wf


def stamped_run_id(base: str, cfg: JobConfig, *, reference: bool, at: time.struct_time | None = None) -> str:
    """The default run id of a local run: ``base`` with a timestamp, ``base`` shortened so that it fits.

    It fits the run-id syntax and the job's worker pod names (``run_id_pod_name_problem``), with room for the
    reference run's suffix when there is one.
    """
    stamp = "-" + time.strftime(RUN_ID_STAMP, at or time.localtime())
    room = longest_run_id(cfg.slice.num_hosts, largest_attempt(cfg.retry)) - len(stamp)
    room -= len(REFERENCE_SUFFIX) if reference else 0
    return base[: max(room, 1)].rstrip("-") + stamp


def run_id_problems(cfg: JobConfig, run_id: str, *, reference: bool) -> list[str]:
    """One line per run id of this local run (the run's, the reference run's) that its job could not use."""
    problem = run_id_problem(run_id) or run_id_pod_name_problem(cfg.model_copy(update={"run_id": run_id}))
    if problem:
        return [f"--run-id: {problem}"]
    ref = run_id + REFERENCE_SUFFIX
    longest = longest_run_id(cfg.slice.num_hosts, largest_attempt(cfg.retry))
    if reference and len(ref) > longest:
        return [
            f"--reference: the reference run's id {ref!r} would have {len(ref)} characters, this job allows "
            f"{longest}; give a --run-id of at most {longest - len(REFERENCE_SUFFIX)} characters"
        ]
    return []


def worker_metrics_line(attempt: int | None, base_port: int, hosts: int) -> str:
    """The line announcing an attempt's worker metrics endpoints (worker ``i`` serves ``base_port + i``)."""
    last = f"..{base_port + hosts - 1}" if hosts > 1 else ""
    return f"worker metrics (attempt {attempt}): http://127.0.0.1:{base_port}/metrics (ports {base_port}{last})"


class _Printer:
    """One readable line per node start and end."""

    def __init__(self, say: Callable[[str], None], t0: float, hosts: int = 1):
        self.say = say
        self.t0 = t0
        self.hosts = hosts

    def __call__(self, kind: str, node: NodeInfo, res: NodeResult | None) -> None:
        tag = f"[attempt {node.attempt}]" if node.attempt is not None else "[run]"
        name = node.task + (f" (retry {node.retry})" if node.retry else "")
        clock = f"{now() - self.t0:7.1f}s"
        if res is None:
            self.say(f"{clock} {tag:12} {name:24} started")
            return
        keys = " ".join(f"{k}={_short(v)}" for k, v in res.outputs.items() if k in _KEY_OUTPUTS)
        msg = f"  {res.message.splitlines()[0]}" if res.message and res.phase != NodePhase.SUCCEEDED else ""
        self.say(f"{clock} {tag:12} {name:24} {res.phase:9} {res.duration:6.1f}s  {keys}{msg}")
        port = res.outputs.get("metrics-port", "")
        if node.template == "provision-slice" and res.phase == NodePhase.SUCCEEDED and port.isdigit() and int(port):
            self.say(f"{'':8} {worker_metrics_line(node.attempt, int(port), self.hosts)}")


def _short(v: str, n: int = 60) -> str:
    v = " ".join(v.split())
    return v if len(v) <= n else v[: n - 3] + "..."


def _read_ledger(store: RunStore) -> records.Ledger | None:
    try:
        return store.read_record(RunLayout.LEDGER, records.Ledger)
    except DocumentError:
        return None


def final_digest(store: RunStore) -> str | None:
    """``params_digest`` of the newest worker-0 exit report that has one (the run's final parameters)."""
    for n in reversed(store.attempts()):
        try:
            rep = store.read_record(RunLayout.worker_report(n, 0), records.WorkerExitReport)
        except DocumentError:
            continue
        if rep is not None and rep.params_digest and rep.exit_code == 0:
            return rep.params_digest
    return None


@dataclass(frozen=True)
class LocalRunOptions:
    """How ``run`` runs a compiled Workflow here: the options of ``python -m workflows.local``.

    Attributes:
        inject: ``SCENARIO[@STEP]`` options.
        gcs_emulator: Run against a fake-gcs-server bucket instead of a local directory.
        run_id: Run id (default: the workflow's run id with a timestamp; reuse one to resume).
        store_root: Run-store root (default: the workflow's ``store-root`` parameter).
        reference: Run an uninterrupted reference run first and compare the final parameters.
        reference_digest: The reference run's parameter digest, when already known.
        metrics_port: Port of the run metrics server (0: any free port; None: no server).
        parameters: Workflow parameters to set, as ``argo submit -p NAME=VALUE`` would.
        report: Print the incident table and draw the timeline at the end.
        grace_seconds: SIGTERM-to-SIGKILL grace when the local JobSet stops its workers (default: the
            manifest's ``terminationGracePeriodSeconds``, as on the cluster).
        store_outages: ``TEMPLATE=SECONDS``: the store answers 503 for that long from the first store request of the
            template's first node (needs ``gcs_emulator``; steps reach the emulator through ``OutageProxy``).
        node_pools: The local cluster's node pools, each a slice's worth of hosts (``local-a``, ``local-b``, ...):
            with more than one, a gang that prefers another pool than the last one's (level 2) runs there.
    """

    inject: Sequence[str] = ()
    gcs_emulator: bool = False
    run_id: str | None = None
    store_root: str | None = None
    reference: bool = False
    reference_digest: str | None = None
    metrics_port: int | None = 0
    parameters: Mapping[str, str] = field(default_factory=dict)
    report: bool = True
    grace_seconds: float | None = None
    store_outages: Sequence[str] = ()
    node_pools: int = 1


def run(
    workflow_path: Path, options: LocalRunOptions | None = None, say: Callable[[str], None] = print
) -> LocalRunResult:
    """Run a compiled Workflow (``argo/<job>.yaml``) here, with faults injected; write incidents; print the report.

    Raises:
        LocalRunError: for unusable input.
    """
    o = options or LocalRunOptions()
    wf, cfg = load_workflow(workflow_path)
    injections, problems = parse_injections(list(o.inject), cfg.checkpoint.interval_steps)
    problems += _parameter_problems(wf, dict(o.parameters))
    outage_plan, outage_problems = parse_outages(list(o.store_outages))
    problems += outage_problems
    try:
        pools = node_pools(o.node_pools)
    except ValueError:
        problems.append(f"--node-pools {o.node_pools}: give 1 to {MAX_NODE_POOLS} (1: no spare pool)")
    if outage_plan and not o.gcs_emulator:
        problems.append("--store-outage needs --gcs-emulator (the outage is a proxy in front of the emulator)")
    if problems:
        raise LocalRunError(problems)
    wf = with_parameters(wf, dict(o.parameters))
    params = _parameters(wf)
    with_reference = o.reference and o.reference_digest is None
    run_id = o.run_id or stamped_run_id(params.get("run-id", cfg.run_id), cfg, reference=with_reference)
    problems = run_id_problems(cfg, run_id, reference=with_reference)
    if problems:
        raise LocalRunError(problems)
    reference_digest = o.reference_digest
    with contextlib.ExitStack() as stack:
        reach = StoreReach()
        store_root = o.store_root
        if o.gcs_emulator:
            reach = _start_emulator(stack, outage_plan, say)
            store_root = store_root or f"gs://{EMULATOR_BUCKET}/local"
        store_root = store_root or params.get("store-root", cfg.storage.root)
        if with_reference:
            ref_id = run_id + REFERENCE_SUFFIX
            say(f"reference run {ref_id} (no faults) ...")
            quiet = _LocalRun(wf, cfg, RunStore(store_root, ref_id), StoreReach(reach.env), o.grace_seconds)
            ref = quiet.run([], metrics_port=None)
            reference_digest = ref.params_digest
            say(f"reference run {ref.status}: params digest {str(reference_digest)[:16]}")
        store = RunStore(store_root, run_id)
        result = _LocalRun(wf, cfg, store, reach, o.grace_seconds, say, pools).run(injections, o.metrics_port)
        result.reference_digest = reference_digest
        _finish(result, store, say)
        if o.report:
            from workflows import report as report_mod

            result.report_paths = report_mod.run(store.url(), say=say)
        if o.gcs_emulator and store.is_gcs:
            result.local_copy = _keep_copy(store, say)
    return result


def _parameters(wf: dict[str, Any]) -> dict[str, str]:
    """The Workflow's parameters and their values."""
    return {p["name"]: str(p.get("value", "")) for p in wf["spec"].get("arguments", {}).get("parameters", [])}


def _parameter_problems(wf: dict[str, Any], parameters: dict[str, str]) -> list[str]:
    """One line per ``-p NAME=VALUE`` the Workflow does not declare."""
    declared = _parameters(wf)
    return [
        f"-p {name}: the workflow has no such parameter; it has {', '.join(sorted(declared))}"
        for name in parameters
        if name not in declared
    ]


@dataclass
class StoreReach:
    """How the steps and workers reach the run store: their environment, and the outages to fire on the way."""

    env: dict[str, str] = field(default_factory=dict)
    outages: OutagePlan | None = None


def _start_emulator(
    stack: contextlib.ExitStack, outage_plan: dict[str, float], say: Callable[[str], None]
) -> StoreReach:
    """Start the GCS emulator (and the outage proxy in front of it) for the run: how the steps reach it."""
    from workflows.local.emulator import GcsEmulator

    em = stack.enter_context(GcsEmulator())
    em.create_bucket(EMULATOR_BUCKET)
    saved = {k: os.environ.get(k) for k in em.env}
    em.apply()
    stack.callback(_restore_env, saved)
    say(f"GCS emulator at {em.url}; run store gs://{EMULATOR_BUCKET}")
    if not outage_plan:
        return StoreReach(em.env)
    proxy = OutageProxy(em.url)
    stack.callback(proxy.close)
    # The steps and workers go through the proxy; this process reads the emulator directly.
    # A short client deadline hands an outage to the templates' retryStrategy within seconds.
    env = {**proxy.env(em.env), STORE_RETRY_DEADLINE_ENV: "1"}
    return StoreReach(env, OutagePlan(proxy, outage_plan, say=say))


def _keep_copy(store: RunStore, say: Callable[[str], None]) -> str:
    """The emulator keeps its objects in memory: copy the run to a local folder for later reports."""
    dest = (Path(".local-runs/emulator") / store.run_id / "store").resolve()
    n = copy_run(store, dest)
    say(f"the emulator stops now; {n} objects of the run copied to {dest}")
    say(f"report: python -m workflows.report {dest / 'runs' / store.run_id}")
    return str(dest / "runs" / store.run_id)


def copy_run(store: RunStore, dest_root: Path) -> int:
    """Copy every object of ``store``'s run under ``dest_root/runs/<run-id>``; return how many."""
    dest = RunStore(str(dest_root), store.run_id)
    n = 0
    for obj in store.list():
        data = store.read_bytes(obj.name)
        if data is not None:
            dest.write_bytes(obj.name, data)
            n += 1
    return n


def _restore_env(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class _LocalRun:
    """The Workflow of one run id, and every one that continues it or is submitted again after a deletion, run here.

    Its fields are what each Workflow of the run shares: the compiled Workflow and config, the run store, the
    steps' environment, the local JobSets' grace, where progress goes and the store outages to fire.
    """

    def __init__(
        self,
        wf: dict[str, Any],
        cfg: JobConfig,
        store: RunStore,
        reach: StoreReach,
        grace_seconds: float | None,
        say: Callable[[str], None] = lambda _: None,
        pools: tuple[str, ...] = (FIRST_POOL,),
    ):
        self.cfg, self.store, self.grace_seconds, self.say, self.pools = cfg, store, grace_seconds, say, pools
        self.base_env, self.outages = reach.env, reach.outages
        self.run_id = store.run_id
        self.wf = retarget(wf, store.run_id, store.root)
        local = Path(".local-runs/emulator") / store.run_id / "local" if store.is_gcs else Path(store.url("local"))
        self.work_dir = local.resolve()

    def run(self, injections: list, metrics_port: int | None) -> LocalRunResult:
        """Run to the end of the run's last Workflow; the result with its incidents."""
        store, say, work_dir = self.store, self.say, self.work_dir
        events = EventTail(work_dir / "events")
        deleted = _Deletion()
        injector = Injector(
            injections,
            events,
            lambda: store,
            deleted,
            lambda s: say(f"         {s}"),
            work_dir / "hosts",
            local_tier=self.cfg.checkpoint.local,
        )
        feed = _MetricsFeed(store, self.cfg, metrics_port, say, logs=work_dir / "logs")
        status = "Running"
        t0 = now()
        all_nodes: list[tuple[NodeInfo, NodeResult]] = []
        all_inner: list[tuple[NodeInfo, NodeResult]] = []
        restarts = 0
        names: list[str] = []
        # The next Workflow to run: (name, uid); a continuation's are the ones its hand-over step recorded.
        nxt: tuple[str, str | None] = (self.run_id, None)
        # One cluster for the whole run: a continuation, or a Workflow submitted again, finds the JobSets left.
        setup = ClusterSetup(REPO_ROOT, work_dir, self.base_env, work_dir / "events", self.grace_seconds, self.pools)
        controllers = LocalControllers(LocalCluster(setup, injector), self.cfg.namespace)
        injector.connect(controllers.url, self.cfg.namespace)
        try:
            while True:
                ex = LocalExecutor(
                    repo_root=REPO_ROOT, work_dir=work_dir, base_env=self.base_env, controllers=controllers
                )
                printer = _Printer(say, t0, self.cfg.slice.num_hosts)
                progress = self.outages.wrap(printer) if self.outages is not None else printer
                wf = _workflow(controllers.api, self.wf, *nxt)
                wrun = WorkflowRun(wf, ex, name=nxt[0], progress=progress)
                names.append(wrun.name)
                deleted.run = wrun
                _publish(controllers.api, wf, wrun, "Running")
                try:
                    status = feed.status = wrun.run()
                except WorkflowError as e:
                    say(f"workflow error: {e}")
                    status = feed.status = "Error"
                all_nodes += wrun.nodes
                all_inner += wrun.inner
                if deleted.is_set():
                    controllers.api.remove("workflows", wrun.name)  # the Workflow object is gone with its lease
                else:
                    _publish(controllers.api, wf, wrun, status)
                if deleted.is_set() and restarts == 0:
                    deleted.clear()
                    restarts += 1
                    say(
                        f"{now() - t0:7.1f}s [run]        workflow deleted; starting it again with run id {self.run_id}"
                    )
                    nxt = (f"{self.run_id}-{restarts}", None)
                    continue
                handed = _handed_to(store, wrun, status, lambda line: say(f"{now() - t0:7.1f}s [run]        {line}"))
                if handed is None:
                    break
                nxt = handed
        finally:
            feed.stop_feeding()
            controllers.close()
        events.poll()
        ledger = _read_ledger(store)
        incidents = _incidents(store, events, injector, ledger, say)
        feed.close(ledger, incidents)
        digest = _safe(lambda: final_digest(store))
        result = LocalRunResult(
            status, self.run_id, store.url(), work_dir, incidents, digest, restarts=restarts, workflows=names
        )
        result.ledger, result.fired, result.corrupted = ledger, injector.fired, injector.corrupted
        result.nodes, result.inner = all_nodes, all_inner
        return result


class _Deletion(threading.Event):
    """The delete-workflow fault's hook: aborts the Workflow running now and is set once it was deleted."""

    def __init__(self):
        super().__init__()
        self.run: WorkflowRun | None = None

    def __call__(self) -> None:
        self.set()
        if self.run is not None:
            threading.Thread(target=self.run.abort, daemon=True).start()


class _MetricsFeed:
    """The run metrics server (``metrics_port`` None: none), fed the ledger and the status every second."""

    def __init__(
        self, store: RunStore, cfg: JobConfig, metrics_port: int | None, say: Callable[[str], None], *, logs: Path
    ):
        self.store = store
        self.status = "Running"
        self.server = None
        if metrics_port is not None:
            from workflows.local.metrics import RunMetricsServer

            self.server = RunMetricsServer(store.run_id, cfg.retry)
            port = self.server.start(metrics_port)
            say(f"run {store.run_id}: store {store.url()}")
            say(f"run metrics: http://127.0.0.1:{port}/metrics   worker logs: {logs}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._feed, daemon=True)
        self._thread.start()

    def _feed(self) -> None:
        while not self._stop.wait(1.0):
            ledger = _safe(lambda: _read_ledger(self.store))
            if self.server is not None:
                self.server.update(ledger or records.Ledger(run_id=self.store.run_id), self.status)

    def stop_feeding(self) -> None:
        """Stop the once-a-second updates."""
        self._stop.set()
        self._thread.join(timeout=5)

    def close(self, ledger: records.Ledger | None, incidents: list[records.Incident]) -> None:
        """Publish the final ledger, status and incidents, then stop the server."""
        if self.server is not None:
            self.server.update(ledger or records.Ledger(run_id=self.store.run_id), self.status, incidents)
            self.server.stop()


def _workflow(api: ApiServer, submitted: dict[str, Any], name: str, uid: str | None) -> dict[str, Any]:
    """The Workflow to run next, named ``name`` (with ``uid``, when one is known).

    The one the API holds by that name (a continuation a hand-over step created there), else the one submitted.
    """
    made = api.workflows.get(name)
    if made is not None and (uid is None or made["metadata"].get("uid") == uid):
        return copy.deepcopy(made)
    return {**submitted, "metadata": {**submitted.get("metadata", {}), "name": name, "uid": uid}}


def _publish(api: ApiServer, wf: dict[str, Any], wrun: WorkflowRun, phase: str) -> None:
    """The Workflow object as Argo's controller keeps it: its manifest, its uid, ``status.phase``.

    One the API holds already (under this uid) keeps what the steps wrote to it (a give-up's label); only its phase
    changes.
    """
    with api.lock:
        stored = api.workflows.get(wrun.name)
        if stored is not None and stored["metadata"].get("uid") == wrun.uid:
            api.put("workflows", {**stored, "status": {**(stored.get("status") or {}), "phase": str(phase)}})
            return
        meta = {**wf.get("metadata", {}), "name": wrun.name, "uid": wrun.uid, "namespace": api.ns}
        meta.pop("resourceVersion", None)
        meta.setdefault("creationTimestamp", iso(now()))
        obj = {**wf, "apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "metadata": meta}
        api.put("workflows", {**obj, "status": {"phase": str(phase)}})


def _handed_to(
    store: RunStore, wrun: WorkflowRun, status: str, say: Callable[[str], None]
) -> tuple[str, str | None] | None:
    """The continuation Workflow (name, uid) that ``wrun`` handed the run over to, if it did."""
    handed = _safe(lambda: _hand_over_from(store, wrun.uid)) if status == "Succeeded" else None
    if handed is None:
        return None
    # The Workflow the hand-over step created in the API starts now, after this one ended, as the run's Argo mutex
    # lets it on a cluster.
    say(f"{wrun.name} handed the run over: workflow {handed.to_workflow} continues from attempt {handed.next_attempt}")
    return handed.to_workflow, handed.to_uid


def _incidents(
    store: RunStore,
    events: EventTail,
    injector: Injector,
    ledger: records.Ledger | None,
    say: Callable[[str], None],
) -> list[records.Incident]:
    """The run's incidents, from the one builder (``adapters.incidents``).

    Over the run store's records of each attempt, timed by the workers' events, named by the faults injected into it.
    """
    scenarios: dict[int, list[str]] = {}
    for f in injector.fired:
        scenarios.setdefault(f.attempt, []).append(f.scenario)
    injected = {
        a: ("+".join(dict.fromkeys(names)), min(f.at for f in injector.fired if f.attempt == a))
        for a, names in scenarios.items()
    }
    facts = _safe(lambda: read_attempt_facts(store, ledger, events.events))
    if facts is None:
        say("incidents not built: the run store could not be read (the log says why)")
        return []
    return [t.incident for t in incidents_from_facts(facts, injected)]


def _hand_over_from(store: RunStore, uid: str) -> records.HandOver | None:
    """The hand-over the Workflow with ``uid`` recorded in the ledger, if it handed the run over."""
    ledger = _read_ledger(store)
    return next((h for h in reversed(ledger.hand_overs) if h.from_uid == uid), None) if ledger else None


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a store read during a run must not stop the run
        logging.getLogger(__name__).debug("store read failed", exc_info=True)
        return None


def _finish(result: LocalRunResult, store: RunStore, say: Callable[[str], None]) -> None:
    """Write incidents, the run summary and (for GCS) the events into the run store."""
    match = result.params_match
    for inc in result.incidents:
        if match is not None:
            inc.params_match_reference = match
        store.write_record(RunLayout.incident(inc.attempt), inc)
    if store.is_gcs:
        for f in sorted((result.work_dir / "events").glob("worker-*.jsonl")):
            store.write_bytes(RunLayout.local_events(f.name), f.read_bytes())
    ledger = result.ledger
    summary = records.LocalSummary(
        run_id=result.run_id,
        status=result.status,
        restarts=result.restarts,
        final_reason=ledger.final_reason if ledger else None,
        params_digest=result.params_digest,
        reference_digest=result.reference_digest,
        params_match_reference=match,
        injected=[records.InjectedFault(scenario=f.scenario, attempt=f.attempt, at=f.at) for f in result.fired],
        corrupted=result.corrupted,
        attempts=len(ledger.attempts) if ledger else None,
        finished_at=records.now(),
    )
    store.write_record(RunLayout.LOCAL_SUMMARY, summary)
    say(f"workflow {result.status}" + (f": {ledger.final_reason}" if ledger and ledger.final_reason else ""))
    if match is not None:
        say(f"final parameters {'equal' if match else 'DIFFER FROM'} the uninterrupted reference run")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m workflows.local``."""
    p = argparse.ArgumentParser(prog="python -m workflows.local", description=__doc__)
    p.add_argument("workflow", type=Path, help="compiled Workflow, e.g. argo/local-cpu.yaml")
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SCENARIO[@STEP]",
        help="fault to inject (repeatable): " + "; ".join(f"{k}: {v}" for k, v in SCENARIOS.items()),
    )
    p.add_argument("--gcs-emulator", action="store_true", help="run against a local GCS emulator (gs://)")
    p.add_argument(
        "--store-outage",
        action="append",
        default=[],
        metavar="TEMPLATE=SECONDS",
        help="with --gcs-emulator: the store answers 503 for SECONDS from TEMPLATE's first store request (repeatable)",
    )
    p.add_argument("--run-id", help="run id (default: the workflow's, with a timestamp); reuse one to resume it")
    p.add_argument("--store-root", help="run-store root (default: the workflow's store-root parameter)")
    p.add_argument("--reference", action="store_true", help="also run without faults and compare final parameters")
    p.add_argument("--metrics-port", type=int, default=0, help="run metrics port (default: any free port)")
    p.add_argument(
        "--no-metrics",
        action="store_true",
        help="serve no run metrics (a machine where no process may open a socket)",
    )
    p.add_argument(
        "--node-pools",
        type=int,
        default=1,
        metavar="N",
        help="node pools of the local cluster, each a slice's worth of hosts (default 1); with 2, a gang sent away "
        "from its pool (level 2: a preemption, a drained or lost host) runs on the spare one",
    )
    p.add_argument(
        "-p",
        "--parameter",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a workflow parameter, as `argo submit -p` does (e.g. accept-safe-changes=true)",
    )
    args = p.parse_args(argv)
    bad = [f"-p {x!r}: expected NAME=VALUE" for x in args.parameter if "=" not in x]
    if bad:
        for line in bad:
            print(f"error: {line}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        options = LocalRunOptions(
            inject=args.inject,
            gcs_emulator=args.gcs_emulator,
            run_id=args.run_id,
            store_root=args.store_root,
            reference=args.reference,
            metrics_port=None if args.no_metrics else args.metrics_port,
            parameters=dict(x.split("=", 1) for x in args.parameter),
            store_outages=args.store_outage,
            node_pools=args.node_pools,
        )
        result = run(args.workflow, options)
    except LocalRunError as e:
        for line in e.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    return result.exit_code

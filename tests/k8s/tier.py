"""The project's side of the real-controller tier: a run of a GKE config in a test's namespace, its RBAC and
credentials, and its step programs run as processes under that ServiceAccount."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from realcluster import RealCluster, pdeathsig, wait_for

from jaxrec.adapters.store import AttemptRef, RunLayout, RunStore
from jaxrec.model.config import JobConfig, StorageConfig, SupervisionConfig, load_config
from jaxrec.model.jobset import JobSetParams, jobset_manifest
from jaxrec.model.names import jobset_name
from jaxrec.model.records import SupervisionRecord, WorkerHeartbeat
from recovery_steps import classify_failure
from workflows.rbac import rbac_objects

REPO = Path(__file__).resolve().parents[2]
HOSTS = 4
INDEX = "batch.kubernetes.io/job-completion-index"
CPU_HOSTS = ("cpu-host-0", "cpu-host-1", "cpu-host-2")  # podexec nodes for the gangs of real trainers
CPU_HOST_LABEL = "jaxrec.test/cpu-host"
PODEXEC_NODE = "argo-steps"  # the node of the step pods (not KWOK's: podexec runs them as processes)


class CpuHostsPools:
    """Two node pools of two nodes each among the nodes podexec runs, for a drill of level 2 (the steps' node is
    one of the spare pool's: untainted, the gang's pods may land on it as on any of them)."""

    FIRST = ("cpu-host-0", "cpu-host-1")
    SPARE = ("cpu-host-2", PODEXEC_NODE)


@dataclass(frozen=True)
class CpuHosts:
    """Where the local file runs: its namespace, the nodes podexec runs for it, and podexec's pod folders."""

    namespace: str
    nodes: tuple[str, ...]
    pods_roots: tuple[Path, ...]

    def pid(self, pod: dict) -> int:
        """The pid of a pod's container process (podexec writes it into the pod's folder on whichever node)."""
        meta = pod["metadata"]
        for root in self.pods_roots:
            f = root / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}" / "pid"
            if f.exists():
                return int(f.read_text())
        raise AssertionError(f"no pid file of pod {meta['name']} under {self.pods_roots}")


def tier_config(root: Path, namespace: str, config: str = "v5e-4x4.yaml", **supervision) -> JobConfig:
    """A GKE config of configs/ in ``namespace``, with a local run store and shortened supervision deadlines;
    validated (written with its hash) into the store as validate-config would."""
    cfg = load_config(REPO / "configs" / config)
    sup = {
        "watch_interval_s": 0.5,
        "heartbeat_interval_s": 1,
        "hang_timeout_s": 120,
        "compile_grace_s": 300,
        "force_delete_grace_s": 2,
        **supervision,
    }
    cfg = cfg.model_copy(
        update={
            "namespace": namespace,
            "storage": StorageConfig(root=str(root), durable_mount=True),  # a local store stands in for the bucket
            "supervision": SupervisionConfig(**sup),
        }
    )
    RunStore(str(root), cfg.run_id).write_json(
        RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()}
    )
    return cfg


def apply_rbac(rc: RealCluster, cfg: JobConfig) -> None:
    """The project's ServiceAccounts, Role and bindings (``workflows.rbac``, as in ``argo/rbac.yaml``) for the
    config's namespace. A cluster-scoped binding keeps the subjects earlier tests bound (the shared CPU hosts' runs
    in ``default`` read the cluster's id through it after a test in ``training`` bound its own), as
    ``argo/rbac.yaml`` built for every config binds them all."""
    from kubernetes import client

    for obj in rbac_objects([cfg]):
        if obj["kind"] == "ClusterRoleBinding":
            try:
                have = client.RbacAuthorizationV1Api(rc.admin).read_cluster_role_binding(obj["metadata"]["name"])
            except client.ApiException as e:
                if e.status != 404:
                    raise
            else:
                known = [{"kind": s.kind, "name": s.name, "namespace": s.namespace} for s in have.subjects or []]
                obj = {**obj, "subjects": [*known, *(x for x in obj["subjects"] if x not in known)]}
        rc.apply(obj)


@dataclass
class Run:
    """One run of the v5e-4x4 config in the test's namespace, with its steps' credentials."""

    rc: RealCluster
    cfg: JobConfig
    tmp: Path
    kubeconfig: Path
    token: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def ns(self) -> str:
        return self.cfg.namespace

    @property
    def store(self) -> RunStore:
        return RunStore(self.cfg.storage.root, self.cfg.run_id)

    def params(self, attempt: int) -> JobSetParams:
        """The attempt's JobSet parameters (a fresh start), as train-segment's arguments carry them."""
        return JobSetParams(
            name=jobset_name(self.cfg.run_id, attempt),
            run_id=self.cfg.run_id,
            store_root=self.cfg.storage.root,
            attempt=str(attempt),
            restore_step="-1",
            coordinator_port="8476",
            metrics_port="9431",
        )

    def manifest(self, attempt: int) -> dict:
        """The JobSet train-segment renders for ``attempt`` from the pinned config (``self.cfg``)."""
        return jobset_manifest(self.cfg, self.params(attempt))

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        return {**env, "KUBECONFIG": str(self.kubeconfig)}

    def supervise(self, attempt: int) -> subprocess.Popen:
        """Start train-segment for ``attempt`` as the steps' ServiceAccount (its output in supervisor-<n>.log)."""
        out = self.tmp / f"out-{attempt}-{len(self.procs)}"
        log = (self.tmp / f"supervisor-{attempt}-{len(self.procs)}.log").open("wb")
        params = self.params(attempt)  # train-segment renders the JobSet from the pinned config and these
        argv = [
            sys.executable,
            "-m",
            "recovery_steps.train_segment",
            "--store-root",
            self.cfg.storage.root,
            "--run-id",
            self.cfg.run_id,
            "--attempt",
            str(attempt),
            "--jobset-name",
            params.name,
            "--restore-step",
            params.restore_step,
            "--coordinator-port",
            params.coordinator_port,
            "--metrics-port",
            params.metrics_port,
            "--output-dir",
            str(out),
        ]
        # Its own process group (a test can signal the supervisor alone), gone with the test process.
        p = subprocess.Popen(
            argv, env=self._env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pdeathsig
        )
        p.log_path = Path(log.name)  # type: ignore[attr-defined]
        p.out_dir = out  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def finish(self, p: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
        """Wait for a supervisor to exit; its exit code and its log."""
        try:
            code = p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            raise AssertionError(f"train-segment did not end within {timeout} s:\n{p.log_path.read_text()}") from None
        return code, p.log_path.read_text()

    def step(self, module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run another step program as the steps' ServiceAccount."""
        return subprocess.run(
            [sys.executable, "-m", module, *args],
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            preexec_fn=pdeathsig,
        )

    def classify(self, attempt: int) -> classify_failure.ClassifyResult:
        return classify_failure.run(
            classify_failure.ClosingAttempt(
                AttemptRef(self.cfg.storage.root, self.cfg.run_id, attempt), jobset_name(self.cfg.run_id, attempt)
            ),
            api_client=self.rc.api(self.token),
        )

    def workers(self, attempt: int, phase: str | None = "Running", count: int = HOSTS, timeout: float = 60) -> list:
        """Wait until ``count`` worker pods of the attempt are in ``phase``; returns them by completion index."""
        sel = f"jobset.sigs.k8s.io/jobset-name={jobset_name(self.cfg.run_id, attempt)}"

        def ready():
            pods = [p for p in self.rc.pods(self.ns, sel) if phase is None or p["status"].get("phase") == phase]
            return sorted(pods, key=lambda p: int(p["metadata"]["labels"][INDEX])) if len(pods) >= count else None

        return wait_for(f"{count} worker pods {phase or ''} of attempt {attempt}", ready, timeout)

    def beat(self, attempt: int, step: int, checkpoint: int | None = None) -> None:
        """Every worker's heartbeat at ``step`` (what the trainer writes to the run store)."""
        t = time.time()
        for i in range(HOSTS):
            b = WorkerHeartbeat(process_index=i, step=step, checkpoint_step=checkpoint, at=t, first_step_at=t)
            self.store.write_json(RunLayout.heartbeat(attempt, i), b.model_dump())

    def record(self, attempt: int) -> SupervisionRecord:
        return SupervisionRecord.model_validate(self.store.read_json(RunLayout.supervision(attempt)))

    def gone(self, attempt: int) -> bool:
        sel = f"jobset.sigs.k8s.io/jobset-name={jobset_name(self.cfg.run_id, attempt)}"
        return self.rc.jobset(self.ns, jobset_name(self.cfg.run_id, attempt)) is None and not self.rc.pods(self.ns, sel)


# --- pods on podexec's steps node ---------------------------------------------------------------------------------

SLEEPER = "import time; time.sleep(600)"


def worker_like_pod(
    rc: RealCluster,
    ns: str,
    name: str,
    *,
    share: bool,
    labels: dict | None = None,
    host_paths: dict[str, str] | None = None,
) -> str:
    """A pod on podexec's node shaped like a JobSet worker (one container, ``trainer``, no token), whose process
    names itself ``-m trainer`` <name> and sleeps; returns its name once Running. ``host_paths``: the node's
    directories it mounts (``hostPath``, ``DirectoryOrCreate``), by mount path."""
    mounts = sorted((host_paths or {}).items())
    spec = {
        "nodeName": PODEXEC_NODE,
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 2,
        "containers": [
            {
                "name": "trainer",
                "image": "registry.invalid/worker:0",
                "command": ["python", "-c", SLEEPER, "-m", "trainer", name],
                "env": [{"name": "POD_MARK", "value": name}],
                "volumeMounts": [{"name": f"host-{i}", "mountPath": at} for i, (at, _) in enumerate(mounts)],
            }
        ],
        "volumes": [
            {"name": f"host-{i}", "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
            for i, (_, path) in enumerate(mounts)
        ],
        **({"shareProcessNamespace": True} if share else {}),
    }
    meta = {"name": name, "namespace": ns, "labels": labels or {}}
    rc.apply({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec})
    wait_for(f"pod {name} Running", lambda: rc.core().read_namespaced_pod(name, ns).status.phase == "Running", 60)
    return name


def kube_exec(rc: RealCluster, ns: str, pod: str, command: list[str], **kw) -> tuple[str, str, int]:
    """stdout, stderr and exit code of ``command`` run in the pod through the API server (as ``kubectl exec``)."""
    from kubernetes.stream import stream

    opts = {"stdout": True, "stderr": True, "stdin": False, "tty": False, **kw}
    resp = stream(
        rc.core().connect_get_namespaced_pod_exec,
        pod,
        ns,
        container="trainer",
        command=command,
        _preload_content=False,
        **opts,
    )
    resp.run_forever(timeout=60)
    out, err, code = resp.read_stdout(), resp.read_stderr(), resp.returncode
    resp.close()
    return out, err, code

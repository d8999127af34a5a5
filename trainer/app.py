"""One worker of a training segment: join the gang, check it, restore, train, checkpoint, and exit by contract."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from jaxrec.adapters.documents import read_run_config, read_worker_reports
from jaxrec.adapters.store import DocumentError, RunLayout, RunStore, store_errors
from jaxrec.model.config import ConfigError, JobConfig
from jaxrec.model.contract import ExitCode
from jaxrec.model.records import (
    CheckpointManifest,
    EventKind,
    PreemptionSave,
    WorkerExitReport,
    WorkerHeartbeat,
    WorkerPhase,
    now,
    startup_attempts,
)
from jaxrec.model.tasks import TaskSpec, options_hash
from jaxrec.model.tiers import Tier
from trainer import compile_cache
from trainer.compile_cache import CacheCounter
from trainer.decisions import (
    Faults,
    TrainerExit,
    bucket_check_exit,
    compatibility_problems,
    coordinator_to_wait_for,
    exit_code_for,
    first_step_grace,
    local_identity,
    parse_faults,
    stop_flag,
    stuck_after_sigterm_s,
    task_problems,
    topology_problems,
)
from trainer.hooks import (
    CheckpointHook,
    EventsHook,
    FaultHook,
    HeartbeatHook,
    LeaseGauge,
    LocalSaveHook,
    MetricsHook,
    PaceHook,
    ProgressHook,
    SaveObservers,
    SaveOptions,
    check_finite_loss,
)
from trainer.lifecycle import ExitPath, Watchdog, install_abort_handler, native_crash, wait_for_chips, wait_for_listener
from trainer.loop import Hooks, Stepper, StepRecord, training_steps
from trainer.preemption import PeerLossNotice, PreemptionAgreement, distributed_client
from trainer.telemetry import Events, Laps, WorkerMetrics, cpu_seconds

if TYPE_CHECKING:
    from trainer.data import DataSource

log = logging.getLogger("trainer")

REFUSE_TOGETHER_S = 10.0
"""How long a worker refusing the restore waits for the others to reach the same verdict before it leaves."""
LEASE_GAUGE_EVERY_S = 60.0
"""How often worker 0 reads the run lease for its gauge: one small read a minute, well inside the two renewal
periods (20 minutes at most) the unsupervised-run alert waits."""


@dataclass(frozen=True)
class RunArgs:
    """What ``python -m trainer`` is told: where the run is, which attempt, which step to restore."""

    store_root: str
    run_id: str
    attempt: int
    restore_step: int
    metrics_port: int | None = None


class _ProcessTag(logging.Filter):
    def __init__(self, index: int | str):
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        record.process_index = self.index
        return True


def configure_logging(process_index: int | str) -> None:
    """Log to stderr; every line carries the process index."""
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler()
    handler.addFilter(_ProcessTag(process_index))
    handler.setFormatter(logging.Formatter("%(asctime)s [p%(process_index)s] %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for noisy in ("absl", "jax", "orbax", "grain", "urllib3", "google"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextlib.contextmanager
def _client_shutdown_timeout(shutdown_timeout_s: int):
    """Give the config's shutdown timeout to the distributed client too (``initialize`` passes it to the service)."""
    from jax._src import distributed as jd

    orig = getattr(getattr(jd, "_jax", None), "get_distributed_runtime_client", None)
    if orig is None:  # another JAX layout: the client keeps its default shutdown timeout
        yield
        return

    def client(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("shutdown_timeout", shutdown_timeout_s)
        return orig(*args, **kwargs)

    jd._jax.get_distributed_runtime_client = client
    try:
        yield
    finally:
        jd._jax.get_distributed_runtime_client = orig


class StepPace:
    """Keeps ``Worker.last_step_seconds``: the time between the last two completed steps (pauses included)."""

    def __init__(self, w: Worker):
        self.w = w
        self.prev: float | None = None

    def on_step(self, rec: StepRecord) -> None:
        """Record the interval since the previous step (the first step's own time, compile included)."""
        self.w.last_step_seconds = rec.seconds if self.prev is None else rec.finished_at - self.prev
        self.prev = rec.finished_at


class Worker:
    """One worker process: its identity, what it reports, and the phases before the loop."""

    def __init__(self, args: RunArgs, env: Mapping[str, str]):
        self.args = args
        self.env = env
        self.store = RunStore(args.store_root, args.run_id)
        self.process_index = int(env.get("JOB_COMPLETION_INDEX", "0") or 0)
        self.process_count = int(env.get("TRAINER_NUM_PROCESSES", "0") or 0)
        self.events = Events(env.get("TRAINER_EVENTS_DIR"), args.attempt, self.process_index)
        self.metrics: WorkerMetrics | None = None
        self.report = WorkerExitReport(
            run_id=args.run_id,
            attempt=args.attempt,
            process_index=self.process_index,
            process_count=self.process_count,
            exit_code=-1,
            exit_name="RUNNING",
            restore_step=args.restore_step if args.restore_step >= 0 else None,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            started_at=now(),
        )
        self.exit = ExitPath(self.store, args.attempt, self.report, self.events)
        self.watchdog: Watchdog | None = None
        self.laps = Laps()  # the start-up's parts, from the runtime ready to the state restored (``restore_parts``)
        self.stop_requested = False
        self.sigterm_at: float | None = None  # time.monotonic() of the first SIGTERM
        self._sigterm_step: int | None = None  # the last step completed when it came
        self._sigterm = threading.Event()  # set by the handler; ``_after_sigterm`` says it and watches the stop
        self._sigterm_watcher: threading.Thread | None = None
        self.last_step_seconds: float | None = None  # wall time of the newest step (the first includes its compile)
        self.saving: Any = None  # the CheckpointHook, once the loop runs
        self.peer_notice: PeerLossNotice | None = None  # once the distributed runtime is up
        self._abort_handler: Any = None

    def install_sigterm(self) -> None:
        """Make SIGTERM ours; the thread that acts on it is started first, not by the handler."""
        if self._sigterm_watcher is None:
            self._sigterm_watcher = threading.Thread(target=self._after_sigterm, name="sigterm", daemon=True)
            self._sigterm_watcher.start()
        signal.signal(signal.SIGTERM, self.on_sigterm)

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """Ask the gang to stop after the next step; there it decides whether a save fits the window.

        The handler runs on the training thread between two of its bytecodes, maybe inside a lock that thread
        holds (an event line half written): it takes none itself (no log, no event), only records the time and
        wakes ``_after_sigterm``. An event written here while the loop wrote the commit's event hung the worker
        until its SIGKILL, and its peers with it.
        """
        if not self.stop_requested:
            self.sigterm_at = time.monotonic()
            self._sigterm_step = self.report.last_step
            self.stop_requested = True
            self._sigterm.set()

    def _after_sigterm(self) -> None:
        """Once SIGTERM came: say so (log, event), then leave if the gang cannot step to agree on the stop."""
        self._sigterm.wait()
        log.info(
            "SIGTERM: stopping after the next step, saving only if it fits the shutdown window; exit %d",
            ExitCode.PREEMPTED,
        )
        self.events.emit(EventKind.SIGTERM, self._sigterm_step)
        self._leave_if_stuck(self._sigterm_step)

    def _leave_if_stuck(self, step_at_sigterm: int | None) -> None:
        """Leave at once when no step completes soon after SIGTERM: the stop can never be agreed.

        A gang whose peer died blocks in the step's collective; JobSet then SIGTERMs the survivors, and without
        this they would sit out the whole grace period (30 s on GKE) until SIGKILL. A save needs every process,
        so none can happen: leave with the report written. A save running on the training thread is waited for.
        """
        wait = stuck_after_sigterm_s(self.last_step_seconds)
        deadline = time.monotonic() + wait
        while True:
            time.sleep(0.05)
            if self.exit.exiting is not None or self.report.last_step != step_at_sigterm:
                return  # a step completed: the gang agrees on the stop and plans its save
            if self.saving is not None and self.saving.busy:
                deadline = time.monotonic() + wait
                continue
            notice = self.peer_notice.heard() if self.peer_notice is not None else None
            if notice is not None:
                self._leave_without_save(f"a peer is gone ({notice})")
            if time.monotonic() >= deadline:
                self._leave_without_save(
                    f"no step completed within {wait:.1f} s of SIGTERM (a peer is gone, or the gang is still starting)"
                )

    def _leave_without_save(self, why: str) -> NoReturn:
        """Exit 143 with ``preemption_save: skipped``: no save is possible without every process."""
        r = self.report
        r.preemption_save = PreemptionSave.SKIPPED
        r.preemption_reason = f"{why}: no save is possible without every process"
        self.exit.exit_now(ExitCode.PREEMPTED, message=r.preemption_reason)

    def stop_flag(self) -> int:
        """The stop flag of this process for the next step (0, or 1 + milliseconds since its SIGTERM)."""
        return stop_flag(None if self.sigterm_at is None else time.monotonic() - self.sigterm_at)

    # --- phases ----------------------------------------------------------------------------------

    def load_config(self) -> JobConfig:
        """Read the validated config from the run store, in a pod once the metadata server gives a token.

        A pod's metadata server may not answer in its first seconds (GKE's Workload Identity server starts with the
        node's other agents): that is waited out within the store's retry deadline, and a store still unreachable
        after it ends the worker as transient (69), never as an uncaught error; a refusal is configuration (2).
        """
        from jaxrec.adapters.store import await_credentials, first_line, is_transient, store_retry_deadline_s

        try:
            if self.store.is_gcs:
                await_credentials(store_retry_deadline_s())
            return read_run_config(self.store)
        except ConfigError as e:
            raise TrainerExit(ExitCode.CONFIGURATION, "; ".join(e.problems)) from None
        except DocumentError as e:
            raise TrainerExit(ExitCode.CONFIGURATION, str(e)) from None
        except store_errors() as e:
            said = f"the run config at {self.store.url()} could not be read: {type(e).__name__}: {first_line(e)}"
            if is_transient(e):
                raise TrainerExit(ExitCode.TRANSIENT, f"{said}; transient, the attempt is retried") from None
            raise TrainerExit(ExitCode.CONFIGURATION, f"{said}; check the workers' access to the run store") from None

    def check_bucket(self, cfg: JobConfig) -> None:
        """Wait for a token, then read the run bucket's metadata; raise TrainerExit(2) when either is refused.

        Without this check the first save or restore would fail as an application error (42) (docs/TRAINER.md,
        "Start-up"). Done before joining the gang: every worker has the same identity and refuses alike, and none
        waits for a gang that could not checkpoint.
        """
        if not self.store.is_gcs:
            return
        from google.cloud import storage
        from google.cloud.storage.retry import DEFAULT_RETRY

        from jaxrec.adapters.store import (
            await_credentials,
            make_gcs_client,
            share_credentials_with_gcsfs,
            split_gcs_url,
            store_retry_deadline_s,
        )
        from trainer.checkpointing import give_orbax_the_pods_credentials, settle_tensorstores_credentials

        bucket, prefix = split_gcs_url(self.args.store_root)
        retry = DEFAULT_RETRY.with_deadline(store_retry_deadline_s())
        # In a pod, every GCS client of the worker takes the metadata server's credentials when it needs a token:
        # gcsfs would go on anonymous, orbax's own client would ping, when the metadata server did not answer.
        share_credentials_with_gcsfs()
        give_orbax_the_pods_credentials()
        try:
            # First a token: orbax's tensorstore decides once, at its first request, whether it has credentials.
            await_credentials(store_retry_deadline_s())
            settle_tensorstores_credentials(bucket, f"{prefix}/.tensorstore-credentials".lstrip("/"))
            storage.Bucket(make_gcs_client(), bucket).reload(retry=retry)
        except Exception as e:  # noqa: BLE001 - bucket_check_exit decides; anything else is left to later calls
            verdict = bucket_check_exit(e, cfg, bucket)
            if verdict is not None:
                raise verdict from None
            log.warning(
                "could not read the metadata of gs://%s (%s: %s); going on",
                bucket,
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
            )

    def initialize(self, cfg: JobConfig, faults: Faults | None = None) -> None:
        """Join the gang with jax.distributed, using the config's timeouts (``native-crash@0``: die in it)."""
        import jax

        t = cfg.training
        kw = dict(
            initialization_timeout=t.init_timeout_s,
            heartbeat_timeout_seconds=t.heartbeat_timeout_s,
            shutdown_timeout_seconds=t.shutdown_timeout_s,
        )
        ident = None
        if cfg.slice.is_cpu:
            ident = local_identity(self.env)
            self._set_identity(ident.process_id, ident.num_processes)
            if ident.num_processes != cfg.slice.num_hosts:
                # Known before joining: every worker exits 2 alike instead of racing the gang's teardown.
                raise TrainerExit(
                    ExitCode.CONFIGURATION,
                    f"slice.hosts: the config expects {cfg.slice.num_hosts} processes but the slice started "
                    f"{ident.num_processes} (TRAINER_NUM_PROCESSES); start one worker per host or fix the slice",
                )
            if cfg.slice.local_devices == "cpu":
                os.environ["JAX_PLATFORMS"] = "cpu"
                jax.config.update("jax_platforms", "cpu")
                jax.config.update("jax_num_cpu_devices", cfg.slice.devices_per_host)
            # Everything JAX could detect is given, so no detection runs: in a pod (KUBERNETES_SERVICE_HOST set)
            # JAX's K8sCluster would load the in-cluster config, which a worker whose account mounts no token
            # lacks (jax 0.10.2, jax/_src/clusters/k8s_cluster.py, K8sCluster.is_env_present).
            # The coordination service listens where the local gang reaches it (loopback), not on every
            # interface (JAX's default is [::]:port, jax/_src/distributed.py).
            kw.update(
                coordinator_address=ident.coordinator_address,
                coordinator_bind_address=ident.coordinator_address,
                num_processes=ident.num_processes,
                process_id=ident.process_id,
                cluster_detection_method="deactivate",
            )
        if not (cfg.slice.is_cpu and cfg.slice.local_devices == "cpu"):
            # TPU chips an earlier program on this host still holds: wait (bounded) rather than fail in libtpu.
            waited = wait_for_chips()
            if waited > 0:
                log.info("waited %.1f s for another program to let this host's TPU chips go", waited)
        self._abort_handler = install_abort_handler(self.exit.on_abort)
        # SIGTERM is ours: the stop flag folded into each step makes every process save the same step.
        # JAX's preemption service would install its own SIGTERM handler over it.
        jax.config.update("jax_enable_preemption_service", False)
        if faults is not None and faults.due("native-crash", 0):
            native_crash()
        if cfg.slice.num_hosts == 1:
            # A gang of one has nothing to coordinate: no coordination service, no port bound (a TPU VM may not
            # let a process open any socket), and the trainer's key-value uses are skipped for one process.
            log.info("a gang of one process: no coordinator joined")
        else:
            self._join(t, kw, ident)
        self.install_sigterm()
        self._set_identity(jax.process_index(), jax.process_count())
        configure_logging(self.process_index)
        self.peer_notice = PeerLossNotice(self.args.attempt, self.process_index, distributed_client())
        self.exit.on_peer_lost = self.peer_notice.announce

    def _join(self, t: Any, kw: dict[str, Any], ident: Any) -> None:
        """``jax.distributed.initialize`` with the config's timeouts, once the coordinator listens (bounded)."""
        import jax

        coordinator = coordinator_to_wait_for(self.env, ident)
        if coordinator is not None:
            # One start-up budget: the wait takes at most half of it, and JAX's own wait gets the rest (so a
            # coordinator this probe cannot reach but JAX can still leaves JAX half the budget).
            waited = wait_for_listener(coordinator, t.init_timeout_s / 2)
            state = "not listening yet; joining anyway" if waited is None else f"listening after {waited:.2f} s"
            log.info("coordinator %s %s", coordinator, state)
            spent = t.init_timeout_s / 2 if waited is None else waited
            kw["initialization_timeout"] = max(1, math.ceil(t.init_timeout_s - spent))
        with _client_shutdown_timeout(t.shutdown_timeout_s):
            jax.distributed.initialize(**kw)

    @contextlib.contextmanager
    def refusing_together(self) -> Iterator[None]:
        """A refusal raised inside (``TrainerExit``) waits, bounded, until every process reached its verdict.

        Every process checks the same config, manifest and files, so they refuse alike; but process 0 hosts the
        coordination service, and if it left first the others would abort as peer-lost (exit 20) before their
        own verdict. So a refusing process waits at one barrier (at most ``REFUSE_TOGETHER_S``), then leaves.
        """
        try:
            yield
        except TrainerExit:
            try:
                self.gang_barrier("refused", REFUSE_TOGETHER_S)
            except Exception as e:  # noqa: BLE001 - another process did not refuse (or is gone): leave anyway
                log.warning("not every process refused alike (%s); leaving", str(e).splitlines()[0][:200])
            raise

    def gang_barrier(self, name: str, timeout_s: float) -> None:
        """Wait until every process of this attempt reached barrier ``name``; raise after ``timeout_s``.

        A coordination-service barrier, not a device collective. Nothing to wait for in a gang of one process.
        """
        client = distributed_client()
        if client is not None and self.process_count > 1:
            client.wait_at_barrier(f"jaxrec/{name}/{self.args.attempt}", int(timeout_s * 1000))

    def _set_identity(self, process_index: int, process_count: int) -> None:
        self.process_index, self.process_count = process_index, process_count
        self.report.process_index, self.report.process_count = process_index, process_count

    def check_topology(self, cfg: JobConfig) -> None:
        """Exit 2 when the gang jax.distributed formed is not the slice the config describes."""
        import jax

        problems = topology_problems(
            cfg,
            process_count=jax.process_count(),
            local_devices=jax.local_device_count(),
            global_devices=jax.device_count(),
            platform=jax.devices()[0].platform,
        )
        if problems:
            raise TrainerExit(ExitCode.CONFIGURATION, "; ".join(problems))

    def read_manifest(self, cfg: JobConfig, step: int) -> CheckpointManifest:
        """The manifest of the step to restore, checked for compatibility (exit 3 otherwise)."""
        rel = RunLayout.checkpoint_manifest(step)
        try:
            manifest = self.store.read_record(rel, CheckpointManifest)
        except DocumentError as e:
            raise TrainerExit(ExitCode.INCOMPATIBLE_CHECKPOINT, str(e)) from None
        if manifest is None:
            raise TrainerExit(
                ExitCode.INCOMPATIBLE_CHECKPOINT,
                f"--restore-step {step}: {self.store.url(rel)} does not exist; restore only a step "
                "restore-latest verified",
            )
        problems = [f"manifest step {manifest.step} != --restore-step {step}"] if manifest.step != step else []
        problems += compatibility_problems(manifest.config, manifest.process_count, cfg, self.process_count)
        _refuse_incompatible(step, problems)
        return manifest

    def set_aside_newer_steps(self, restore_step: int, timeout_s: float, barrier: str = "set-aside") -> None:
        """Move step directories newer than the restored one to quarantine (primary host), so saves never collide.

        Those steps were skipped by restore-latest (no manifest, or written by a closed attempt). The others wait
        at a coordination-service barrier (at most ``timeout_s``), not a device collective: nothing is compiled
        for it and no gloo all-gather runs before the first step.
        """
        if self.process_index == 0:
            for step in self.store.checkpoint_steps():
                if step > restore_step:
                    dst = RunLayout.quarantine(step, f"-superseded-attempt{self.args.attempt}-{int(now())}")
                    n = self.store.move(RunLayout.checkpoint(step), dst)
                    log.warning("checkpoint %d is newer than the restore step; moved %d objects to %s", step, n, dst)
        self.gang_barrier(barrier, timeout_s)


def _refuse_incompatible(step: int, problems: list[str]) -> None:
    """Exit 3 naming each of checkpoint ``step``'s problems, if it has any."""
    if problems:
        raise TrainerExit(
            ExitCode.INCOMPATIBLE_CHECKPOINT, f"checkpoint {step} is incompatible: " + "; ".join(problems)
        )


def phase_beat(w: Worker, phase: WorkerPhase, interval_s: float) -> None:
    """A heartbeat saying the worker enters ``phase`` before its first step (restore, compile).

    The supervisor's verdict on a gang with no first step names where each worker is. A write the store refuses is
    logged only.
    """
    beat = WorkerHeartbeat(process_index=w.process_index, at=now(), phase=phase)
    try:
        w.store.bounded(interval_s).write_record(RunLayout.heartbeat(w.args.attempt, w.process_index), beat)
    except Exception as e:  # noqa: BLE001 - progress reporting must never stop training
        log.warning("could not write the %s heartbeat: %s", phase.value, e)


def earlier_first_steps(store: RunStore, attempt: int) -> list[float]:
    """Seconds from the runtime being ready to the first step, per worker report of the run's latest earlier attempts.

    A report that cannot be read adds nothing: the configured grace then stands alone.
    """
    out = []
    for a in startup_attempts(attempt):
        try:
            reports, _ = read_worker_reports(store, a)
        except (DocumentError, *store_errors()) as e:
            log.info("start-up of attempt %d not read (%s): the configured compile grace stands", a, e)
            continue
        out += [r.first_step_at - r.initialized_at for r in reports if r.first_step_at and r.initialized_at]
    return out


def run(args: RunArgs, env: Mapping[str, str] | None = None) -> NoReturn:
    """Run one worker to its end; always leaves by ``os._exit`` with a contract code."""
    env = dict(os.environ if env is None else env)
    w = Worker(args, env)
    out = w.exit
    configure_logging(w.process_index)
    w.events.emit(EventKind.STARTED, cpu_s=cpu_seconds())
    w.install_sigterm()
    try:
        cfg = w.load_config()
        faults = parse_faults(env.get("TRAINER_FAULT"))
        w.check_bucket(cfg)
    except TrainerExit as e:
        out.exit_now(e.code, message=str(e))
    try:
        w.initialize(cfg, faults)
    except TrainerExit as e:
        out.exit_now(e.code, message=str(e))
    except Exception as e:  # noqa: BLE001 - any failure to start the runtime has one contract code
        out.exit_now(exit_code_for(e, during_init=True), e)
    w.report.initialized_at = now()
    grace = first_step_grace(cfg.training.compile_grace_s, earlier_first_steps(w.store, w.args.attempt))
    if grace > cfg.training.compile_grace_s:
        log.info("first-step grace %.0f s: twice the longest start-up of this run's latest attempts", grace)
    w.watchdog = Watchdog(cfg.training.hang_timeout_s, grace, out, save_timeout_s=cfg.supervision.save_timeout_s)
    if w.peer_notice is not None:
        w.watchdog.peer_lost = w.peer_notice.heard
    # TRAINER_WATCHDOG=off: rehearse a silent hang that only the supervisor's heartbeat deadline can see.
    if env.get("TRAINER_WATCHDOG", "on") != "off":
        w.watchdog.start()
    try:
        _train(w, cfg, faults)
    except TrainerExit as e:
        out.exit_now(e.code, message=str(e))
    except Exception as e:  # noqa: BLE001 - every failure leaves with a contract code and a report
        out.exit_now(exit_code_for(e), e)
    raise AssertionError("unreachable")  # _train always exits


@dataclass(frozen=True)
class Training:
    """What one attempt trains with once opened: the config, the train state, the data, the checkpointer, the tiers."""

    cfg: JobConfig
    tr: Any  # the train state's functions and shardings
    source: Any
    ckpt: Any
    tier: Any = None  # the local tiers (None when ``checkpoint.local`` is off)


def _resume(cfg: JobConfig, tr: Any, restore_step: int, source: Any, state: Any, saved_iter: Any) -> tuple[Any, Any]:
    """Check a restored state and build its data iterator (``exact``: at the saved position; else reshuffled)."""
    import jax
    import numpy as np

    from trainer import data as data_lib

    exact = cfg.data.resume_mode == "exact"
    got_step = int(state["step"])
    if got_step != restore_step:
        raise TrainerExit(ExitCode.INCOMPATIBLE_CHECKPOINT, f"checkpoint {restore_step} holds step {got_step}")
    saved = data_lib.DataPosition(
        int(state["data_order_seed"]), int(state["data_start_step"]), restore_step - int(state["data_start_step"])
    )
    pos = data_lib.resume_position(cfg.data.resume_mode, cfg.data.seed, restore_step, saved)
    start = data_lib.DataPosition(pos.order_seed, pos.start_step, 0)
    it = data_lib.make_iterator(cfg.data, source.examples, start, jax.process_index(), jax.process_count())
    if exact:
        assert saved_iter is not None
        it.set_state(saved_iter)
        it.start_prefetch()  # as grain's own restore does: the first batch is under way before the first step
        at = it.get_state().get("next_index")
        if at != pos.next_index:
            raise TrainerExit(
                ExitCode.INCOMPATIBLE_CHECKPOINT,
                f"checkpoint {restore_step}: data iterator at batch {at}, expected {pos.next_index}",
            )
    else:
        # Host values (numpy): a jnp value would compile an op on this process's own device first.
        state["data_order_seed"] = jax.device_put(np.int32(pos.order_seed), tr.replicated)
        state["data_start_step"] = jax.device_put(np.int32(pos.start_step), tr.replicated)
    log.info("restored step %d (data order %d, batch %d)", restore_step, pos.order_seed, pos.next_index)
    return state, it


def _restore_checked(
    w: Worker, parts: Training, manifest: CheckpointManifest | None
) -> tuple[Any, Any, CheckpointManifest | None]:
    """Restore ``w.args.restore_step`` and check the bytes read; a damaged step falls back as restore-latest would.

    With the local tiers (``parts.tier``), the gang first chooses among the hosts' copies and restore-latest's GCS
    step (``LocalTier.restore``): a newer step whose every part has a verified copy on the slice is read from
    the hosts' disks instead, and the GCS step is read only when that is the closest complete copy.

    Returns:
        The state and data iterator (None, None for a fresh start) and the manifest of the step restored;
        ``w.args.restore_step`` and the report name the step actually restored.
    """
    cfg, tr, ckpt, source, tier = parts.cfg, parts.tr, parts.ckpt, parts.source, parts.tier
    step = w.args.restore_step
    if tier is not None:
        got = tier.restore(step, tr.abstract_state)
        w.laps.lap("the hosts' copies chosen and read")
        if got.state is not None:  # every part from the hosts' disks: no GCS read
            assert got.plan.step is not None
            step = got.plan.step
            w.args = dataclasses.replace(w.args, restore_step=step)
            w.report.restore_step = step
            w.report.restore_tier = got.plan.tier
            state, it = _resume(cfg, tr, step, source, got.state, got.data_state)
            return state, it, manifest
        w.report.restore_tier = Tier.GCS if step >= 0 else None
    while manifest is not None:
        # In the current sharding; the data iterator's saved state is read only where ``exact`` resumes it.
        state, saved_iter = ckpt.restore(step, tr.abstract_state, with_data=cfg.data.resume_mode == "exact")
        state, it = _resume(cfg, tr, step, source, state, saved_iter)
        ckpt.last_committed = step
        w.laps.lap("checkpoint read")
        fallback = ckpt.check_restored(step, manifest)
        w.laps.lap("bytes read checked")
        if fallback is None:
            return state, it, manifest
        step = fallback
        w.args = dataclasses.replace(w.args, restore_step=step)
        w.report.restore_step = step if step >= 0 else None
        manifest = w.read_manifest(cfg, step) if step >= 0 else None
        w.set_aside_newer_steps(step, cfg.training.init_timeout_s, barrier=f"set-aside-{step}")
        ckpt.mgr.reload()  # orbax lists the steps once: the damaged one (and any newer) are gone now
    return None, None, None


def _compile_ahead(cfg: JobConfig, tr: Any, source: Any, process_index: int, process_count: int) -> Any:
    """Start compiling the step on a thread from abstract inputs (None when one batch's shapes cannot be read)."""
    from trainer import data as data_lib
    from trainer.ahead import AheadCompile, abstract_inputs

    try:
        local = data_lib.build_dataset(cfg.data, source.examples, cfg.data.seed, process_index, process_count)[0]
        return AheadCompile(tr, *abstract_inputs(tr, local, process_count))
    except Exception as e:  # noqa: BLE001 - the first step compiles it the usual way instead
        log.warning("not compiling the step ahead (%s: %s)", type(e).__name__, e)
        return None


def _compiled_step(w: Worker, ahead: Any, restore_started: float) -> Any:
    """Wait for the step compiled ahead; record how long it took and how much of it ran beside the restore."""
    from trainer.ahead import overlap_seconds

    if ahead is None:
        return None
    res = ahead.result()
    restored = w.report.restored_at or now()
    waited = max(0.0, res.finished_at - restored)
    overlap = overlap_seconds(restore_started, restored, res.started_at, res.finished_at)
    if res.compiled is not None:
        w.report.compile_seconds = res.seconds
    w.events.emit(
        EventKind.COMPILED,
        compile_seconds=round(res.seconds, 4),
        overlap_seconds=round(overlap, 4),
        waited_seconds=round(waited, 4),
        reason=res.error,
    )
    log.info(
        "step compiled ahead in %.2f s (%.2f s beside the restore, %.2f s waited after it)",
        res.seconds,
        overlap,
        waited,
    )
    return res.compiled


def _enable_compilation_cache(w: Worker, cfg: JobConfig) -> CacheCounter | None:
    import jax

    directory = compile_cache.cache_dir(cfg, w.store)
    if directory is None:
        return None
    log.info("persistent compilation cache at %s", directory)
    return compile_cache.enable(directory, platform=jax.devices()[0].platform, process_count=jax.process_count())


def _start_metrics(w: Worker, cfg: JobConfig) -> WorkerMetrics:
    m = WorkerMetrics(cfg.run_id, w.args.attempt, w.process_index)
    base_port = cfg.monitoring.metrics_port if w.args.metrics_port is None else w.args.metrics_port
    if base_port > 0:
        # A local gang's workers share one host: each its own port, on loopback (Prometheus on that host scrapes
        # it); a pod's is scraped at the pod's address.
        local = cfg.slice.is_cpu
        m.serve(base_port + (w.process_index if local else 0), addr="127.0.0.1" if local else "0.0.0.0")
    m.set("jaxrec_expected_workers", cfg.slice.num_hosts)
    m.set("jaxrec_worker_up", 1)
    if w.process_index == 0:
        LeaseGauge(w.store, m, LEASE_GAUGE_EVERY_S).start()
    w.metrics = w.exit.metrics = m
    return m


def _hooks(
    w: Worker,
    parts: Training,
    faults: Faults,
    stepper: Stepper,
    cache: CacheCounter | None,
    manifest: CheckpointManifest | None,
) -> tuple[Hooks, CheckpointHook]:
    """The loop's subscribers, in the order they see each step."""
    assert w.metrics is not None and w.watchdog is not None
    cfg, ckpt = parts.cfg, parts.ckpt
    fault = FaultHook(faults, primary=w.process_index == 0)
    agreement = PreemptionAgreement(
        w.args.attempt, w.process_index, cfg.slice.preemption_window_s, distributed_client()
    )
    heartbeat = HeartbeatHook(
        w.store, w.args.attempt, w.process_index, cfg.supervision.heartbeat_interval_s, ckpt, w.report
    )
    options = SaveOptions(
        interval_steps=cfg.checkpoint.interval_steps,
        total_steps=cfg.training.total_steps,
        async_save=cfg.checkpoint.async_save,
        restore_step=w.args.restore_step,
        # The restored step's own save time is the first estimate, until this attempt commits a save.
        estimate_s=manifest.save_seconds if manifest is not None else None,
        steps_ahead=cfg.training.steps_ahead,
    )
    observers = SaveObservers(
        events=w.events, metrics=w.metrics, report=w.report, watchdog=w.watchdog, heartbeat=heartbeat, faults=fault
    )
    saving = CheckpointHook(ckpt, stepper, options, observers, agreement=agreement)
    hooks = Hooks()
    hooks.before_step(fault.before_step)
    hooks.hold(fault.acts_before_next)
    hooks.after_dispatch(saving.capture)
    hooks.hold(saving.holds)
    hooks.add(fault.on_step)
    hooks.add(check_finite_loss)
    hooks.add(ProgressHook(w.report, w.watchdog, cache).on_step)
    hooks.add(EventsHook(w.events, cache).on_step)
    hooks.add(heartbeat.on_step)
    hooks.add(MetricsHook(w.metrics, ckpt, started=now()).on_step)
    hooks.add(saving.on_step)
    if cfg.training.step_delay_s:
        hooks.add(PaceHook(cfg.training.step_delay_s).on_step)
    hooks.add(StepPace(w).on_step)
    w.saving = saving
    return hooks, saving


def _open_task(
    w: Worker, cfg: JobConfig, restore_step: int
) -> tuple[TaskSpec, Any, DataSource, CheckpointManifest | None]:
    """The task, its data source and the manifest of the step to restore (None: fresh).

    Every process refuses together (``TrainerExit``) when the data cannot be read or the checkpoint does not fit.
    """
    from trainer import data as data_lib

    spec = cfg.task.spec()
    task = spec.build(cfg.task_options())
    with w.refusing_together():
        try:
            source = data_lib.open_source(task, cfg.data)
        except ValueError as e:  # data.files matches nothing: a configuration problem, one line
            raise TrainerExit(ExitCode.CONFIGURATION, str(e)) from None
        manifest = w.read_manifest(cfg, restore_step) if restore_step >= 0 else None
        if manifest is not None:
            problems = task_problems(manifest, spec.name, spec.version, source.version, cfg.data.resume_mode)
            _refuse_incompatible(restore_step, problems)
    if manifest is not None and manifest.dataset_version != source.version:
        log.warning("dataset changed (%s -> %s): reshuffling", manifest.dataset_version, source.version)
    return spec, task, source, manifest


def _train(w: Worker, cfg: JobConfig, faults: Faults) -> NoReturn:
    import jax
    import numpy as np

    from trainer import data as data_lib
    from trainer import train_state
    from trainer.checkpointing import Checkpointer, DataIdentity

    assert w.watchdog is not None
    t = cfg.training
    w.check_topology(cfg)
    cache = _enable_compilation_cache(w, cfg)
    restore_step = w.args.restore_step
    log.info(
        "process %d/%d, devices local %d global %d (%s), attempt %d, restore step %s",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].platform,
        w.args.attempt,
        restore_step if restore_step >= 0 else "none (fresh start)",
    )
    # cpu_s (this process's CPU seconds so far, every thread) shows where start-up is CPU work and where waiting.
    w.events.emit(
        EventKind.INITIALIZED, process_count=jax.process_count(), devices=jax.device_count(), cpu_s=cpu_seconds()
    )
    w.laps = Laps()
    m = _start_metrics(w, cfg)

    spec, task, source, manifest = _open_task(w, cfg, restore_step)
    w.laps.lap("task, data and manifest opened")
    mesh = train_state.make_mesh()
    tr = train_state.build(cfg, mesh, task)
    w.laps.lap("model built")
    pc, pi = jax.process_count(), jax.process_index()
    # The step compiles beside everything after the model's shapes are known: the store's work below is waiting.
    ahead = _compile_ahead(cfg, tr, source, pi, pc)
    w.laps.lap("compile started")
    w.set_aside_newer_steps(restore_step, t.init_timeout_s)
    w.laps.lap("newer steps set aside")
    identity = DataIdentity(source.version, spec.name, spec.version, options_hash(cfg.task_options().model_dump()))
    ckpt = Checkpointer(w.store, cfg, w.args.attempt, dict(mesh.shape), identity)
    ckpt.prepare_snapshot(tr.abstract_state)  # compiled beside the restore: the first save does not compile it
    w.exit.last_checkpoint = lambda: ckpt.last_committed
    w.laps.lap("checkpointer opened")
    tier = _open_local_tier(w, cfg, dict(mesh.shape), source.version)
    if tier is not None:
        w.laps.lap("local tier opened")
    t0 = now()
    phase_beat(w, WorkerPhase.RESTORE, cfg.supervision.heartbeat_interval_s)
    training = Training(cfg, tr, source, ckpt, tier)
    state, it, manifest = _restore_checked(w, training, manifest)
    restore_step = w.args.restore_step
    if state is None:
        state = tr.init_fn(np.int32(t.seed))
        it = data_lib.make_iterator(cfg.data, source.examples, data_lib.DataPosition(cfg.data.seed, 0, 0), pi, pc)
    jax.block_until_ready(state)
    w.laps.lap("state ready on the devices")
    _say_restored(w, restore_step, t0)
    phase_beat(w, WorkerPhase.COMPILE, cfg.supervision.heartbeat_interval_s)
    compiled = _compiled_step(w, ahead, t0)
    w.watchdog.touch()

    stepper = Stepper(tr, state, it, pc, compiled=compiled)
    start = int(state["step"])
    w.report.last_step = start
    m.set("jaxrec_train_step", start)
    if ckpt.last_committed is not None:
        m.set("jaxrec_checkpoint_step", ckpt.last_committed)
    hooks, saving = _hooks(w, training, faults, stepper, cache, manifest)
    if tier is not None:
        _add_local_saves(w, hooks, tier, stepper, tr.abstract_state, t.total_steps)
    last = StepRecord(start)
    for last in training_steps(stepper, start, t.total_steps, w.stop_flag, hooks, t.steps_ahead):
        hooks.run(last)
    if not saving.abandoned:
        saving.finish()
    _finish(w, stepper, ckpt, last, abandoned=saving.abandoned)


def _say_restored(w: Worker, restore_step: int, restore_started: float) -> None:
    """Record the state restored (or built): in the report, a log line with its parts, and the restored event."""
    w.report.restored_at = now()
    w.report.restore_seconds = w.report.restored_at - restore_started
    w.report.restore_parts = dict(w.laps.parts)
    log.info(
        "state ready %.2f s after the runtime: %s",
        sum(w.laps.parts.values()),
        ", ".join(f"{k} {v:.2f} s" for k, v in w.laps.parts.items()),
    )
    w.events.emit(
        EventKind.RESTORED,
        max(restore_step, 0),
        restore_step=restore_step,
        restore_tier=w.report.restore_tier,
        restore_seconds=w.report.restore_seconds,
        restore_parts=w.report.restore_parts,
        cpu_s=cpu_seconds(),
    )


def _add_local_saves(w: Worker, hooks: Hooks, tier: Any, stepper: Stepper, abstract_state: Any, total: int) -> None:
    """Save to the hosts' disks at the local tier's interval (the loop holds at those steps), watched."""
    from trainer.checkpointing import _snapshot_fn

    assert w.metrics is not None
    metrics, events = w.metrics, w.events

    def saved(step: int, kind: str) -> None:  # each local and peer part that lands: its gauge and an event
        metrics.set(f"jaxrec_{kind}_checkpoint_step", step)
        events.emit(EventKind.LOCAL_SAVED, step, reason=kind)

    tier.on_saved = saved
    snapshot = _snapshot_fn(abstract_state).lower(abstract_state).compile()
    local = LocalSaveHook(tier, stepper, snapshot, total)
    hooks.add(local.on_step)
    hooks.hold(local.due)


def _open_local_tier(w: Worker, cfg: JobConfig, mesh_shape: dict[str, int], dataset_version: str) -> Any:
    """The local and peer tiers as this process takes part in them (None when ``checkpoint.local`` is off)."""
    if not cfg.checkpoint.local.enabled:
        return None
    import jax

    from trainer.local_parts import Layout
    from trainer.local_tier import LocalTier

    layout = Layout(
        cfg.run_id, cfg.config_hash(), jax.process_count(), jax.local_device_count(), mesh_shape, dataset_version
    )
    return LocalTier(cfg, w.store, w.args.attempt, distributed_client(), w.env, layout)


def _finish(w: Worker, stepper: Stepper, ckpt: Any, last: StepRecord, *, abandoned: bool = False) -> NoReturn:
    """Training ended (all steps, or a stop every process agreed on): report, leave together, exit by contract.

    ``abandoned``: a SIGTERM stop whose save did not fit the window: no wait for a save in flight (it is
    cut and never restored); the report is written and the gang leaves at once. The parameter digest
    gathers every parameter onto every host (0.9 s for the tiny local model on a loaded machine, far more
    for a real one), so it is taken only at the end of training, never inside a shutdown window.
    """
    import jax

    from trainer import train_state

    elapsed = now() - (w.report.first_step_at or w.report.restored_at or now())
    done = last.step - max(w.args.restore_step, 0) - 1
    if done > 0 and elapsed > 0:
        w.report.steps_per_second = done / elapsed
    code = ExitCode.PREEMPTED if last.stop_agreed else ExitCode.OK
    if code == ExitCode.OK:
        w.report.params_digest = train_state.params_digest(stepper.state["params"])
        w.report.state_digest = train_state.local_state_digest(stepper.state)
        log.info("step %d reached; params digest %s", last.step, w.report.params_digest[:16])
    w.exit.write_report(code)
    if not abandoned:
        ckpt.close()
    # Leave together: process 0 hosts the coordination service and must not go first.
    w.exit.exiting = int(code)
    with contextlib.suppress(Exception):
        jax.distributed.shutdown()
    w.exit.exit_now(code)


def parse_args(argv: Sequence[str] | None) -> RunArgs:
    """Parse the worker's command line."""
    from jaxrec.adapters import cli

    p = cli.StepArgumentParser(prog="python -m trainer", description="Run one worker of a training segment.")
    p.add_argument(
        "--store-root", required=True, type=cli.store_root, help="Run store root: gs://bucket/prefix or a directory."
    )
    p.add_argument("--run-id", required=True, type=cli.run_id, help="Run id (names runs/<run-id>/ in the store).")
    p.add_argument("--attempt", type=cli.attempt, required=True, help="Attempt number n (reports go to attempts/<n>/).")
    p.add_argument(
        "--restore-step",
        type=cli.bounded_int(-1, 2**31 - 1, "a step"),
        default=-1,
        help="Step to restore (-1: fresh start).",
    )
    p.add_argument(
        "--metrics-port",
        type=cli.bounded_int(0, 65535, "a port"),
        default=None,
        help="Prometheus port (the CPU slice: + process index; 0: off). Default: from the config.",
    )
    a = p.parse_args(argv)
    return RunArgs(a.store_root, a.run_id, a.attempt, a.restore_step, a.metrics_port)

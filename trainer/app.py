"""One worker of a training segment: join the gang, check it, restore, train, checkpoint, and exit by contract."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import signal
import socket
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from recovery_steps.kernel.config import ConfigError, JobConfig
from recovery_steps.kernel.contract import ExitCode
from recovery_steps.kernel.documents import read_run_config
from recovery_steps.kernel.records import CheckpointManifest, WorkerExitReport
from recovery_steps.kernel.store import DocumentError, RunLayout, RunStore
from trainer.decisions import (
    Faults,
    TrainerExit,
    compatibility_problems,
    exit_code_for,
    local_identity,
    parse_faults,
    topology_problems,
    watchdog_limit,
)
from trainer.telemetry import Events, WorkerMetrics

log = logging.getLogger("trainer")


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


def install_abort_handler(on_abort: Any) -> Any:
    """Run ``on_abort()`` when the runtime aborts the process (SIGABRT from C++), before it dies.

    When the coordination service reports a lost peer or a lost service, the JAX runtime aborts
    from a C++ thread; a Python-level signal handler would never run. A C-level handler (a ctypes
    thunk) runs in the aborting thread, takes the GIL and can write the exit report and leave by
    ``os._exit`` with the contract code. Returns the handler, which the caller must keep alive.
    """
    import ctypes

    handler_t = ctypes.CFUNCTYPE(None, ctypes.c_int)
    handler = handler_t(lambda signum: on_abort())
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, handler_t]
    libc.signal(signal.SIGABRT, handler)
    return handler


class Worker:
    """State of one worker process and its single exit path."""

    def __init__(self, args: RunArgs, env: Mapping[str, str]):
        self.args = args
        self.env = env
        self.store = RunStore(args.store_root, args.run_id)
        self.cfg: JobConfig | None = None
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
            started_at=time.time(),
        )
        self.stop_requested = False
        self.first_step_done = False
        self.last_progress = time.monotonic()
        self._exit_lock = threading.Lock()
        self.exiting: int | None = None
        self.ckpt: Any = None
        self._abort_handler: Any = None

    # --- exit path -------------------------------------------------------------------------------

    def write_report(self, code: int, exc: BaseException | None = None, message: str | None = None) -> None:
        """Write this worker's exit report to the run store (best effort: a store failure is logged)."""
        r = self.report
        r.exit_code = int(code)
        r.exit_name = ExitCode(code).name if code in ExitCode._value2member_map_ else str(code)
        r.ended_at = time.time()
        r.process_index, r.process_count = self.process_index, self.process_count
        r.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if self.ckpt is not None and self.ckpt.last_committed is not None:
            r.last_checkpoint_step = self.ckpt.last_committed
        if exc is not None:
            r.exception_type = type(exc).__name__
            r.exception_message = str(exc)[:2000]
            tb = "".join(traceback.format_exception(exc))
            r.traceback = tb[-4000:]
        elif message:
            r.exception_message = message
        try:
            self.store.write_record(RunLayout.worker_report(self.args.attempt, self.process_index), r)
        except Exception as e:  # noqa: BLE001 - the exit must happen whatever the store does
            log.error("could not write the exit report: %s", e)

    def exit_now(self, code: int, exc: BaseException | None = None, message: str | None = None) -> NoReturn:
        """Write the report and leave at once with ``code`` (from any thread; the first caller wins)."""
        if not self._exit_lock.acquire(blocking=True, timeout=30):
            os._exit(code)
        self.exiting = code
        text = message or (f"{type(exc).__name__}: {exc}" if exc else "")
        level = logging.INFO if code in (ExitCode.OK, ExitCode.PREEMPTED) else logging.ERROR
        log.log(level, "exiting with %d (%s)%s", code, ExitCode(code).name, f": {text}" if text else "")
        self.write_report(code, exc, message)
        self.events.emit("exit", self.report.last_step, code=int(code), reason=text[:500])
        if self.metrics is not None:
            self.metrics.set("jaxrec_worker_up", 0)
        logging.shutdown()
        os._exit(int(code))

    def on_abort(self) -> None:
        """The runtime aborts (the coordination service lost a peer or itself): leave as peer-lost."""
        if self.exiting is not None:
            os._exit(self.exiting)
        self.exit_now(
            ExitCode.PEER_LOST,
            message="the JAX runtime aborted: the coordination service reported a lost "
            "peer or was lost itself (see the worker log)",
        )

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """Ask for a save at the current step; every process agrees on that step through the next step."""
        if not self.stop_requested:
            log.info("SIGTERM: saving at the end of the step in flight, then exiting %d", ExitCode.PREEMPTED)
            self.events.emit("sigterm", self.report.last_step)
        self.stop_requested = True

    def touch(self) -> None:
        """Record progress for the watchdog."""
        self.last_progress = time.monotonic()

    def watchdog(self) -> None:
        """Exit with the hang code when no progress is made within the configured limit."""
        assert self.cfg is not None
        t = self.cfg.training
        while self.exiting is None:
            time.sleep(0.5)
            limit = watchdog_limit(t.hang_timeout_s, t.compile_grace_s, self.first_step_done)
            idle = time.monotonic() - self.last_progress
            if idle > limit:
                self.exit_now(ExitCode.HANG, message=f"no step completed for {idle:.0f} s (limit {limit:.0f} s)")

    # --- phases ----------------------------------------------------------------------------------

    def load_config(self) -> JobConfig:
        """Read the validated config from the run store."""
        try:
            return read_run_config(self.store)
        except ConfigError as e:
            raise TrainerExit(ExitCode.CONFIGURATION, "; ".join(e.problems)) from None
        except DocumentError as e:
            raise TrainerExit(ExitCode.CONFIGURATION, str(e)) from None

    def initialize(self, cfg: JobConfig) -> None:
        """Join the gang with jax.distributed, using the config's timeouts."""
        import jax

        t = cfg.training
        kw = dict(
            initialization_timeout=t.init_timeout_s,
            heartbeat_timeout_seconds=t.heartbeat_timeout_s,
            shutdown_timeout_seconds=t.shutdown_timeout_s,
        )
        if cfg.slice.is_local:
            ident = local_identity(self.env)
            self.process_index, self.process_count = ident.process_id, ident.num_processes
            if ident.num_processes != cfg.slice.num_hosts:
                # Known before joining: every worker exits 2 alike instead of racing the gang's teardown.
                raise TrainerExit(
                    ExitCode.CONFIGURATION,
                    f"slice.hosts: the config expects {cfg.slice.num_hosts} processes but the slice started "
                    f"{ident.num_processes} (TRAINER_NUM_PROCESSES); start one worker per host or fix the slice",
                )
            os.environ["JAX_PLATFORMS"] = "cpu"
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", cfg.slice.devices_per_host)
            kw.update(
                coordinator_address=ident.coordinator_address,
                num_processes=ident.num_processes,
                process_id=ident.process_id,
            )
        self._abort_handler = install_abort_handler(self.on_abort)
        # SIGTERM is ours: the stop flag folded into each step makes every process save the same step.
        # JAX's preemption service would install its own SIGTERM handler over it.
        jax.config.update("jax_enable_preemption_service", False)
        with _client_shutdown_timeout(t.shutdown_timeout_s):
            jax.distributed.initialize(**kw)
        signal.signal(signal.SIGTERM, self.on_sigterm)
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        configure_logging(self.process_index)

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
        problems = []
        if manifest.step != step:
            problems.append(f"manifest step {manifest.step} != --restore-step {step}")
        problems += compatibility_problems(manifest.config, manifest.process_count, cfg, self.process_count)
        if problems:
            raise TrainerExit(
                ExitCode.INCOMPATIBLE_CHECKPOINT, f"checkpoint {step} is incompatible: " + "; ".join(problems)
            )
        return manifest

    def set_aside_newer_steps(self, restore_step: int) -> None:
        """Move step directories newer than the restored one to quarantine (primary host), so saves never collide.

        Those steps were skipped by restore-latest (no manifest, or written by a closed attempt).
        """
        from jax.experimental import multihost_utils

        if self.process_index == 0:
            for step in self.store.checkpoint_steps():
                if step > restore_step:
                    dst = RunLayout.quarantine(step, f"-superseded-attempt{self.args.attempt}-{int(time.time())}")
                    n = self.store.move(RunLayout.checkpoint(step), dst)
                    log.warning("checkpoint %d is newer than the restore step; moved %d objects to %s", step, n, dst)
        multihost_utils.sync_global_devices("trainer-set-aside-newer-steps")


def run(args: RunArgs, env: Mapping[str, str] | None = None) -> NoReturn:
    """Run one worker to its end; always leaves by ``os._exit`` with a contract code."""
    env = dict(os.environ if env is None else env)
    w = Worker(args, env)
    configure_logging(w.process_index)
    w.events.emit("started")
    signal.signal(signal.SIGTERM, w.on_sigterm)
    try:
        cfg = w.load_config()
        w.cfg = cfg
        faults = parse_faults(env.get("TRAINER_FAULT"))
    except TrainerExit as e:
        w.exit_now(e.code, message=str(e))
    try:
        w.initialize(cfg)
    except TrainerExit as e:
        w.exit_now(e.code, message=str(e))
    except Exception as e:  # noqa: BLE001 - any failure to start the runtime has one contract code
        w.exit_now(exit_code_for(e, during_init=True), e)
    w.report.initialized_at = time.time()
    w.touch()
    threading.Thread(target=w.watchdog, name="watchdog", daemon=True).start()
    try:
        _train(w, cfg, faults)
    except TrainerExit as e:
        w.exit_now(e.code, message=str(e))
    except Exception as e:  # noqa: BLE001 - every failure leaves with a contract code and a report
        w.exit_now(exit_code_for(e), e)
    raise AssertionError("unreachable")  # _train always exits


def _restore(cfg: JobConfig, tr: Any, ckpt: Any, restore_step: int) -> tuple[Any, Any]:
    """The training state and data iterator of checkpoint ``restore_step``, in the current sharding.

    ``exact`` resumes the data iterator at its saved position (checked against the step);
    ``reshuffle`` starts a new order seeded by the restored step.
    """
    import jax
    import jax.numpy as jnp

    from trainer import data as data_lib

    state = ckpt.restore_state(restore_step, tr.abstract_state)
    got_step = int(state["step"])
    if got_step != restore_step:
        raise TrainerExit(ExitCode.INCOMPATIBLE_CHECKPOINT, f"checkpoint {restore_step} holds step {got_step}")
    saved = data_lib.DataPosition(
        int(state["data_order_seed"]), int(state["data_start_step"]), restore_step - int(state["data_start_step"])
    )
    pos = data_lib.resume_position(cfg.data.resume_mode, cfg.data.seed, restore_step, saved)
    start = data_lib.DataPosition(pos.order_seed, pos.start_step, 0)
    it = data_lib.make_iterator(cfg.data, cfg.model, start, jax.process_index(), jax.process_count())
    if cfg.data.resume_mode == "exact":
        it = ckpt.restore_data(restore_step, it)
        at = it.get_state().get("next_index")
        if at != pos.next_index:
            raise TrainerExit(
                ExitCode.INCOMPATIBLE_CHECKPOINT,
                f"checkpoint {restore_step}: data iterator at batch {at}, expected {pos.next_index}",
            )
    else:
        state["data_order_seed"] = jax.device_put(jnp.asarray(pos.order_seed, jnp.int32), tr.replicated)
        state["data_start_step"] = jax.device_put(jnp.asarray(pos.start_step, jnp.int32), tr.replicated)
    ckpt.last_committed = restore_step
    log.info("restored step %d (data order %d, batch %d)", restore_step, pos.order_seed, pos.next_index)
    return state, it


def _train(w: Worker, cfg: JobConfig, faults: Faults) -> NoReturn:
    import jax
    import jax.numpy as jnp

    from trainer import data as data_lib
    from trainer import train_state
    from trainer.checkpointing import Checkpointer

    t = cfg.training
    if t.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", t.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    w.check_topology(cfg)
    restore_step = w.args.restore_step
    log.info(
        "process %d/%d, devices local %d global %d (%s), attempt %d, restore step %s",
        jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count(),
        jax.devices()[0].platform, w.args.attempt, restore_step if restore_step >= 0 else "none (fresh start)",
    )  # fmt: skip
    w.events.emit("initialized", process_count=jax.process_count(), devices=jax.device_count())
    w.metrics = WorkerMetrics(cfg.run_id, w.args.attempt, w.process_index)
    base_port = cfg.monitoring.metrics_port if w.args.metrics_port is None else w.args.metrics_port
    if base_port > 0:
        w.metrics.serve(base_port + (w.process_index if cfg.slice.is_local else 0))
    m = w.metrics
    m.set("jaxrec_expected_workers", cfg.slice.num_hosts)
    m.set("jaxrec_worker_up", 1)

    manifest = w.read_manifest(cfg, restore_step) if restore_step >= 0 else None
    w.set_aside_newer_steps(restore_step)
    mesh = train_state.make_mesh()
    tr = train_state.build(cfg, mesh)
    ckpt = Checkpointer(w.store, cfg, w.args.attempt, dict(mesh.shape))
    w.ckpt = ckpt
    pc, pi = jax.process_count(), jax.process_index()

    if manifest is not None:
        state, it = _restore(cfg, tr, ckpt, restore_step)
    else:
        state = tr.init_fn(jnp.asarray(t.seed, jnp.int32))
        it = data_lib.make_iterator(cfg.data, cfg.model, data_lib.DataPosition(cfg.data.seed, 0, 0), pi, pc)
    w.report.restored_at = time.time()
    w.events.emit("restored", max(restore_step, 0), restore_step=restore_step)
    w.touch()

    step = int(state["step"])
    w.report.last_step = step
    m.set("jaxrec_train_step", step)
    if ckpt.last_committed is not None:
        m.set("jaxrec_checkpoint_step", ckpt.last_committed)
    started = time.time()
    compiled = None
    window: list[float] = []
    preempted = False
    last_saved = restore_step

    def note_commit(committed: int | None) -> None:
        if committed is None:
            return
        w.events.emit("save_committed", committed, save_seconds=ckpt.last_duration,
                      blocking_seconds=ckpt.last_blocking)  # fmt: skip
        m.set("jaxrec_checkpoint_step", committed)
        m.set("jaxrec_checkpoint_last_commit_timestamp_seconds", ckpt.last_commit_time or 0)
        m.set("jaxrec_checkpoint_duration_seconds", ckpt.last_duration or 0)
        w.report.last_checkpoint_step = committed
        w.touch()

    def save(at: int) -> None:
        nonlocal last_saved
        note_commit(ckpt.finish_pending())
        kill = faults.due("kill-during-save", at) and pi == 0
        w.events.emit("save_started", at)
        w.touch()
        if kill and not cfg.checkpoint.async_save:
            os.kill(os.getpid(), signal.SIGKILL)
        ckpt.save(at, state, it)
        last_saved = at
        if kill:  # the asynchronous write is in flight and not committed
            os.kill(os.getpid(), signal.SIGKILL)

    while step < t.total_steps:
        nxt = step + 1
        if faults.due("hang", nxt):
            log.warning("injected hang before step %d", nxt)
            while True:
                time.sleep(3600)
        if faults.due("app-bug", nxt):
            raise RuntimeError(f"injected application bug in step {nxt}")
        batch = train_state.global_batch(tr, next(it), pc)
        flags = train_state.stop_flags(tr, w.stop_requested)
        t0 = time.time()
        if compiled is None:
            compiled = tr.step_fn.lower(state, batch, flags).compile()
        state, loss, stop = compiled(state, batch, flags)
        loss_v, stop_v = float(loss), int(stop)
        step = nxt
        now = time.time()
        if faults.due("nan", step):
            loss_v = float("nan")
        if not math.isfinite(loss_v):
            raise TrainerExit(ExitCode.APPLICATION, f"non-finite loss {loss_v} at step {step}")
        w.report.last_step = step
        w.touch()
        if not w.first_step_done:
            w.first_step_done = True
            compile_s = now - t0
            w.report.first_step_at, w.report.compile_seconds = now, compile_s
            m.set("jaxrec_compile_seconds", compile_s)
            w.events.emit("first_step", step, compile_seconds=compile_s)
            log.info("first step %d done (compile + run %.2f s), loss %.4f", step, compile_s, loss_v)
        else:
            window = (window + [now])[-50:]
        w.events.emit("step", step, loss=loss_v)
        m.set("jaxrec_train_step", step)
        m.set("jaxrec_train_loss", loss_v)
        m.set("jaxrec_last_step_timestamp_seconds", now)
        if len(window) > 1:
            m.set("jaxrec_train_steps_per_second", (len(window) - 1) / max(window[-1] - window[0], 1e-9))
        commit_t = ckpt.last_commit_time or started
        m.set("jaxrec_checkpoint_age_seconds", now - commit_t)
        note_commit(ckpt.poll())
        if stop_v:
            preempted = True
            log.info("stop agreed by every process after step %d", step)
            break
        if step % cfg.checkpoint.interval_steps == 0 and step < t.total_steps:
            save(step)
        if t.step_delay_s:
            time.sleep(t.step_delay_s)

    if last_saved != step:
        save(step)
    note_commit(ckpt.finish_pending())
    elapsed = time.time() - (w.report.first_step_at or started)
    done = step - (w.args.restore_step if w.args.restore_step >= 0 else 0) - 1
    if done > 0 and elapsed > 0:
        w.report.steps_per_second = done / elapsed
    w.report.params_digest = train_state.params_digest(state["params"])
    code = ExitCode.PREEMPTED if preempted else ExitCode.OK
    log.info("step %d reached; params digest %s", step, w.report.params_digest[:16])
    w.write_report(code)
    ckpt.close()
    # Leave together: process 0 hosts the coordination service and must not go first.
    w.exiting = int(code)
    with contextlib.suppress(Exception):
        jax.distributed.shutdown()
    w.exit_now(code)


def parse_args(argv: Sequence[str] | None) -> RunArgs:
    """Parse the worker's command line."""
    from recovery_steps.kernel import cli

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
        help="Prometheus port (local backend: + process index; 0: off). Default: from the config.",
    )
    a = p.parse_args(argv)
    return RunArgs(a.store_root, a.run_id, a.attempt, a.restore_step, a.metrics_port)

"""How a worker joins and ends: the coordinator wait, the exit path (report, ``os._exit`` by contract), the watchdog."""

from __future__ import annotations

import logging
import os
import resource
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.contract import ExitCode
from jaxrec.model.records import EventKind, WorkerExitReport, now
from trainer.decisions import TrainerExit, watchdog_limit
from trainer.telemetry import Events

log = logging.getLogger("trainer")


# libtpu's lock on the TPU chips of a host: one program at a time holds them. A second program fails within
# about 2 s with "Internal error when accessing libtpu multi-process lockfile" (no fallback to the CPU); the holder
# releases them when it ends (measured on a v5e host: 4.6 s after its SIGKILL, bench/bench_tpu_release.py). The
# holder keeps a POSIX record lock (fcntl) on this file; a flock on it stays free (probed there, libtpu 0.0.42.1).
LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"
# How long a worker waits for an earlier program to let the chips go: a killed worker's release takes seconds, and
# the kubelet starts the next pod after the old one ended; a lock held past this is another program or a stuck one.
CHIP_WAIT_S = 60.0


def _lock_held(path: str) -> bool:
    """Whether another process holds a lock on ``path`` (a BSD ``flock`` or a POSIX record lock: either counts)."""
    import errno
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # no lock file: nothing holds the chips
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while another holds it exclusively
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return True
            raise
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def wait_for_chips(timeout_s: float = CHIP_WAIT_S, path: str = LIBTPU_LOCKFILE, poll_s: float = 0.25) -> float:
    """Wait until no other program holds this host's TPU chips (libtpu's lock); return the seconds waited.

    Raises ``TrainerExit(TRANSIENT)`` when they are still held after ``timeout_s``: the attempt is retried without
    charging a class, and the message says what held it.
    """
    if not _lock_held(path):
        return 0.0
    start = time.monotonic()
    while _lock_held(path):
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise TrainerExit(
                ExitCode.TRANSIENT,
                f"the TPU chips of this host are still held by another program after {waited:.0f} s (libtpu's lock "
                f"{path}); an earlier worker that has not ended yet, or another program on the host "
                "(find it with: lsof -w /dev/accel* /dev/vfio/*)",
            )
        time.sleep(poll_s)
    return time.monotonic() - start


def wait_for_listener(address: str, timeout_s: float, poll_s: float = 0.02) -> float | None:
    """Wait until ``address`` (``host:port``) accepts a TCP connection; return the seconds waited, or None.

    A name that does not resolve yet (a pod's DNS record comes with its IP) and a refused connection are
    both "not yet". None: still not listening after ``timeout_s``; the caller joins anyway and JAX reports
    the failure in its own words.
    """
    host, _, port = address.rpartition(":")
    start = time.monotonic()
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=max(poll_s, 0.5)):
                return time.monotonic() - start
        except OSError:
            if time.monotonic() - start >= timeout_s:
                return None
            time.sleep(poll_s)


def native_crash() -> None:
    """Die as a crash in native code does: a read of address 0 (SIGSEGV; rehearsal fault ``native-crash``)."""
    import ctypes

    log.warning("injected native crash: reading address 0")
    ctypes.string_at(0)


def install_abort_handler(on_abort: Callable[[], None]) -> Any:
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


class ExitPath:
    """The one way out of a worker: fill in and write the exit report, emit ``exit``, ``os._exit(code)``.

    A survivor of a lost peer cannot leave by ``sys.exit`` (it waits in JAX's distributed shutdown
    barrier until a timeout, then aborts), so every exit is ``os._exit`` with a contract code.
    """

    def __init__(self, store: RunStore, attempt: int, report: WorkerExitReport, events: Events):
        self.store = store
        self.attempt = attempt
        self.report = report
        self.events = events
        self.exiting: int | None = None
        self.metrics: Any = None  # WorkerMetrics once serving: worker_up goes to 0 on the way out
        self.last_checkpoint: Callable[[], int | None] = lambda: None
        # Tells the rest of the gang a peer is gone (``PeerLossNotice.announce``) once the runtime is up.
        self.on_peer_lost: Callable[[str], None] | None = None
        self._lock = threading.Lock()

    def write_report(self, code: int, exc: BaseException | None = None, message: str | None = None) -> None:
        """Write this worker's exit report to the run store (best effort: a store failure is logged)."""
        r = self.report
        r.exit_code = int(code)
        r.exit_name = ExitCode(code).name if code in ExitCode._value2member_map_ else str(code)
        r.ended_at = now()
        r.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        committed = self.last_checkpoint()
        if committed is not None:
            r.last_checkpoint_step = committed
        if exc is not None:
            r.exception_type = type(exc).__name__
            r.exception_message = str(exc)[:2000]
            r.traceback = "".join(traceback.format_exception(exc))[-4000:]
        elif message:
            r.exception_message = message
        try:
            self.store.write_record(RunLayout.worker_report(self.attempt, r.process_index), r)
        except Exception as e:  # noqa: BLE001 - the exit must happen whatever the store does
            log.error("could not write the exit report: %s", e)

    def exit_now(
        self, code: int, exc: BaseException | None = None, message: str | None = None, *, announce: bool = True
    ) -> NoReturn:
        """Write the report and leave at once with ``code`` (from any thread; the first caller wins).

        A peer-lost exit first tells the other workers (``announce``; skipped when the service itself is gone).
        """
        if not self._lock.acquire(blocking=True, timeout=30):
            os._exit(code)
        self.exiting = code
        text = message or (f"{type(exc).__name__}: {exc}" if exc else "")
        level = logging.INFO if code in (ExitCode.OK, ExitCode.PREEMPTED) else logging.ERROR
        log.log(level, "exiting with %d (%s)%s", code, ExitCode(code).name, f": {text}" if text else "")
        if code == ExitCode.PEER_LOST and announce and self.on_peer_lost is not None:
            self.on_peer_lost(text.splitlines()[0] if text else "peer lost")
        self.write_report(code, exc, message)
        self.events.emit(EventKind.EXIT, self.report.last_step, code=int(code), reason=text[:500])
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
            announce=False,  # every process hears the same from the service
        )


PEER_POLL_AFTER_S = 1.0
"""How long without a completed step before the watchdog reads the gang's peer-lost notice (each 0.5 s)."""


class Watchdog:
    """Exits with the hang code when no progress is recorded within the limit (a daemon thread).

    A rank that is alive but stuck in a collective is not aborted by the coordination service
    (one run with ``jax_enable_recoverability`` hung > 130 s undetected), so progress is watched here.
    """

    def __init__(
        self, hang_timeout_s: float, compile_grace_s: float, exit_path: ExitPath, save_timeout_s: float | None = None
    ):
        self.hang_timeout_s = hang_timeout_s
        self.compile_grace_s = compile_grace_s
        self.save_timeout_s = hang_timeout_s if save_timeout_s is None else save_timeout_s
        self.exit_path = exit_path
        self.first_step_done = False
        self.saving = False  # the loop waits for a checkpoint save: save_timeout_s applies, not hang_timeout_s
        self.last_progress = time.monotonic()
        # Another worker's notice that a peer is gone (``PeerLossNotice.heard``), read only while no step
        # has completed for ``PEER_POLL_AFTER_S``: a worker blocked in a collective leaves within a poll.
        self.peer_lost: Callable[[], str | None] | None = None

    def touch(self) -> None:
        """Record progress."""
        self.last_progress = time.monotonic()

    def start(self) -> None:
        """Start watching (the thread ends with the process)."""
        self.touch()
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def _watch(self) -> None:
        while self.exit_path.exiting is None:
            time.sleep(0.5)
            saving = self.saving
            limit = watchdog_limit(
                self.hang_timeout_s, self.compile_grace_s, self.first_step_done, self.save_timeout_s if saving else None
            )
            idle = time.monotonic() - self.last_progress
            if self.peer_lost is not None and idle >= PEER_POLL_AFTER_S:
                notice = self.peer_lost()
                if notice is not None:
                    self.exit_path.exit_now(
                        ExitCode.PEER_LOST,
                        message=f"no step for {idle:.1f} s and a peer is gone ({notice})",
                        announce=False,
                    )
            if idle > limit:
                what = "no step completed, waiting for a checkpoint save," if saving else "no step completed"
                self.exit_path.exit_now(ExitCode.HANG, message=f"{what} for {idle:.0f} s (limit {limit:.0f} s)")

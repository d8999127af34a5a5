"""A survivor that sees a peer gone tells the rest of the gang through the coordination service.

The service and its clients are the real ones JAX's distributed runtime uses (one service, one client per
process), here in one process.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
from jax._src.lib import _jax

from jaxrec.adapters.store import RunStore
from jaxrec.model.contract import ExitCode
from jaxrec.model.records import WorkerExitReport
from trainer.lifecycle import PEER_POLL_AFTER_S, ExitPath, Watchdog
from trainer.preemption import PeerLossNotice
from trainer.telemetry import Events


@pytest.fixture
def clients():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    addr = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    service = _jax.get_distributed_runtime_service(addr, 2)
    cs = [_jax.get_distributed_runtime_client(addr, i, init_timeout=20) for i in range(2)]
    joins = [threading.Thread(target=c.connect) for c in cs]
    for t in joins:
        t.start()
    for t in joins:
        t.join(60)
    assert not any(t.is_alive() for t in joins), "a client did not connect within 60 s"
    yield cs
    downs = [threading.Thread(target=c.shutdown) for c in cs]  # a shutdown barrier: both at once
    for t in downs:
        t.start()
    for t in downs:
        t.join(60)
    assert not any(t.is_alive() for t in downs), "a client did not shut down within 60 s"
    service.shutdown()


class _Left(BaseException):
    pass


@pytest.fixture
def exit_paths(tmp_path, monkeypatch):
    """Real exit paths of worker 0 (one per call), whose final ``os._exit`` raises here instead."""

    def leave(code):
        raise _Left(code)

    monkeypatch.setattr(os, "_exit", leave)

    def make() -> ExitPath:
        report = WorkerExitReport(
            run_id="r", attempt=3, process_index=0, process_count=2, exit_code=-1, exit_name="RUNNING"
        )
        return ExitPath(RunStore(str(tmp_path), "r"), 3, report, Events(None, 3, 0))

    return make


def test_a_notice_reaches_the_other_process_of_the_same_attempt_only(clients):
    mine, theirs = PeerLossNotice(3, 1, clients[1]), PeerLossNotice(3, 0, clients[0])
    assert theirs.heard() is None
    mine.announce("Gloo all-reduce failed: Connection closed by peer")
    assert theirs.heard() == "process 1: Gloo all-reduce failed: Connection closed by peer"
    assert PeerLossNotice(4, 0, clients[0]).heard() is None  # another attempt's key
    theirs.announce("second")  # a second survivor telling the same: the first notice stays, nothing raises
    assert mine.heard() == "process 1: Gloo all-reduce failed: Connection closed by peer"
    assert PeerLossNotice(3, 0, None).heard() is None  # a gang of one process has no service


def test_a_peer_lost_exit_tells_the_gang_and_a_service_abort_does_not(clients, exit_paths):
    notice, other = PeerLossNotice(3, 0, clients[0]), PeerLossNotice(3, 1, clients[1])
    for code in (ExitCode.HANG, ExitCode.PREEMPTED):
        path = exit_paths()
        path.on_peer_lost = notice.announce
        with pytest.raises(_Left):
            path.exit_now(code, message="no step completed")
    path = exit_paths()
    path.on_peer_lost = notice.announce
    with pytest.raises(_Left):
        path.exit_now(ExitCode.PEER_LOST, message="the JAX runtime aborted", announce=False)
    assert other.heard() is None
    path = exit_paths()
    path.on_peer_lost = notice.announce
    with pytest.raises(_Left) as left:
        path.exit_now(ExitCode.PEER_LOST, message="UNKNOWN: Gloo all-reduce failed: Read error\nstack")
    assert left.value.args == (ExitCode.PEER_LOST,)
    assert other.heard() == "process 0: UNKNOWN: Gloo all-reduce failed: Read error"


def test_a_worker_blocked_in_a_step_leaves_as_peer_lost_once_told_and_not_while_steps_complete(
    clients, exit_paths, monkeypatch
):
    exit_path = exit_paths()
    left: list[tuple[int, str]] = []

    def record(code, exc=None, message=None, *, announce=True):
        left.append((code, message))
        exit_path.exiting = code

    monkeypatch.setattr(exit_path, "exit_now", record)
    PeerLossNotice(3, 1, clients[1]).announce("Connection reset by peer")
    dog = Watchdog(hang_timeout_s=60, compile_grace_s=60, exit_path=exit_path)
    dog.peer_lost = PeerLossNotice(3, 0, clients[0]).heard
    dog.start()
    end = time.monotonic() + PEER_POLL_AFTER_S + 1.0
    while time.monotonic() < end:  # steps complete every 0.1 s: the notice is not even read
        dog.touch()
        time.sleep(0.1)
    assert left == []
    t0 = time.monotonic()  # now the step blocks
    while not left and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    waited = time.monotonic() - t0
    assert left and left[0][0] == ExitCode.PEER_LOST, left
    assert "process 1: Connection reset by peer" in left[0][1]
    assert PEER_POLL_AFTER_S <= waited < PEER_POLL_AFTER_S + 2.0, waited  # far inside the 60 s hang limit

"""Launch N local trainer workers (``python -m trainer``) as a gang and collect their exit codes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import JobConfig, parse_config
from jaxrec.model.records import EventKind, WorkerEvent, parse_event_line

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_compile_cache() -> str | None:
    """The compilation cache every test job of this session shares (``JAXREC_TEST_COMPILE_CACHE``, set by conftest).

    Compiled programs are keyed by their content, devices and options, so jobs of one shape share entries and
    only the first of them compiles cold; a test that measures the cache itself opts out.
    """
    return os.environ.get("JAXREC_TEST_COMPILE_CACHE") or None


def _tiny_data(root: str, run_id: str, hosts: int) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "image": "jax-slice-recovery-worker:test",
        "slice": {"accelerator": "local", "hosts": hosts},
        "storage": {"root": root},
        "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "seq_len": 16},
        "data": {"global_batch_size": 8, "num_records": 256},
        "training": {
            "total_steps": 20,
            "heartbeat_timeout_s": 5,
            "hang_timeout_s": 20,
            "compile_grace_s": 60,
            "init_timeout_s": 60,
            "shutdown_timeout_s": 5,
        },
        "checkpoint": {"interval_steps": 5, "keep": 10, "async_save": True},
    }


def _with_shared_cache(data: dict[str, Any], share: bool) -> dict[str, Any]:
    cache = shared_compile_cache() if share else None
    if cache:
        data["training"]["compilation_cache_dir"] = cache
    return data


def _parse(data: dict[str, Any], sections: dict[str, dict[str, Any]]) -> JobConfig:
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return parse_config(data)


def tiny_config(
    root: str,
    run_id: str = "trainer-test",
    hosts: int = 4,
    *,
    share_compile_cache: bool = True,
    **sections: dict[str, Any],
) -> JobConfig:
    """A tiny local job: 2 layers, d_model 32, short sequences, fast failure detection (the session's cache)."""
    return _parse(_with_shared_cache(_tiny_data(root, run_id, hosts), share_compile_cache), sections)


CLASSIFIER = "examples.image_classifier.task:TASK"


def tiny_classifier_config(
    root: str, run_id: str = "classifier-test", hosts: int = 2, **sections: dict[str, Any]
) -> JobConfig:
    """``tiny_config`` with the example image classifier (8x8 images, 4 channels) as the task instead of the lm."""
    data = _with_shared_cache(_tiny_data(root, run_id, hosts), True)
    del data["model"]  # the lm task's options; the classifier's are task.options
    data["task"] = {"name": CLASSIFIER, "options": {"image_size": 8, "num_classes": 4, "channels": 4}}
    data["data"]["dataset_version"] = "quadrant-images-v1"
    return _parse(data, sections)


def lm_examples(cfg: JobConfig):
    """The built-in lm task's generated sequences for ``cfg`` (what its workers read)."""
    from trainer.data import sequence_dataset

    return sequence_dataset(cfg.data, cfg.model.vocab_size, cfg.model.seq_len)


def write_config(cfg: JobConfig) -> RunStore:
    """Write ``config.json`` the way validate-config does; return the run store."""
    store = RunStore.for_config(cfg)
    store.write_json(RunLayout.CONFIG, {"config": cfg.model_dump(mode="json"), "hash": cfg.config_hash()})
    return store


def loopback(ip: str) -> bool:
    """True for a loopback address, an IPv4 one written as IPv6 (``::ffff:127.0.0.1``) included."""
    import ipaddress

    a = ipaddress.ip_address(ip)
    return (getattr(a, "ipv4_mapped", None) or a).is_loopback


@dataclass
class Gang:
    """The worker processes of one attempt."""

    procs: list[subprocess.Popen]
    events_dir: Path
    logs: list[Path]
    started: float = field(default_factory=time.time)

    def wait(self, timeout: float) -> list[int | None]:
        """Wait up to ``timeout`` s for every worker; return exit codes (None: still running, then killed)."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        codes = [p.poll() for p in self.procs]
        self.kill()
        return codes

    def listening(self) -> set[tuple[str, int]]:
        """The (address, port) every running worker listens on (TCP): the coordinator's, the metrics server's."""
        import psutil

        out = set()
        for p in self.procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                conns = psutil.Process(p.pid).net_connections(kind="inet")
                out |= {(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
        return out

    def kill(self) -> None:
        """SIGKILL every worker still running (and reap it)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)

    def signal(self, index: int, sig: int = signal.SIGKILL) -> float:
        """Send ``sig`` to worker ``index``; return when (epoch s)."""
        t = time.time()
        self.procs[index].send_signal(sig)
        return t

    def preempt(self, indices: list[int], grace_s: float) -> float:
        """SIGTERM workers ``indices`` and SIGKILL those still running ``grace_s`` later, as the kubelet does.

        Returns:
            When the SIGTERMs were sent (epoch s).
        """
        t = time.time()
        for i in indices:
            self.procs[i].send_signal(signal.SIGTERM)

        def kill() -> None:
            for i in indices:
                if self.procs[i].poll() is None:
                    self.procs[i].send_signal(signal.SIGKILL)

        timer = threading.Timer(grace_s, kill)
        timer.daemon = True
        timer.start()
        return t

    def events(self, index: int) -> list[WorkerEvent]:
        """Events worker ``index`` wrote so far (a line cut by a kill is left out)."""
        path = self.events_dir / f"worker-{index}.jsonl"
        if not path.exists():
            return []
        return [e for e in map(parse_event_line, path.read_bytes().splitlines()) if e is not None]

    def last_step(self, index: int) -> int:
        """Last step worker ``index`` reported (-1: none)."""
        steps = [e.step for e in self.events(index) if e.event == EventKind.STEP]
        return steps[-1] if steps else -1

    def wait_for(self, index: int, event: EventKind, step: int | None = None, timeout: float = 120) -> WorkerEvent:
        """Wait until worker ``index`` emitted ``event`` (at ``step`` or later when given)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events(index):
                if e.event == event and (step is None or (e.step is not None and e.step >= step)):
                    return e
            if self.procs[index].poll() is not None:
                raise RuntimeError(
                    f"worker {index} exited {self.procs[index].returncode} before {event}:\n" + self.log(index)[-3000:]
                )
            time.sleep(0.05)
        raise TimeoutError(f"worker {index}: no {event} within {timeout} s:\n" + self.log(index)[-3000:])

    def log(self, index: int) -> str:
        """Combined stdout/stderr of worker ``index``."""
        return self.logs[index].read_text(errors="replace")

    def tails(self, chars: int = 2000) -> str:
        """The end of every worker's log, each under its index: what a gang's failure message shows (one worker's
        hang is often seen only as its peer's peer-lost exit)."""
        return "\n".join(f"--- worker {i} ---\n{self.log(i)[-chars:]}" for i in range(len(self.logs)))


def jax_platform(timeout_s: float = 300) -> tuple[int, str]:
    """Exit code and platform of JAX's first device, asked in a child process (which lets a chip go when it ends)."""
    code = "import jax; print(jax.devices()[0].platform)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    return out.returncode, (out.stdout.strip().splitlines()[-1:] or [""])[0]


def gang_env(port: int, index: int, n: int, events_dir: Path) -> dict[str, str]:
    """The environment of worker ``index`` of ``n`` on localhost, as the local runner sets it."""
    return {
        **os.environ,
        "TRAINER_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JOB_COMPLETION_INDEX": str(index),
        "TRAINER_NUM_PROCESSES": str(n),
        "TRAINER_EVENTS_DIR": str(events_dir),
        "JAX_PLATFORMS": "cpu",
        # The repository first, then whatever the machine's Python needs (where its JAX may live).
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    }


def launch(
    cfg: JobConfig,
    attempt: int,
    restore_step: int,
    workdir: Path,
    *,
    fault: str | None = None,
    extra_env: dict[str, str] | None = None,
    metrics_port: int = 0,
) -> Gang:
    """Start ``cfg.slice.hosts`` workers of ``attempt`` the way the local runner does."""
    n = cfg.slice.num_hosts
    port = free_port() if n > 1 else 0  # a gang of one joins no coordinator (and may run where no port binds)
    events_dir = workdir / f"events-{attempt}"
    events_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for i in range(n):
        env = {**gang_env(port, i, n, events_dir), **(extra_env or {})}
        if cfg.slice.local_devices == "accelerator":
            env.pop("JAX_PLATFORMS", None)  # the machine's own chips
        env.pop("TRAINER_FAULT", None)
        if fault:
            env["TRAINER_FAULT"] = fault
        log = workdir / f"worker-{attempt}-{i}.log"
        logs.append(log)
        cmd = [
            sys.executable,
            "-m",
            "trainer",
            "--store-root",
            cfg.storage.root,
            "--run-id",
            cfg.run_id,
            "--attempt",
            str(attempt),
            "--restore-step",
            str(restore_step),
            "--metrics-port",
            str(metrics_port),
        ]
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO))
    return Gang(procs, events_dir, logs)


def read_report(store: RunStore, attempt: int, index: int) -> dict[str, Any] | None:
    """The exit report of worker ``index`` of ``attempt`` (None when absent)."""
    return store.read_json(RunLayout.worker_report(attempt, index))

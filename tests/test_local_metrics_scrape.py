"""Scrape a local run over HTTP while it runs: worker endpoints (checkpoint age) and the run endpoint."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.local_job import HOSTS, shrunken_workflow

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
RUN_LINE = re.compile(r"run metrics: http://127\.0\.0\.1:(\d+)/metrics")
WORKER_LINE = re.compile(r"worker metrics \(attempt (\d+)\): http://127\.0\.0\.1:(\d+)/metrics")


def _workflow(d: Path) -> Path:
    """The shrunken job with 0.3 s after each step, so that scrapes land between checkpoints."""
    return shrunken_workflow(d, "scrape", store_root=str(d / "store"), step_delay_s=0.3)


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
            text = r.read().decode()
    except OSError:
        return None
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples, name, **labels):
    for (n, lab), v in samples.items():
        if n == name and all(dict(lab).get(k) == val for k, val in labels.items()):
            return v
    return None


class _Watcher:
    """Reads the runner's output and scrapes every endpoint it announces until the runner exits."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[str] = []
        self.run_port: int | None = None
        self.worker_ports: dict[int, int] = {}  # attempt -> base port
        self.run_samples: list[dict] = []
        self.worker_samples: list[tuple[float, int, int, dict]] = []  # (t, attempt, index, samples)

    def read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if m := RUN_LINE.search(line):
                self.run_port = int(m.group(1))
            if m := WORKER_LINE.search(line):
                self.worker_ports[int(m.group(1))] = int(m.group(2))

    def scrape(self) -> None:
        while self.proc.poll() is None:
            if self.run_port is not None and (s := _scrape(self.run_port)):
                self.run_samples.append(s)
            if self.worker_ports:
                attempt = max(self.worker_ports)
                for i in range(HOSTS):
                    s = _scrape(self.worker_ports[attempt] + i)
                    if s:
                        self.worker_samples.append((time.time(), attempt, i, s))
            time.sleep(0.2)


def test_scrape_worker_and_run_metrics_during_a_run_with_a_killed_worker(tmp_path):
    wf = _workflow(tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workflows.local",
            str(wf),
            "--inject",
            "kill-worker@12",
            "--run-id",
            "scrape",
            "--store-root",
            str(tmp_path / "store"),
            "--metrics-port",
            "0",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    w = _Watcher(proc)
    threads = [threading.Thread(target=w.read, daemon=True), threading.Thread(target=w.scrape, daemon=True)]
    for t in threads:
        t.start()
    try:
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    for t in threads:
        t.join(timeout=10)
    out = "\n".join(w.lines)
    assert proc.returncode == 0, out
    assert set(w.worker_ports) == {0, 1}, out

    # Every worker of each attempt served its own endpoint, labelled with its process index.
    for attempt in (0, 1):
        seen = {i for _, a, i, s in w.worker_samples if a == attempt and _value(s, "jaxrec_train_step") is not None}
        assert seen == set(range(HOSTS)), (attempt, seen)
    for _, a, i, s in w.worker_samples:
        if _value(s, "jaxrec_train_step") is not None:
            assert _value(s, "jaxrec_train_step", attempt=str(a), process_index=str(i)) is not None

    # Checkpoint age rises while the checkpoint step stays, and falls as soon as the trainer sees a commit
    # (not at the next step: a worker killed right after a commit shows the drop too).
    rises = commits = 0
    for attempt in (0, 1):
        series = [
            (_value(s, "jaxrec_checkpoint_step"), _value(s, "jaxrec_checkpoint_age_seconds"))
            for _, a, i, s in w.worker_samples
            if a == attempt and i == 0
        ]
        series = [x for x in series if x[0] is not None and x[1] is not None]
        for (step0, age0), (step1, age1) in zip(series, series[1:], strict=False):
            assert step1 >= step0, series
            rises += step1 == step0 and age1 > age0
        steps = sorted({c for c, _ in series})
        # A later attempt starts at 0 and jumps to the restored step, whose age runs from its commit in
        # the earlier attempt: that jump is a restore, not a commit.
        first_commit = 1 if attempt == 0 else 2
        for prev, cur in zip(steps[first_commit - 1 :], steps[first_commit:], strict=False):
            before = [age for c, age in series if c == prev][-1]
            assert min(age for c, age in series if c == cur) < before, (attempt, prev, cur, series)
            commits += 1
    assert rises >= 4 and commits >= 2, (rises, commits)

    # The run endpoint: one attempt and no failure before the kill; two attempts and its class after.
    attempts = [_value(s, "jaxrec_attempts_total") for s in w.run_samples]
    assert attempts and attempts[0] == 1.0, attempts
    assert 2.0 in attempts, attempts
    first_two = attempts.index(2.0)
    assert all(_value(s, "jaxrec_last_failure_info") is None for s in w.run_samples[:1])
    after = w.run_samples[first_two]
    assert _value(after, "jaxrec_last_failure_info", **{"class": "infrastructure"}) == 1.0
    assert _value(after, "jaxrec_failures_total", **{"class": "infrastructure"}) == 1.0

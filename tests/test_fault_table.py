"""Fault tables: damaged checkpoints and stores, bad step-CLI inputs and bad configs, each with its verdict.

Every case runs a step's ``main(argv)`` in-process (a traceback is an exception escaping it; argparse's
``SystemExit`` is an exit code) against real orbax checkpoints copied from one template run store.
Each table prints ``tried / refused clearly / tracebacks / wrong`` and fails on any traceback or any
wrong verdict (a wrong restore, a refusal without its message, a write outside the run).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from support.ckpt_factory import tiny_config, write_checkpoint, write_run_config

from jaxrec.adapters.checkpoints import crc32c_hex
from jaxrec.adapters.store import RunStore
from jaxrec.adapters.verify import LOCAL_METADATA
from recovery_steps import (
    classify_failure,
    finalize,
    give_up,
    hand_over,
    provision_slice,
    restore_latest,
    validate_config,
)
from workflows.local import runner as local_runner

ROOT = Path(__file__).resolve().parents[1]
LOCAL_WF = str(ROOT / "argo/local-cpu.yaml")
STEPS = (40, 50, 60)
RUN = tiny_config().run_id


@dataclass
class Outcome:
    code: int | None
    out: str
    err: str
    traceback: str | None = None


def call(main: Callable[[list[str]], int], argv: list[str]) -> Outcome:
    """Run ``main(argv)`` in-process; an exception other than ``SystemExit`` is a traceback."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
        except BaseException:  # noqa: BLE001 - this is what the table counts
            return Outcome(None, out.getvalue(), err.getvalue(), traceback.format_exc())
    return Outcome(code, out.getvalue(), err.getvalue())


def tree_digest(d: Path) -> dict[str, str]:
    """Relative path -> CRC32C of every regular file under ``d`` (links not followed)."""
    out = {}
    for dirpath, _dirs, files in os.walk(d):
        for name in files:
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                continue
            out[str(p.relative_to(d))] = crc32c_hex(p.read_bytes())
    return out


def all_paths(root: Path) -> set[str]:
    return {str(Path(dp, n).relative_to(root)) for dp, ds, fs in os.walk(root) for n in [*ds, *fs]}


class Tally:
    def __init__(self, name: str):
        self.name, self.tried, self.refused, self.accepted, self.tracebacks, self.wrong = name, 0, 0, 0, 0, 0
        self.failures: list[str] = []

    def add(self, case: str, *, traceback_text: str | None, problem: str | None, refused: bool) -> None:
        self.tried += 1
        if traceback_text is not None:
            self.tracebacks += 1
            self.failures.append(f"{case}: TRACEBACK\n{traceback_text}")
        elif problem is not None:
            self.wrong += 1
            self.failures.append(f"{case}: {problem}")
        elif refused:
            self.refused += 1
        else:
            self.accepted += 1

    def finish(self, minimum: int) -> None:
        print(
            f"\n{self.name}: tried {self.tried} / refused clearly {self.refused} / restored or accepted "
            f"{self.accepted} / tracebacks {self.tracebacks} / wrong {self.wrong}"
        )
        assert self.tried >= minimum, f"{self.name}: only {self.tried} cases"
        assert not self.failures, "\n".join(self.failures)


# ---- checkpoint and store damage --------------------------------------------------------------------


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A run store with config and three real orbax checkpoints (40, 50, 60); cases copy it."""
    root = tmp_path_factory.mktemp("template")
    cfg = tiny_config()
    store = RunStore(str(root), cfg.run_id)
    write_run_config(store, cfg)
    states = {s: write_checkpoint(store, cfg, s, floats=200) for s in STEPS}
    run_dir = root / "runs" / cfg.run_id
    digests = {s: tree_digest(run_dir / "checkpoints" / str(s)) for s in STEPS}
    return root, cfg, states, digests


def _largest(step_dir: Path) -> Path:
    files = [p for p in step_dir.rglob("*") if p.is_file() and "/d/" in str(p)]
    return max(files, key=lambda p: p.stat().st_size)


def _manifest(step_dir: Path) -> dict:
    return json.loads((step_dir / "manifest.json").read_text())


def _set_manifest(step_dir: Path, m: dict) -> None:
    (step_dir / "manifest.json").write_text(json.dumps(m))


def flip(step_dir: Path) -> None:
    p = _largest(step_dir)
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def omit_from_manifest(step_dir: Path, *, damage: bool) -> None:
    victim = _largest(step_dir)
    rel = str(victim.relative_to(step_dir))
    m = _manifest(step_dir)
    m["files"] = [f for f in m["files"] if f["path"] != rel]
    _set_manifest(step_dir, m)
    if damage:
        flip(step_dir)


def edit_manifest(**changes):
    def apply(ck: Path, run: Path) -> None:
        m = _manifest(ck / "60")
        m.update(changes)
        _set_manifest(ck / "60", m)

    return apply


def manifest_files(fn):
    def apply(ck: Path, run: Path) -> None:
        m = _manifest(ck / "60")
        m["files"] = fn(m["files"])
        _set_manifest(ck / "60", m)

    return apply


def fifo_in(ck: Path, run: Path) -> None:
    os.mkfifo(ck / "60" / "state" / "pipe")


# (name, damage(checkpoints dir, run dir), expected: int step restored | (exit code, regex), damaged steps)
D = Callable[[Path, Path], None]
DAMAGE: list[tuple[str, D, int | tuple[int, str], set[int]]] = [
    ("intact", lambda ck, run: None, 60, set()),
    ("flipped byte in an array chunk", lambda ck, run: flip(ck / "60"), 50, {60}),
    ("truncated chunk", lambda ck, run: (p := _largest(ck / "60")).write_bytes(p.read_bytes()[:-7]), 50, {60}),
    ("zero-byte chunk", lambda ck, run: _largest(ck / "60").write_bytes(b""), 50, {60}),
    ("chunk deleted", lambda ck, run: _largest(ck / "60").unlink(), 50, {60}),
    (
        "chunk omitted from the manifest and damaged",
        lambda ck, run: omit_from_manifest(ck / "60", damage=True),
        50,
        {60},
    ),
    ("chunk omitted from the manifest, intact", lambda ck, run: omit_from_manifest(ck / "60", damage=False), 50, {60}),
    ("extra unlisted file", lambda ck, run: (ck / "60" / "state" / "extra.bin").write_bytes(b"x" * 10), 50, {60}),
    (
        "extra unlisted copy of a chunk",
        lambda ck, run: shutil.copy(_largest(ck / "60"), ck / "60" / "state" / "c2"),
        50,
        {60},
    ),
    ("manifest missing", lambda ck, run: (ck / "60" / "manifest.json").unlink(), 50, {60}),
    ("manifest garbled", lambda ck, run: (ck / "60" / "manifest.json").write_text('{"step": 60,'), 50, {60}),
    ("manifest empty", lambda ck, run: (ck / "60" / "manifest.json").write_bytes(b""), 50, {60}),
    ("manifest not UTF-8", lambda ck, run: (ck / "60" / "manifest.json").write_bytes(b"\xff\xfe\x00"), 50, {60}),
    (
        "manifest is a directory",
        lambda ck, run: ((ck / "60" / "manifest.json").unlink(), (ck / "60" / "manifest.json").mkdir()),
        50,
        {60},
    ),
    (
        "manifest is a symlink to another step's",
        lambda ck, run: (
            (ck / "60" / "manifest.json").unlink(),
            (ck / "60" / "manifest.json").symlink_to(ck / "50" / "manifest.json"),
        ),
        50,
        {60},
    ),
    ("manifest lists no files", manifest_files(lambda fs: []), 50, {60}),
    ("manifest for another step", edit_manifest(step=61), 50, {60}),
    ("manifest for another run", edit_manifest(run_id="other-run"), 50, {60}),
    ("manifest of another process count", edit_manifest(process_count=2), 50, {60}),
    ("manifest of another dataset version", edit_manifest(dataset_version="v2"), 50, {60}),
    ("manifest lists a file twice", manifest_files(lambda fs: [*fs, fs[0]]), 50, {60}),
    (
        "manifest lists a path outside the step",
        manifest_files(lambda fs: [*fs, {"path": "../50/manifest.json", "size": 1, "crc32c": "00000000"}]),
        50,
        {60},
    ),
    (
        "manifest has a wrong checksum, data intact",
        manifest_files(lambda fs: [{**fs[0], "crc32c": "deadbeef"}, *fs[1:]]),
        50,
        {60},
    ),
    ("manifest has a wrong size", manifest_files(lambda fs: [{**fs[0], "size": fs[0]["size"] + 1}, *fs[1:]]), 50, {60}),
    ("orbax metadata missing", lambda ck, run: (ck / "60" / LOCAL_METADATA).unlink(), 50, {60}),
    (
        "orbax metadata is a directory",
        lambda ck, run: ((ck / "60" / LOCAL_METADATA).unlink(), (ck / "60" / LOCAL_METADATA).mkdir()),
        50,
        {60},
    ),
    (
        "step named 060",
        lambda ck, run: (ck / "60").rename(ck / "060"),
        (2, r"060 holds an intact checkpoint of step 60 .*rename it to .*/checkpoints/60"),
        {60},
    ),
    (
        "intact step renamed 60.bak",
        lambda ck, run: (ck / "60").rename(ck / "60.bak"),
        (2, r"60.bak holds an intact checkpoint of step 60 .*rename it"),
        {60},
    ),
    (
        "intact step left under a temporary name",
        lambda ck, run: (ck / "60").rename(ck / "60.orbax-checkpoint-tmp-9"),
        (2, r"tmp-9 holds an intact .*step 60"),
        {60},
    ),
    ("damaged step renamed 060", lambda ck, run: (flip(ck / "60"), (ck / "60").rename(ck / "060")), 50, {60}),
    ("060 beside an intact 60", lambda ck, run: shutil.copytree(ck / "60", ck / "060"), 60, set()),
    ("newer step is a file", lambda ck, run: (ck / "70").write_text("not a checkpoint"), 60, set()),
    ("newer step is a symlink to step 60", lambda ck, run: (ck / "70").symlink_to(ck / "60"), 60, set()),
    ("newer step is a dangling symlink", lambda ck, run: (ck / "70").symlink_to(ck / "nowhere"), 60, set()),
    ("newer step is a symlink loop", lambda ck, run: (ck / "70").symlink_to(ck / "70"), 60, set()),
    ("symlink loop inside a step", lambda ck, run: (ck / "60" / "loop").symlink_to(ck / "60" / "loop"), 50, {60}),
    ("dangling symlink inside a step", lambda ck, run: (ck / "60" / "gone").symlink_to(ck / "absent"), 50, {60}),
    (
        "item directory replaced by a symlink to step 50's",
        lambda ck, run: (shutil.rmtree(ck / "60" / "data"), (ck / "60" / "data").symlink_to(ck / "50" / "data")),
        50,
        {60},
    ),
    ("named pipe inside a step", fifo_in, 50, {60}),
    ("empty newer step directory", lambda ck, run: (ck / "70").mkdir(), 60, set()),
    ("empty subdirectory inside a step", lambda ck, run: (ck / "60" / "state" / "empty").mkdir(), 60, set()),
    (
        "unfinished orbax temporary directory",
        lambda ck, run: shutil.copytree(ck / "60", ck / "70.orbax-checkpoint-tmp-3"),
        60,
        set(),
    ),
    ("stray notes under checkpoints", lambda ck, run: (ck / "notes.txt").write_text("hi"), 60, set()),
    ("stray directory not named by a step", lambda ck, run: (ck / "backup").mkdir(), 60, set()),
    ("step name of 25 digits", lambda ck, run: shutil.copytree(ck / "60", ck / ("9" * 25)), 60, set()),
    ("step name of non-ASCII digits", lambda ck, run: shutil.copytree(ck / "60", ck / "\u0667\u0660"), 60, set()),
    ("two newest steps damaged", lambda ck, run: (flip(ck / "60"), flip(ck / "50")), 40, {50, 60}),
    ("every step damaged", lambda ck, run: [flip(ck / str(s)) for s in STEPS], -1, set(STEPS)),
    ("no checkpoints directory", lambda ck, run: shutil.rmtree(ck), -1, set(STEPS)),
    ("empty checkpoints directory", lambda ck, run: (shutil.rmtree(ck), ck.mkdir()), -1, set(STEPS)),
    (
        "checkpoints is a file",
        lambda ck, run: (shutil.rmtree(ck), ck.write_text("x")),
        (2, r"checkpoints is a file, not a directory"),
        set(STEPS),
    ),
    (
        "checkpoints is a symlink",
        lambda ck, run: (ck.rename(run / "elsewhere"), ck.symlink_to(run / "elsewhere")),
        (2, r"checkpoints is a symbolic link"),
        set(STEPS),
    ),
    (
        "quarantine is a file and a step is damaged",
        lambda ck, run: ((run / "quarantine").write_text("x"), flip(ck / "60")),
        (2, r"quarantine is a file, not a directory.*nothing was moved"),
        {60},
    ),
    ("quarantine is a file, nothing damaged", lambda ck, run: (run / "quarantine").write_text("x"), 60, set()),
    (
        "quarantine already holds step 60",
        lambda ck, run: ((run / "quarantine" / "60").mkdir(parents=True), flip(ck / "60")),
        50,
        {60},
    ),
    ("config.json missing", lambda ck, run: (run / "config.json").unlink(), (2, r"no config for run"), set()),
    ("config.json garbled", lambda ck, run: (run / "config.json").write_text("{"), (2, r"config.json"), set()),
    (
        "config.json is a directory",
        lambda ck, run: ((run / "config.json").unlink(), (run / "config.json").mkdir()),
        (2, r"no config"),
        set(),
    ),
    ("ledger garbled", lambda ck, run: (run / "ledger.json").write_text("[1,"), (2, r"ledger"), set()),
    (
        "newest step incompatible, older good",
        edit_manifest(
            config={
                **tiny_config().model_dump(mode="json"),
                "model": {**tiny_config().model_dump(mode="json")["model"], "d_model": 128},
            }
        ),
        50,
        {60},
    ),
]


def _damage_case(template, tmp_path: Path, name: str, damage: D, expected, damaged: set[int]) -> tuple:
    src_root, cfg, _states, digests = template
    root = tmp_path / re.sub(r"\W+", "-", name)
    shutil.copytree(src_root, root, symlinks=True)
    run = root / "runs" / cfg.run_id
    ck = run / "checkpoints"
    damage(ck, run)
    out = root / "out"
    argv = ["--store-root", str(root), "--run-id", cfg.run_id, "--attempt", "1", "--output-dir", str(out)]
    got = call(restore_latest.main, argv)
    if got.traceback:
        return got.traceback, None, False
    problem = None
    refused = not isinstance(expected, int)
    if isinstance(expected, int):
        step = (out / "restore-step").read_text() if (out / "restore-step").exists() else None
        if got.code != 0 or step != str(expected):
            problem = f"expected step {expected}, got exit {got.code} step {step}: {got.err[-300:]}"
        elif expected >= 0 and (out / "restore-path").read_text() != str(ck / str(expected)):
            problem = f"restore-path {(out / 'restore-path').read_text()} is not the verified directory"
        elif expected >= 0 and tree_digest(ck / str(expected)) != digests[expected]:
            problem = "the restored checkpoint is not byte-identical to the one written"
    else:
        code, pattern = expected
        if got.code != code or not re.search(pattern, got.err):
            problem = f"expected exit {code} matching {pattern!r}, got exit {got.code}: {got.err[-300:]}"
        elif len(got.err.strip().splitlines()) > 3:
            problem = f"refusal is not short: {got.err[:300]}"
    # A good checkpoint is never lost or moved.
    for s in set(STEPS) - damaged:
        if (ck / str(s)).is_dir() and not (ck / str(s)).is_symlink():
            if tree_digest(ck / str(s)) != digests[s]:
                problem = problem or f"good step {s} changed"
        elif ck.is_dir() and not ck.is_symlink():
            problem = problem or f"good step {s} was moved"
    # Every quarantine entry has its reason (no phantom entries).
    q = run / "quarantine"
    if q.is_dir():
        for entry in q.iterdir():
            if entry.is_dir() and entry.name != "60" and not (entry / "QUARANTINE_REASON.json").exists():
                problem = problem or f"quarantine entry {entry.name} has no reason file"
    return None, problem, refused


def test_checkpoint_and_store_damage_table(template, tmp_path):
    tally = Tally("checkpoint and store damage")
    for name, damage, expected, damaged in DAMAGE:
        tb, problem, refused = _damage_case(template, tmp_path, name, damage, expected, damaged)
        tally.add(name, traceback_text=tb, problem=problem, refused=refused)
    tally.finish(minimum=40)


def test_omitted_damaged_chunk_restores_the_previous_parameters(template, tmp_path):
    import numpy as np
    import orbax.checkpoint as ocp

    src_root, cfg, states, _ = template
    root = tmp_path / "s"
    shutil.copytree(src_root, root, symlinks=True)
    omit_from_manifest(root / "runs" / cfg.run_id / "checkpoints" / "60", damage=True)
    r = restore_latest.run(RunStore(str(root), cfg.run_id), 1)
    assert r.selection.step == 50
    assert "not in the manifest" in r.selection.skipped[0].reason
    with ocp.CheckpointManager(r.restore_path.rsplit("/", 1)[0]) as mgr:
        got = mgr.restore(50, args=ocp.args.Composite(state=ocp.args.StandardRestore(states[50])))
    np.testing.assert_array_equal(got["state"]["params"]["w"], states[50]["params"]["w"])


def _racing_store(template, tmp_path: Path) -> tuple[Path, Path]:
    src_root, cfg, _, _ = template
    root = tmp_path / "race"
    shutil.copytree(src_root, root, symlinks=True)
    run = root / "runs" / cfg.run_id
    flip(run / "checkpoints" / "60")
    return root, run


def _check_race(run: Path, steps: list[str], digests) -> None:
    assert steps and set(steps) == {"50"}, steps
    q = sorted(p.name for p in (run / "quarantine").iterdir())
    assert q == ["60"], q  # exactly one entry: no phantom, nothing lost
    assert json.loads((run / "quarantine" / "60" / "QUARANTINE_REASON.json").read_text())["step"] == 60
    for s in (40, 50):
        assert tree_digest(run / "checkpoints" / str(s)) == digests[s]


def _race_restore_latest(root: Path, threads: int = 6) -> list[str]:
    """restore-latest of attempt 1 from ``threads`` threads released at once; the steps they chose (each thread's
    exception, if any, fails the test: a traceback is what the race looks for)."""
    barrier, steps, errors = threading.Barrier(threads), [], []

    def one() -> None:
        barrier.wait(timeout=60)
        try:
            steps.append(str(restore_latest.run(RunStore(str(root), RUN), 1).selection.step))
        except BaseException as e:  # noqa: BLE001 - a traceback is the failure this test looks for
            errors.append(repr(e))

    started = [threading.Thread(target=one) for _ in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join(120)
    assert not any(t.is_alive() for t in started), "a racer did not finish within 120 s"
    assert errors == []
    return steps


def test_concurrent_restore_latest_threads_agree_and_quarantine_once(template, tmp_path):
    root, run = _racing_store(template, tmp_path)
    _check_race(run, _race_restore_latest(root), template[3])


def test_a_mover_that_loses_the_quarantine_name_leaves_the_step_to_the_mover_that_took_it(template, tmp_path):
    """The race's worst interleaving, held open: another restore-latest has created ``quarantine/60`` (exclusively)
    and not yet renamed the step into it. This one finds the name taken: it waits for that mover to take the step
    rather than racing it for the step under ``60.attempt1.1`` (which left the step under a suffixed name and its
    own name empty)."""
    root, run = _racing_store(template, tmp_path)
    (run / "quarantine").mkdir(exist_ok=True)
    os.mkdir(run / "quarantine" / "60")  # the other mover's exclusive name
    other = threading.Timer(0.5, os.rename, (run / "checkpoints" / "60", run / "quarantine" / "60"))
    other.start()
    r = restore_latest.run(RunStore(str(root), RUN), 1)
    other.join(10)
    assert r.selection.step == 50 and r.quarantined == [], r
    assert sorted(p.name for p in (run / "quarantine").iterdir()) == ["60"]
    assert (run / "quarantine" / "60" / "commit_success.txt").exists()  # the step, moved whole by the other


@pytest.mark.slow
def test_concurrent_restore_latest_processes_agree_and_quarantine_once(template, tmp_path):
    root, run = _racing_store(template, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "recovery_steps.restore_latest",
                "--store-root",
                str(root),
                "--run-id",
                RUN,
                "--attempt",
                "1",
                "--output-dir",
                str(tmp_path / f"o{i}"),
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(3)
    ]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    assert not any("Traceback" in e for e in errs), errs
    _check_race(run, [(tmp_path / f"o{i}" / "restore-step").read_text() for i in range(3)], template[3])


def test_restore_latest_twice_is_idempotent(template, tmp_path):
    root, run = _racing_store(template, tmp_path)
    for _ in range(2):
        assert restore_latest.run(RunStore(str(root), RUN), 1).selection.step == 50
    _check_race(run, ["50"], template[3])


# ---- the run's own documents ------------------------------------------------------------------------


def _ledger(run: Path, attempts: list[int] | None) -> None:
    doc: dict = {"run_id": RUN}
    if attempts is not None:
        doc["attempts"] = [{"attempt": a, "outcome": "failed", "closed_at": 1.0} for a in attempts]
    (run / "ledger.json").write_text(json.dumps(doc))


# (name, ledger attempts (None: no list), what the refusal says)
LEDGERS: list[tuple[str, list[int] | None, str]] = [
    ("ledger lists an attempt twice", [0, 1, 1], r"attempt 1 is recorded twice"),
    ("ledger lists an attempt twice, apart", [1, 2, 1], r"attempt 1 is recorded twice"),
    ("ledger lists attempts out of order", [2, 1], r"attempt 1 is recorded after attempt 2"),
    ("ledger has no attempts list", None, r"no 'attempts' list"),
]


def _ledger_steps(root: Path, out: Path) -> list[tuple[str, Callable, list[str]]]:
    base = ["--store-root", str(root), "--run-id", RUN]
    return [
        (
            "validate-config",
            validate_config.main,
            ["--config", str(ROOT / "configs/local-cpu.yaml"), "--store-root", str(root), "--output-dir", str(out)],
        ),
        ("restore-latest", restore_latest.main, [*base, "--attempt", "3", "--output-dir", str(out)]),
        ("provision-slice", provision_slice.main, [*base, "--attempt", "3", "--output-dir", str(out)]),
        (
            "classify-failure",
            classify_failure.main,
            [*base, "--attempt", "3", "--jobset", "js", "--output-dir", str(out)],
        ),
        ("hand-over", hand_over.main, [*base, "--attempt", "3", "--workflow", "wf", "--workflow-uid", "uid-1"]),
        ("finalize", finalize.main, [*base, "--status", "Succeeded", "--output-dir", str(out)]),
    ]


def test_damaged_ledger_table(template, tmp_path):
    """Every step that reads the ledger refuses one that is not one record per attempt, in order, and writes nothing."""
    tally = Tally("damaged ledgers")
    for lname, attempts, says in LEDGERS:
        for step, main, argv in _ledger_steps(tmp_path / "r", tmp_path / "out"):
            root = tmp_path / "r"
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(template[0], root, symlinks=True)
            run = root / "runs" / RUN
            _ledger(run, attempts)
            before = tree_digest(run)
            got = call(main, argv)
            problem = None
            if got.traceback is None:
                lines = [ln for ln in got.err.splitlines() if ln.strip()]
                pattern = rf"ledger\.json: unreadable ledger \(.*{says}"
                if got.code not in (1, 2) or not re.search(pattern, got.err):
                    problem = f"expected a refusal matching {pattern!r}, got {got.code}: {got.err[-400:]!r}"
                elif len(lines) != 1:
                    problem = f"not one line: {got.err[:600]!r}"
                else:
                    # provision-slice records its refusal where classify-failure looks for it; nothing else.
                    mine = "attempts/3/" if step == "provision-slice" else "\0"
                    after = {k: v for k, v in tree_digest(run).items() if not k.startswith(mine) or k in before}
                    if after != before:
                        problem = f"the run changed: {sorted(set(after) ^ set(before)) or 'a document rewritten'}"
            tally.add(f"{step}: {lname}", traceback_text=got.traceback, problem=problem, refused=True)
    tally.finish(minimum=24)


# ---- bad step-CLI inputs ----------------------------------------------------------------------------


@pytest.fixture
def cli_env(tmp_path, monkeypatch):
    """A sandbox: a valid run store, a file, a symlink loop, and no Google credentials."""
    box = tmp_path / "box"
    store = box / "store"
    cfg = tiny_config()
    write_run_config(RunStore(str(store), cfg.run_id), cfg)
    (box / "afile").write_text("x")
    (box / "loop").symlink_to(box / "loop")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(box / "no-credentials.json"))
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.chdir(box)
    return box


LONG = "x" * 5000
BAD_RUN_IDS = ["../../escape", "..", "UPPER", "", LONG, "a/b", "-lead", "trail-", "sp ace", "\u00fcml", "a" * 41]
BAD_ATTEMPTS = ["-1", "1" * 30, "abc", "1.5", "", "0x10", " ", "\u0663", "100001", "1e3", "100000"]


def UNWRITABLE_OUT(box: Path) -> list[tuple[str, str]]:  # noqa: N802 - a table, read like a constant
    """Output directories that pass access() but take no file: proven by creating them before the step acts."""
    return [
        (str(box / ("n" * 300)), r"cannot be written: File name too long"),  # a name component over NAME_MAX
        ("/sys/kernel/jaxrec-out", r"cannot be written"),  # a pseudo file system: no directory can be made
        ("/sys/kernel", r"cannot be written \(.*/sys/kernel/"),  # a directory that exists, where no file can be made
    ]


def _cli_cases(box: Path) -> list[tuple[str, Callable, list[str], int, str]]:
    s, out = str(box / "store"), str(box / "out")
    base = ["--store-root", s, "--run-id", RUN]
    cases: list[tuple[str, Callable, list[str], int, str]] = []
    steps = {
        "restore-latest": (restore_latest.main, ["--attempt", "1", "--output-dir", out]),
        "provision-slice": (provision_slice.main, ["--attempt", "1", "--output-dir", out]),
        "classify-failure": (classify_failure.main, ["--attempt", "1", "--jobset", "js", "--output-dir", out]),
        "finalize": (finalize.main, ["--status", "Failed", "--output-dir", out]),
    }
    for step, (main, rest) in steps.items():
        for rid in BAD_RUN_IDS:
            cases.append(
                (
                    f"{step} --run-id {rid[:20]!r}",
                    main,
                    ["--store-root", s, f"--run-id={rid}", *rest],
                    2,
                    r"--run-id: .*not a valid run id",
                )
            )
        bad_roots = [
            (str(box / "afile"), "not a directory"),
            (LONG, "longer than"),
            ("gs://B", "not a GCS"),
            ("s3://b/p", "only gs://"),
            ("", "empty"),
            (str(box / "afile" / "sub"), "not a directory"),
            (str(box / "loop"), "not a directory|cannot be used"),
            ("gs://", "not a GCS"),
        ]
        for bad_root, why in bad_roots:
            cases.append(
                (
                    f"{step} --store-root {bad_root[:30]!r}",
                    main,
                    ["--store-root", bad_root, "--run-id", RUN, *rest],
                    2,
                    f"--store-root: .*({why})",
                )
            )
        cases.append((f"{step} missing --run-id", main, ["--store-root", s, *rest], 2, r"required: --run-id"))
        cases.append((f"{step} unknown flag", main, [*base, *rest, "--bogus"], 2, r"unrecognized arguments"))
    for step, main in [
        ("restore-latest", restore_latest.main),
        ("provision-slice", provision_slice.main),
        ("classify-failure", classify_failure.main),
    ]:
        extra = ["--jobset", "js"] if step == "classify-failure" else []
        for a in BAD_ATTEMPTS:
            cases.append(
                (
                    f"{step} --attempt {a[:12]!r}",
                    main,
                    [*base, "--attempt", a, *extra, "--output-dir", out],
                    2,
                    r"--attempt: .*not an attempt number",
                )
            )
        for bad_out, why in [
            (str(box / "afile"), "not a directory"),
            (str(box / "afile" / "o"), "not a directory"),
            (LONG, "longer than"),
            ("", "empty"),
            *UNWRITABLE_OUT(box),
        ]:
            cases.append(
                (
                    f"{step} --output-dir {bad_out[:30]!r}",
                    main,
                    [*base, "--attempt", "1", *extra, "--output-dir", bad_out],
                    2,
                    f"--output-dir: .*{why}",
                )
            )
    for bad_out, why in UNWRITABLE_OUT(box):
        cases += [
            (
                f"validate-config --output-dir {bad_out[:30]!r}",
                validate_config.main,
                ["--config", str(ROOT / "configs/local-cpu.yaml"), "--store-root", s, "--output-dir", bad_out],
                2,
                f"--output-dir: .*{why}",
            ),
            (
                f"finalize --output-dir {bad_out[:30]!r}",
                finalize.main,
                [*base, "--status", "Failed", "--output-dir", bad_out],
                2,
                f"--output-dir: .*{why}",
            ),
            (
                f"hand-over --output-dir {bad_out[:30]!r}",
                hand_over.main,
                [*base, "--attempt", "1", "--workflow", "wf", "--workflow-uid", "u", "--output-dir", bad_out],
                2,
                f"--output-dir: .*{why}",
            ),
        ]
    # A run that was never validated (a mistyped run id, a store root that does not exist): one line, nothing created.
    for where, root in [("a run never validated", s), ("a store root that does not exist", str(box / "nostore"))]:
        ghost = ["--store-root", root, "--run-id", "ghost"]
        never = r"no config for run 'ghost'.*(validate-config|never validated).*--store-root and --run-id"
        cases += [
            (f"finalize, {where}", finalize.main, [*ghost, "--status", "Failed", "--output-dir", out], 2, never),
            (
                f"finalize --holder, {where}",
                finalize.main,
                [*ghost, "--status", "Succeeded", "--holder", "uid-1", "--output-dir", out],
                2,
                never,
            ),
            (
                f"classify-failure, {where}",
                classify_failure.main,
                [*ghost, "--attempt", "0", "--jobset", "js", "--output-dir", out],
                2,
                never,
            ),
        ]
    cases.append(
        (
            "give-up without --holder reads and writes no store",
            give_up.main,
            ["--failure-class", "hang", "--reason", "r"],
            1,
            r"^giving up: class hang: r; to go on after a fix: argo resubmit \(docs/RUNBOOK.md section 4\)$",
        )
    )
    cf = [*base, "--attempt", "1", "--output-dir", out]
    cases += [
        ("classify-failure --jobset Bad_Name", classify_failure.main, [*cf, "--jobset", "Bad_Name"], 2, "Kubernetes"),
        ("classify-failure --jobset of 100", classify_failure.main, [*cf, "--jobset", "j" * 100], 2, "Kubernetes"),
        (
            "classify-failure --step-exit-code x",
            classify_failure.main,
            [*cf, "--jobset", "js", "--step-exit-code", "x"],
            2,
            "exit code",
        ),
        (
            "classify-failure --step-exit-code 30 digits",
            classify_failure.main,
            [*cf, "--jobset", "js", "--step-exit-code", "9" * 30],
            2,
            "exit code",
        ),
        ("provision-slice --pod-timeout inf", provision_slice.main, [*cf, "--pod-timeout", "inf"], 2, "duration"),
        ("provision-slice --pod-timeout nan", provision_slice.main, [*cf, "--pod-timeout", "nan"], 2, "duration"),
        ("provision-slice --pod-timeout -1", provision_slice.main, [*cf, "--pod-timeout", "-1"], 2, "duration"),
        ("provision-slice --k8s-host junk", provision_slice.main, [*cf, "--k8s-host", "not a url"], 2, "API server"),
        ("finalize --status of 5000", finalize.main, [*base, "--status", LONG], 2, "--status: .*longer than"),
        (
            "give-up --reason of 10000",
            give_up.main,
            ["--failure-class", "hang", "--reason", "r" * 10000],
            2,
            "--reason",
        ),
        ("give-up missing --reason", give_up.main, ["--failure-class", "hang"], 2, "required: --reason"),
        (
            "validate-config --config of 5000",
            validate_config.main,
            ["--config", LONG, "--offline"],
            2,
            "--config: .*longer than",
        ),
        (
            "validate-config --config absent",
            validate_config.main,
            ["--config", str(box / "nope.yaml"), "--offline"],
            2,
            "cannot read the file",
        ),
        (
            "validate-config --config is a directory",
            validate_config.main,
            ["--config", str(box), "--offline"],
            2,
            "cannot read the file",
        ),
        (
            "validate-config without --output-dir",
            validate_config.main,
            ["--config", "x.yaml"],
            2,
            "--output-dir is required",
        ),
        (
            "validate-config --store-root is a file",
            validate_config.main,
            ["--config", "x.yaml", "--store-root", str(box / "afile"), "--offline"],
            2,
            "not a directory",
        ),
        (
            "validate-config --output-dir is a file",
            validate_config.main,
            ["--config", "x.yaml", "--output-dir", str(box / "afile")],
            2,
            "not a directory",
        ),
        (
            "validate-config --accept-safe-changes maybe",
            validate_config.main,
            ["--config", "x.yaml", "--offline", "--accept-safe-changes", "maybe"],
            2,
            "not a boolean",
        ),
        # The local runner adds to run ids (a timestamp, the reference run's suffix): an id it cannot use is one line.
        (
            "local runner --run-id too long for its pod names",
            local_runner.main,
            [LOCAL_WF, "--run-id", "r" * 39],
            2,
            r"--run-id: run_id: 'r{39}' is too long: .* at most 38 characters",
        ),
        (
            "local runner --reference beside a 35-character --run-id",
            local_runner.main,
            [LOCAL_WF, "--run-id", "r" * 35, "--reference"],
            2,
            r"--reference: the reference run's id 'r{35}-ref' would have 39 characters.* at most 34 characters",
        ),
        (
            "local runner --run-id not a run id",
            local_runner.main,
            [LOCAL_WF, "--run-id", "../x"],
            2,
            r"--run-id: .*not a valid run id",
        ),
        # Unreachable or unauthenticated stores: one line naming the store and the fix.
        (
            "validate-config, GCS store without credentials",
            validate_config.main,
            ["--config", str(ROOT / "configs/v5e-4x4.yaml"), "--output-dir", out],
            1,
            r"gs://my-training-bucket/jax-recovery.*(credentials|Credentials).*--offline",
        ),
        (
            "restore-latest, GCS store without credentials",
            restore_latest.main,
            ["--store-root", "gs://bucket-1/p", "--run-id", RUN, "--attempt", "0", "--output-dir", out],
            1,
            r"gs://bucket-1/p/runs/local-cpu.*credentials",
        ),
        (
            "provision-slice, GCS store without credentials",
            provision_slice.main,
            ["--store-root", "gs://bucket-1/p", "--run-id", RUN, "--attempt", "0", "--output-dir", out],
            1,
            r"gs://bucket-1/p.*credentials",
        ),
        (
            "classify-failure, GCS store without credentials",
            classify_failure.main,
            ["--store-root", "gs://bucket-1/p", "--run-id", RUN, "--attempt", "0", "--jobset", "js"],
            1,
            r"gs://bucket-1/p.*credentials",
        ),
        (
            "finalize, GCS store without credentials",
            finalize.main,
            ["--store-root", "gs://bucket-1/p", "--run-id", RUN, "--status", "Failed"],
            1,
            r"gs://bucket-1/p.*credentials",
        ),
    ]
    return cases


def test_step_cli_bad_inputs_table(cli_env):
    box = cli_env
    tally = Tally("bad step-CLI inputs")
    cases = _cli_cases(box)
    for name, main, argv, code, pattern in cases:
        before = all_paths(box)
        got = call(main, argv)
        problem = None
        if got.traceback is None:
            lines = [ln for ln in got.err.splitlines() if ln.strip()]
            if got.code != code or not re.search(pattern, got.err):
                problem = f"expected exit {code} matching {pattern!r}, got {got.code}: {got.err[-400:]!r}"
            elif len(lines) > (2 if lines[0].startswith("invalid config") else 1) or max(map(len, lines)) > 600:
                problem = f"not one short line: {got.err[:600]!r}"
            elif all_paths(box) - before - {"out"}:
                problem = f"wrote {sorted(all_paths(box) - before)[:5]}"
        tally.add(name, traceback_text=got.traceback, problem=problem, refused=True)
    tally.finish(minimum=60)


def test_trainer_refuses_bad_arguments_at_the_door(cli_env):
    from trainer.app import parse_args

    for argv, pattern in [
        (["--store-root", "s", "--run-id", "../x", "--attempt", "0"], "run id"),
        (["--store-root", "s", "--run-id", RUN, "--attempt", "-3"], "attempt"),
        (["--store-root", "s", "--run-id", RUN, "--attempt", "0", "--restore-step", "-2"], "step"),
        (["--store-root", "s", "--run-id", RUN, "--attempt", "0", "--metrics-port", "70000"], "port"),
    ]:
        got = call(parse_args, argv)
        assert got.traceback is None and got.code == 2 and re.search(pattern, got.err), got


def test_finalize_escape_run_id_writes_nothing_outside_runs(cli_env):
    box = cli_env
    got = call(finalize.main, ["--store-root", str(box / "store"), "--run-id", "../../escape", "--status", "Failed"])
    assert got.code == 2 and not (box / "escape").exists() and not (box / "store" / "escape").exists()


# ---- bad configs ------------------------------------------------------------------------------------


def _base() -> dict:
    return yaml.safe_load((ROOT / "configs/local-cpu.yaml").read_text())


def _with(path: str, value) -> str:
    data = _base()
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return yaml.safe_dump(data)


def _tpu(**storage) -> str:
    data = _base()
    data["slice"] = {"accelerator": "v5e", "topology": "4x4"}
    data["storage"] = storage
    return yaml.safe_dump(data)


def _bomb(levels: int, fan: int) -> str:
    lines = ['a0: &a0 ["x"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fan) + "]")
    return "\n".join(lines) + "\n"


LOCAL = (ROOT / "configs/local-cpu.yaml").read_text()
# (name, file contents (str or bytes), expected: None = accepted | regex of the refusal)
CONFIGS: list[tuple[str, str | bytes, str | None]] = [
    ("shipped local config", LOCAL, None),
    ("TPU slice with gs:// storage", _tpu(root="gs://bucket-1/p"), None),
    ("TPU slice with a declared durable mount", _tpu(root="/mnt/ckpt", durable_mount=True), None),
    ("TPU slice with a local storage root", _tpu(root="/tmp/ckpt"), r"storage\.root: .*local path on a TPU slice"),
    ("TPU slice with a relative storage root", _tpu(root="runs"), r"storage\.durable_mount: true"),
    ("duplicate top-level key", LOCAL + "run_id: other\n", r"duplicate key 'run_id'"),
    ("duplicate nested key", LOCAL.replace("  keep: 3\n", "  keep: 3\n  keep: 4\n"), r"duplicate key 'keep'"),
    (
        "infinite backoff",
        _with("retry.default_backoff.base_s", float("inf")),
        r"retry\.default_backoff\.base_s.*finite",
    ),
    ("NaN learning rate", _with("optimizer.learning_rate", float("nan")), r"optimizer\.learning_rate.*finite"),
    ("-inf backoff cap", _with("retry.default_backoff.max_s", float("-inf")), r"retry\.default_backoff\.max_s"),
    ("backoff base above its cap", _with("retry.default_backoff", {"base_s": 9, "max_s": 5}), r"base_s 9.*max_s"),
    ("backoff cap of a year", _with("retry.default_backoff.max_s", 31_536_000), r"max_s.*86400"),
    ("negative training seed", _with("training.seed", -1), r"training\.seed.*greater than or equal to 0"),
    ("training seed past int32", _with("training.seed", 2**40), r"training\.seed.*less than or equal to 2147483647"),
    ("negative data seed", _with("data.seed", -5), r"data\.seed"),
    ("30-digit total_steps", _with("training.total_steps", 10**30), r"training\.total_steps.*out of range"),
    ("30-digit budget", _with("retry.budgets", {"hang": 10**30}), r"retry\.budgets.*out of range"),
    (
        "interval longer than the run",
        _with("checkpoint.interval_steps", 100),
        r"checkpoint\.interval_steps: 100 exceeds",
    ),
    ("keep 1", _with("checkpoint.keep", 1), r"checkpoint\.keep: 1 leaves nothing to fall back to"),
    ("keep 0", _with("checkpoint.keep", 0), r"checkpoint\.keep"),
    ("metrics ports past 65535", _with("monitoring.metrics_port", 65534), r"monitoring\.metrics_port.*65535"),
    ("metrics port out of range", _with("monitoring.metrics_port", 70000), r"monitoring\.metrics_port"),
    ("namespace not a Kubernetes name", _with("namespace", "Bad_NS"), r"namespace: .*Kubernetes name"),
    ("service account of 100 characters", _with("service_account", "s" * 100), r"service_account"),
    ("empty image", _with("image", ""), r"image: .*container image"),
    ("image with a space", _with("image", "a b:1"), r"image: .*container image"),
    (
        "reservation not a name",
        _tpu(root="gs://b-1/p").replace("topology: 4x4", "topology: 4x4\n  reservation: Bad Res"),
        r"slice\.reservation",
    ),
    ("run id of 5000 characters", _with("run_id", LONG), r"run_id: 'xxx.*not a valid run id"),
    ("run id escaping the store", _with("run_id", "../../x"), r"run_id: .*not a valid run id"),
    ("GCS root with a capital bucket", _with("storage.root", "gs://B"), r"storage\.root: .*not a GCS bucket URL"),
    ("storage root with a NUL", _with("storage.root", "a\x00b"), r"storage\.root"),
    ("storage root of 2000 characters", _with("storage.root", "d" * 2000), r"storage\.root: .*1024"),
    ("zero hosts", _with("slice.hosts", 0), r"slice\.hosts"),
    ("nine devices per host", _with("slice.devices_per_host", 9), r"slice\.devices_per_host"),
    ("batch not divisible by devices", _with("data.global_batch_size", 6), r"data\.global_batch_size: 6"),
    ("grain worker processes", _with("data.worker_count", 2), r"data\.worker_count"),
    ("no batch prefetched", _with("data.prefetch_batches", 0), r"data\.prefetch_batches"),
    ("unknown key", _with("checkpoint.intervl", 5), r"checkpoint\.intervl: unknown key"),
    ("not UTF-8", b"run_id: caf\xe9\n", r"not UTF-8 text \(byte 11"),
    ("UTF-16 file", LOCAL.encode("utf-16"), r"not UTF-8"),
    ("nesting 5000 deep", "a: " + "[" * 5000 + "]" * 5000 + "\n", r"nested deeper than 32"),
    (
        "mapping nesting 200 deep",
        "".join(f"{' ' * i}k{i}:\n" for i in range(200)) + " " * 200 + "v: 1\n",
        r"nested deeper than 32",
    ),
    ("alias bomb", _bomb(40, 9), r"more than 32 aliases"),
    ("alias expansion under the alias budget", _bomb(16, 2), r"more than 20000 values"),
    ("key of 400 KB", LOCAL + "k" * 400_000 + ": 1\n", r"YAML syntax error at line \d+, column \d+"),
    ("value of 400 KB", _with("image", "i" * 400_000), r"image"),
    ("2000 unknown keys", LOCAL + "".join(f"bogus{i}: 1\n" for i in range(2000)), r"and \d+ more problem"),
    ("empty file", "", r"top level must be a mapping"),
    ("a list at the top", "- 1\n- 2\n", r"top level must be a mapping"),
    ("a scalar at the top", "hello\n", r"top level must be a mapping"),
    ("non-string top-level key", LOCAL + "1: 2\n", r"not a string"),
    ("complex mapping key", "? [a, b]\n: 1\n", r"mapping key must be a plain value|unhashable"),
    ("python object tag", "run_id: !!python/object:os.system [ls]\n", r"YAML"),
    ("tab indentation", "slice:\n\taccelerator: local\n", r"YAML syntax error"),
    ("file over 1 MiB", LOCAL + "#" * (1 << 20) + "\n", r"larger than 1048576 bytes"),
    (
        "several problems, one line each",
        _with("checkpoint", {"keep": 1, "interval_steps": 100}),
        r"interval_steps: 100 exceeds(.|\n)*keep: 1",
    ),
    # JobSet admits worker pod names <run-id>-a<attempt>-workers-0-<host>-<5 random> of at most 63 characters.
    (
        "run id too long for its pod names at attempt 99999",
        _with("run_id", "r" * 39),
        r"run_id: 'r{39}' is too long: at attempt 99999 .* at most 38 characters, or set retry\.max_attempts",
    ),
    ("run id at the pod-name limit of 4 hosts", _with("run_id", "r" * 38), None),
    (
        "run id too long for the pod names of 16 hosts",
        yaml.safe_dump(
            {
                **_base(),
                "run_id": "r" * 38,
                "slice": {"accelerator": "v5p", "topology": "4x4x4"},
                "storage": {"root": "gs://b-1/p"},
                "data": {**_base()["data"], "global_batch_size": 64},
            }
        ),
        r"run_id: .* on 16 hosts .* at most 37 characters",
    ),
    (
        "40-character run id, attempts capped at 1000",
        yaml.safe_dump({**_base(), "run_id": "r" * 40, "retry": {**_base()["retry"], "max_attempts": 1000}}),
        None,
    ),
    (
        "40-character run id, attempts capped at 1001",
        yaml.safe_dump({**_base(), "run_id": "r" * 40, "retry": {**_base()["retry"], "max_attempts": 1001}}),
        r"at attempt 1000 .* at most 39 characters, or set retry\.max_attempts to at most 1000",
    ),
    # What GKE, the container runtime or GCS would refuse later, and YAML the parser would answer in its own words.
    ("hosts: true", _with("slice.hosts", True), r"slice\.hosts: True is a boolean where a number is meant"),
    ("a budget of true", _with("retry.budgets", {"hang": True}), r"retry\.budgets: .*boolean where a number"),
    ("learning rate of false", _with("optimizer.learning_rate", False), r"optimizer\.learning_rate: .*boolean"),
    (
        "devices_per_host on a TPU slice",
        _tpu(root="gs://b-1/p").replace("topology: 4x4", "topology: 4x4\n  devices_per_host: 4"),
        r"slice\.devices_per_host: applies to accelerator 'local' only",
    ),
    ("image with upper case", _with("image", "Registry.io/Team/Trainer:1"), r"image: .*not a container image"),
    ("image with an empty tag", _with("image", "trainer:"), r"image: .*not a container image"),
    ("image with a bad digest", _with("image", "trainer@sha256:xyz"), r"image: .*not a container image"),
    ("image with a double slash", _with("image", "gcr.io//trainer:1"), r"image: .*not a container image"),
    ("image with a 129-character tag", _with("image", "trainer:" + "t" * 129), r"image: .*not a container image"),
    ("image by digest", _with("image", "us-docker.pkg.dev/p/r/trainer@sha256:" + "a" * 64), None),
    ("image on a registry port", _with("image", "localhost:5000/team/trainer_x:v1.2-rc"), None),
    ("blank storage root", _with("storage.root", "   "), r"storage\.root: .*blank"),
    (
        "GCS prefix leaving no room for the run's paths",
        _tpu(root="gs://b-1/" + "p" * 900),
        r"storage\.root: .*leaves no room.*at most 1024; shorten the root's prefix to at most \d+ bytes",
    ),
    ("GCS prefix with room for the run's paths", _tpu(root="gs://b-1/" + "p" * 700), None),
    (
        "local root with a component over 255 bytes",
        _with("storage.root", "/tmp/" + "d" * 300),
        r"storage\.root: .*over 255 bytes",
    ),
    (
        "YAML merge key",
        LOCAL.replace("checkpoint:\n", "checkpoint:\n  <<: {keep: 3}\n", 1),
        r"YAML merge key \('<<'\) is not supported",
    ),
    (
        "40-character run id, every budget counted over the run",
        yaml.safe_dump(
            {
                **_base(),
                "run_id": "r" * 40,
                "retry": {**_base()["retry"], "budget_scopes": {"preemption": "run", "capacity": "run"}},
            }
        ),
        None,
    ),
]


def test_bad_config_table(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tally = Tally("bad configs")
    for i, (name, text, pattern) in enumerate(CONFIGS):
        p = tmp_path / f"c{i}.yaml"
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        got = call(validate_config.main, ["--config", str(p), "--offline"])
        problem = None
        if got.traceback is None:
            if pattern is None:
                if got.code != 0:
                    problem = f"refused a good config: {got.err[:400]}"
            elif got.code != 2 or not re.search(pattern, got.err):
                problem = f"expected exit 2 matching {pattern!r}, got {got.code}: {got.err[:400]!r}"
            elif len(got.err) > 8000 or max(len(ln) for ln in got.err.splitlines()) > 400:
                problem = f"message too long ({len(got.err)} characters)"
        tally.add(name, traceback_text=got.traceback, problem=problem, refused=pattern is not None)
    tally.finish(minimum=40)
    assert tally.refused >= 40


# ---- two of the same step at once -------------------------------------------------------------------


def test_two_restore_latest_runs_record_every_quarantine(template, tmp_path):
    """Each run moves what it found; the attempt's record lists both moves, whichever wrote last."""
    root, run = _racing_store(template, tmp_path)
    first = restore_latest.run(RunStore(str(root), RUN), 1)
    flip(run / "checkpoints" / "50")  # damaged after the first run looked: only the second run moves it
    second = restore_latest.run(RunStore(str(root), RUN), 1)
    assert (first.quarantined, second.quarantined, second.selection.step) == (["quarantine/60"], ["quarantine/50"], 40)
    rec = json.loads((run / "attempts" / "1" / "restore.json").read_text())
    assert rec["quarantined"] == ["quarantine/50", "quarantine/60"] and rec["restore_step"] == 40
    assert {s["name"] for s in rec["skipped"]} == {"50", "60"}
    assert sorted(p.name for p in (run / "quarantine").iterdir()) == ["50", "60"]


def test_concurrent_restore_latest_threads_record_every_quarantine(template, tmp_path):
    root, run = _racing_store(template, tmp_path)
    flip(run / "checkpoints" / "50")
    _race_restore_latest(root)
    moved = sorted(f"quarantine/{p.name}" for p in (run / "quarantine").iterdir())
    assert json.loads((run / "attempts" / "1" / "restore.json").read_text())["quarantined"] == moved


class _ReplacedMeanwhile(RunStore):
    """A run store in which another validate-config replaces the config right after this one read it."""

    other: Callable[[], int]

    def read_record_versioned(self, rel, model):
        got = super().read_record_versioned(rel, model)
        if rel == "config.json" and getattr(self, "other", None) is not None:
            other, self.other = self.other, None
            assert other() == 0  # the other validate-config succeeds first
        return got


@pytest.mark.parametrize("mine_changes", [False, True], ids=["same-config", "safe-change"])
def test_two_validate_config_runs_with_different_configs_cannot_both_succeed(tmp_path, mine_changes):
    cfg = tiny_config()
    store_root = str(tmp_path / "store")
    assert validate_config.run(cfg, RunStore(store_root, cfg.run_id)).code == 0
    changed = cfg.model_copy(update={"training": cfg.training.model_copy(update={"heartbeat_timeout_s": 777})})
    other_cfg, mine = (cfg, changed) if mine_changes else (changed, cfg)
    store = _ReplacedMeanwhile(store_root, cfg.run_id)
    store.other = lambda: (
        validate_config.run(other_cfg, RunStore(store_root, cfg.run_id), accept_safe_changes=True).code
    )
    r = validate_config.run(mine, store, accept_safe_changes=True)
    assert r.code == 2 and "changed while being validated" in r.messages[-1], r.messages
    pinned = json.loads((tmp_path / "store" / "runs" / cfg.run_id / "config.json").read_text())["hash"]
    assert pinned == other_cfg.config_hash()

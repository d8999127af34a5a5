"""The one step skeleton (recovery_steps.step): one error type, one error mapping, one failure record, one main."""

from __future__ import annotations

import argparse

import pytest

from jaxrec.adapters.kube import api_exit_code
from jaxrec.adapters.store import StoreUnavailable
from jaxrec.model.contract import ExitCode
from recovery_steps.step import Step, StepError, api_error, main, run_step


def _step(act, recorded):
    def parser():
        p = argparse.ArgumentParser(prog="demo")
        p.add_argument("--store-root", default="/nonexistent-root")
        p.add_argument("--run-id", default="demo-run")
        return p

    return Step("demo", parser, act, on_error=lambda args, e: recorded.append((args.run_id, int(e.code), str(e))))


def _args():
    return argparse.Namespace(store_root="/nonexistent-root", run_id="demo-run")


def _raise(e):
    def act(_args):
        raise e

    return act


@pytest.mark.parametrize(
    ("error", "code", "line", "recorded"),
    [
        (StepError(ExitCode.CAPACITY, "slice not ready"), 75, "demo: slice not ready", True),
        (StepError(143, "SIGTERM: left running", record=False), 143, "demo: SIGTERM: left running", False),
        (
            StoreUnavailable("gs://b/r unreachable"),
            69,
            "demo: gs://b/r unreachable; transient, Argo retries this step",
            False,
        ),
        (PermissionError(13, "Permission denied"), 69, "demo:", False),
    ],
)
def test_every_failure_is_one_line_its_exit_code_and_the_steps_failure_record(error, code, line, recorded):
    rec, out, err = [], [], []
    assert run_step(_step(_raise(error), rec), _args(), out=out.append, err=err.append) == code
    assert len(err) == 1 and err[0].startswith(line) and "\n" not in err[0] and not out
    assert rec == ([("demo-run", code, str(error))] if recorded else [])


def test_a_failed_steps_line_is_its_containers_termination_message(tmp_path, monkeypatch):
    """What the step prints last when it fails is what the kubelet reads from /dev/termination-log, and Argo puts
    after "main: Error (exit code N)" in the node's message; a step that succeeds leaves the file empty."""
    from jaxrec.model.names import TERMINATION_LOG_ENV
    from recovery_steps import step as kstep

    log = tmp_path / "termination-log"
    log.touch()  # the kubelet creates it, empty, before the container starts
    monkeypatch.setenv(TERMINATION_LOG_ENV, str(log))  # the container's file, where the tier's kubelet names it
    err: list[str] = []
    assert run_step(_step(_raise(StepError(ExitCode.CAPACITY, "slice not ready")), []), _args(), err=err.append) == 75
    assert log.read_text() == "demo: slice not ready" == err[0]
    log.write_text("")
    assert run_step(_step(lambda _a: (1, "JobSet r-a0 failed: worker 3 failed"), []), _args(), out=lambda _: None) == 1
    assert log.read_text() == "demo: JobSet r-a0 failed: worker 3 failed"
    log.write_text("")
    assert run_step(_step(lambda _a: (0, "outcome=succeeded"), []), _args(), out=lambda _: None) == 0
    assert log.read_text() == ""
    kstep.say_why("x" * 5000, log)
    assert len(log.read_bytes()) == 4096  # the kubelet reads at most that much
    kstep.say_why("not a pod", tmp_path / "absent")  # a process outside a pod has no file: nothing is created
    assert not (tmp_path / "absent").exists()


def test_success_prints_the_outputs_line_and_returns_the_acts_code():
    rec, out, err = [], [], []
    assert run_step(_step(lambda _a: (1, "outcome=failed"), rec), _args(), out=out.append, err=err.append) == 1
    assert out == ["outcome=failed"] and not err and not rec


def test_main_parses_then_runs(capsys):
    rec: list = []
    assert main(_step(lambda a: (0, f"run {a.run_id}"), rec), ["--run-id", "r1"]) == 0
    assert capsys.readouterr().out.strip() == "run r1"


class _ApiException(Exception):  # the kubernetes client's exception, as api_exit_code recognises it by name
    def __init__(self, status, reason, body=""):
        super().__init__(reason)
        self.status, self.reason, self.body = status, reason, body


_ApiException.__name__ = "ApiException"


@pytest.mark.parametrize(
    ("status", "code", "hint"),
    [(429, 69, "; retried"), (503, 69, "; retried"), (403, 2, "rbac.yaml"), (422, 2, "rbac.yaml"), (None, 69, "")],
)
def test_api_errors_map_through_the_one_table(status, code, hint):
    e = _ApiException(status, "Why", '{"message": "the API says so"}') if status else ConnectionResetError("reset")
    err = api_error(e, doing="create jobset x", transient_hint="; retried")
    assert int(err.code) == code == api_exit_code(e)
    assert str(err).startswith("create jobset x: ") and hint in str(err) and "\n" not in str(err)


STEPS = (
    "validate_config",
    "restore_latest",
    "provision_slice",
    "train_segment",
    "classify_failure",
    "finalize",
    "hand_over",
    "give_up",
)


@pytest.mark.parametrize("step", STEPS)
def test_no_step_imports_another_step(step):
    import ast
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "recovery_steps" / f"{step}.py"
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    others = {f"recovery_steps.{s}" for s in STEPS if s != step}
    assert not imported & others, f"{step} imports {sorted(imported & others)}"


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ("ServiceUnavailable", ExitCode.TRANSIENT),  # a 503 no part of the step wrapped: still transient
        ("TooManyRequests", ExitCode.TRANSIENT),
        ("Forbidden", 1),  # a refusal: the step's own code for an unusable store
    ],
)
def test_a_steps_store_code_applies_to_refusals_and_never_to_a_transient_answer(error, code):
    """provision-slice, restore-latest, classify-failure, hand-over and finalize end with 1 when the store refuses;
    a transient answer in their first seconds (or their last) is 69 for Argo's retry, charged to no class."""
    from google.api_core import exceptions as gexc

    step = _step(_raise(getattr(gexc, error)("gs://b/r")), [])
    step = Step(step.name, step.parser, step.act, store_code=1)
    assert run_step(step, _args(), out=lambda _: None, err=lambda _: None) == code

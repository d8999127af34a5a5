"""``classify-failure``: gather evidence of a failed attempt, classify it, close it in the ledger, decide retry or stop.

Usage: ``python -m recovery_steps.classify_failure --store-root R --run-id ID --attempt N --jobset NAME
--output-dir D``. Outputs: ``failure-class``, ``decision``, ``reason``, ``backoff-seconds``, ``backoff-wait``,
``attempts-by-class`` (JSON), ``next-attempt``, ``budget-exhausted`` (``1`` when the run stops because
the failure class spent its budget, else ``0``). Exits 0 whenever it classified (whatever the
decision); exits 1 when it cannot read or write the run store, 2 when the run has no usable config. On GKE a
Kubernetes read it decides on that fails is never taken for absence: it exits 69 (transient, retried) when the API
is out of reach or answers 429/5xx, 2 when the API refuses the read or there is no Kubernetes config.

Destructive acts and their evidence: none of its own, but closing an attempt in the ledger is what lets the next
provision-slice delete that attempt's gang, so it closes one only on what it read: the supervisor's verdict and
the JobSet, Jobs, pods and nodes it decides on. A read among those that fails closes nothing (exit 69); a gang that
still runs with no verdict is recorded ``running`` and supervised again, never closed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxrec.adapters import cli
from jaxrec.adapters.documents import read_ledger
from jaxrec.adapters.store import AttemptRef, RunLayout, RunStore
from jaxrec.model.config import ARGO_MAX_DEPTH, JobConfig, RetryConfig, segment_pod_depth
from jaxrec.model.contract import AttemptOutcome, Decision, ExitCode, FailureClass
from jaxrec.model.outputs import ClassifyOutputs
from jaxrec.model.records import AttemptRecord, Ledger, SupervisorLosses, now
from recovery_steps import lease
from recovery_steps.classify import Verdict, classify
from recovery_steps.closing import ClosingAttempt, close_attempt, gather
from recovery_steps.evidence import Evidence
from recovery_steps.in_place import current_attempt
from recovery_steps.retry import RetryDecision, argo_duration, ledger_errors
from recovery_steps.step import Step, k8s_client, load_run_config

log = logging.getLogger(__name__)


@dataclass
class ClassifyResult:
    """What ``run`` decided and wrote."""

    verdict: Verdict
    decision: RetryDecision
    record: AttemptRecord
    ledger: Ledger
    evidence: Evidence
    budget_exhausted: bool = False


# Why a failed read ends the step: its gang may still run, and a closed attempt lets provision-slice delete it.
UNREAD_HINT = "; not taken for absence: transient, Argo retries classify-failure"

# A supervisor lost this often in one attempt is not bad luck: the attempt is closed (class from the evidence).
MAX_SUPERVISOR_LOSSES = 10


def orphaned_gang(ev: Evidence) -> str | None:
    """Why the attempt's gang is alive without a supervisor's verdict, or None (pure).

    The JobSet exists and has not finished, no Job of it failed (a Job at FailureTarget has failed before its
    JobSet reacts), and no supervisor recorded a verdict (none at all: its pod was evicted, drained, shut down with
    its node or OOM-killed, past Argo's retries; or it left transient). Closing the attempt would let the next
    attempt's provision-slice delete a healthy gang: supervise it again instead.
    """
    js = ev.jobset
    if js is None or not js.found:
        return None
    if js.finished or any(j.failure() is not None for j in ev.jobs):
        return None
    sup = ev.supervision
    if sup is not None and (
        sup.decided or (sup.outcome == AttemptOutcome.ERROR and sup.exit_code != ExitCode.TRANSIENT)
    ):
        return None
    why = "no supervision record" if sup is None else f"the supervisor left transient ({sup.reason})"
    return f"JobSet {js.name} is running and {why}: its supervisor was lost"


def _api_client() -> Any:
    """The in-cluster (or kubeconfig) client; without one nothing of the gang can be read: configuration (2)."""
    fix = "classify-failure reads the attempt's gang in the cluster, as the workflow's ServiceAccount (or a kubeconfig)"
    return k8s_client(None, fix=fix)


def run(
    closing: ClosingAttempt,
    output_dir: Path | None = None,
    *,
    api_client: Any = None,
    step_exit_code: int | None = None,
    clock: Callable[[], float] = now,
) -> ClassifyResult:
    """Classify attempt ``closing.ref.attempt`` of a run, close it in the ledger and decide what follows.

    ``output_dir``: one file per output parameter (None: nothing written); ``api_client``: None is the in-cluster
    config; ``step_exit_code``: the code of a step that failed before the JobSet ran (e.g. 75), when known.

    Raises:
        StepError: the store could not be read or written, or the run has no usable config.
    """
    store = closing.ref.store()
    with ledger_errors(store, 1):  # a ledger it cannot read or write: exit 1
        # The gang's newest attempt: its trainers may have been restarted in place (level 0) since it was created.
        gang_attempt = closing.ref.attempt
        attempt = current_attempt(store, gang_attempt)
        if attempt != gang_attempt:
            closing = dataclasses.replace(closing, ref=dataclasses.replace(closing.ref, attempt=attempt))
        ref = closing.ref
        cfg = load_run_config(ref.store_root, ref.run_id, check_ledger=False)
        read_ledger(store)  # a damaged ledger is refused before anything is written
        client = _api_client() if api_client is None else api_client
        ev = gather(store, cfg, attempt, closing.jobset, api_client=client, step_exit_code=step_exit_code,
                    unread_hint=UNREAD_HINT, gang_attempt=gang_attempt)  # fmt: skip
        lost = orphaned_gang(ev)
        ran, resupervised = _workflow_nesting(store, closing.workflow, attempt)
        if lost is not None:
            losses = store.read_record(RunLayout.supervisor_losses(attempt), SupervisorLosses)
            losses = losses or SupervisorLosses(attempt=attempt)
            deep = segment_pod_depth(ran, resupervised + 1) >= ARGO_MAX_DEPTH
            if deep:
                ev.notes.append(
                    f"{lost}; supervising it again would nest {segment_pod_depth(ran, resupervised + 1)} calls deep "
                    f"and Argo refuses {ARGO_MAX_DEPTH}: the attempt is closed"
                )
            elif len(losses.at) < MAX_SUPERVISOR_LOSSES:
                losses = losses.model_copy(update={"at": [*losses.at, clock()], "reasons": [*losses.reasons, lost]})
                store.write_record(RunLayout.supervisor_losses(attempt), losses)
                again = _resupervise(store, cfg, closing, ev, lost, len(losses.at))
                if output_dir is not None:
                    write_outputs(Path(output_dir), again)
                return again
            else:
                ev.notes.append(f"{lost}; lost {len(losses.at)} times already: the attempt is closed")
        verdict = classify(ev)
        decision, record, ledger = close_attempt(store, cfg, closing, ev, verdict, clock, resupervised)
    spent = budget_exhausted(decision, verdict.failure_class, cfg.retry)
    result = ClassifyResult(verdict, decision, record, ledger, ev, spent)
    if output_dir is not None:
        write_outputs(Path(output_dir), result)
    return result


def _workflow_nesting(store: RunStore, workflow: str | None, attempt: int) -> tuple[int, int]:
    """The attempts of Workflow ``workflow`` (``attempt``, not closed yet, included) and its re-attached supervisors.

    Both nest the Workflow deeper (``segment_pod_depth``); the supervisors are counted from ``SupervisorLosses``.
    """
    ledger = store.read_record(RunLayout.LEDGER, Ledger)
    mine = {a.attempt for a in (ledger.attempts if ledger else []) if workflow and a.workflow == workflow} | {attempt}
    losses = [store.read_record(RunLayout.supervisor_losses(a), SupervisorLosses) for a in sorted(mine)]
    return len(mine), sum(len(x.at) for x in losses if x is not None)


def _resupervise(
    store: RunStore, cfg: JobConfig, closing: ClosingAttempt, ev: Evidence, lost: str, n: int
) -> ClassifyResult:
    """The decision for a gang that lost its supervisor: supervise the same attempt again; the ledger is unchanged."""
    attempt = closing.ref.attempt
    reason = f"{lost} ({n} of at most {MAX_SUPERVISOR_LOSSES}); supervising attempt {attempt} again"
    verdict = Verdict(FailureClass.UNKNOWN, reason, [reason, *ev.notes])
    ledger = store.read_record(RunLayout.LEDGER, Ledger) or Ledger(run_id=cfg.run_id)
    decision = RetryDecision(Decision.RESUPERVISE, reason, 0, {}, 0)
    record = AttemptRecord(
        attempt=attempt,
        outcome=AttemptOutcome.RUNNING,
        failure_class=FailureClass.UNKNOWN,
        reason=reason,
        evidence=verdict.evidence,
        backend=ev.backend,
        jobset=closing.jobset,
        workflow=closing.workflow,
        decision=Decision.RESUPERVISE,
        decision_reason=reason,
    )
    return ClassifyResult(verdict, decision, record, ledger, ev)


def _one_line(text: str) -> str:
    # Reasons travel as Argo parameters and metric labels: one line, no quotes that break `when` expressions.
    return " ".join(text.split()).replace("'", "").replace('"', "")


def budget_exhausted(decision: RetryDecision, failure_class: FailureClass, retry: RetryConfig) -> bool:
    """Whether the run stops because ``failure_class`` spent its budget (pure).

    A stop for another reason (the no-progress guard, the attempt cap) is not a spent budget.
    """
    return decision.decision == Decision.STOP and decision.failures_of_class > retry.budget(failure_class)


def write_outputs(output_dir: Path, r: ClassifyResult) -> None:
    """One file per output parameter."""
    d = r.decision
    reason = r.verdict.reason if d.decision != Decision.STOP else f"{d.reason}. Last failure: {r.verdict.reason}"
    ClassifyOutputs(
        failure_class=r.verdict.failure_class,
        decision=d.decision,
        reason=_one_line(reason),
        backoff_seconds=int(d.backoff_seconds),
        backoff_wait=argo_duration(r.record.backoff_wait_seconds or 0.0),
        attempts_by_class=d.attempts_by_class,
        next_attempt=r.record.attempt + 1,
        budget_exhausted=r.budget_exhausted,
    ).write(output_dir)


def summary(r: ClassifyResult) -> str:
    """A readable summary for the step's log."""
    rec, d = r.record, r.decision
    lines = [
        f"attempt {rec.attempt} ({r.evidence.backend}): {rec.failure_class} -> {d.decision}"
        + (
            f" after a {d.backoff_seconds}s backoff ({rec.backoff_wait_seconds or 0:.1f}s left of it)"
            if d.decision != Decision.STOP
            else ""
        ),
        f"  reason:     {r.verdict.reason}",
        f"  decision:   {d.reason}",
        f"  checkpoint: step {rec.checkpoint_step_before} -> {rec.checkpoint_step_after}",
        "  by class:   " + (", ".join(f"{k}={v}" for k, v in d.attempts_by_class.items() if v) or "none"),
        "  evidence:",
    ]
    lines += [f"    - {e}" for e in rec.evidence] or ["    (none)"]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The step's arguments."""
    p = cli.StepArgumentParser(prog="python -m recovery_steps.classify_failure", description=__doc__)
    p.add_argument("--store-root", required=True, type=cli.store_root, help="gs://bucket/prefix or a local directory")
    p.add_argument("--run-id", required=True, type=cli.run_id)
    p.add_argument("--attempt", required=True, type=cli.attempt, help="the attempt that failed")
    p.add_argument("--jobset", required=True, type=cli.k8s_name, help="the attempt's JobSet name")
    p.add_argument("--output-dir", type=cli.output_dir, default=None, help="one file per output parameter")
    p.add_argument(
        "--step-exit-code",
        type=cli.bounded_int(-255, 255, "an exit code"),
        default=None,
        help="exit code of a step that failed earlier",
    )
    p.add_argument(
        "--workflow",
        type=cli.k8s_name,
        default=None,
        help="name of the Workflow running the attempt ({{workflow.name}}): counts its attempts for the hand-over",
    )
    p.add_argument("--holder", default=None, help="this workflow's uid: a Workflow that has ended once acts no more")
    return p


def act(args: argparse.Namespace) -> tuple[int, str]:
    """Classify, close the attempt, decide; the summary for the step's log."""
    if args.holder and args.workflow:
        cfg = load_run_config(args.store_root, args.run_id, check_ledger=False)
        store = RunStore(args.store_root, args.run_id)
        lease.refuse_replay(store, args.holder, args.workflow, cfg.namespace, _api_client)
    r = run(
        ClosingAttempt(AttemptRef.of(args), args.jobset, args.workflow),
        args.output_dir,
        step_exit_code=args.step_exit_code,
    )
    return 0, summary(r)


# A run store that cannot be reached for good (not transient) ends the step with 1, as a ledger it cannot write.
STEP = Step("classify-failure", parser, act, ClassifyOutputs, store_code=1)
main = STEP.main


if __name__ == "__main__":
    sys.exit(main())

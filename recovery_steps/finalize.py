"""``finalize`` (the workflow's exit handler): record the run's final status in the ledger and print its history.

Usage: ``python -m recovery_steps.finalize --store-root R --run-id ID --status S [--failures JSON]
[--output-dir D]``. ``S`` is Argo's ``{{workflow.status}}`` (Succeeded, Failed, Error); ``--failures``
is ``{{workflow.failures}}``. Outputs: ``final-status``, ``steps-lost`` (steps recomputed because of
failures, summed over the run's incidents) and ``recovery-seconds`` (failure to back-at-the-pre-failure
step for the last incident that recovered; ``-1`` when none did), computed from each attempt's records (the
supervisor's verdict, the restore decision, the workers' exit reports and heartbeats, the ledger) as the run's
report builds its incidents.

With ``--holder`` (``{{workflow.uid}}``) it acts only when this Workflow holds the run lease, and then, when
the run ends other than Succeeded (``argo stop`` too: Argo runs the exit handler after a stop), it stops the
run's gang before it releases the lease: it deletes the JobSets labelled ``jaxrec/run-id=<run-id>`` in the
config's namespace (foreground propagation) and says in one line which. It never deletes after a hand-over
or while another workflow holds the lease. The attempt that gang ran, when the ledger does not close it yet, is
closed as ``stopped`` (no failure class, no budget charged), so the ledger lists every attempt the store holds.

Destructive acts and their evidence: it deletes the run's JobSets only when this Workflow holds the lease and its
validate-config confirmed it (``RunLease.first_attempt``: a submission that refused or never finished acts on
nothing, releases the lease and records nothing), and the run did not succeed. Holding the lease is the evidence
that no other Workflow acts for the run: a gang an earlier Workflow left training (``argo delete``) is the run's
and goes with it. ``argo terminate`` and ``argo delete`` run no exit handler
(argo-workflows ``ShutdownStrategy.ShouldExecute``: Terminate runs nothing): the run's next provision-slice
deletes that gang (docs/DEPLOY.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxrec.adapters import cli
from jaxrec.adapters.documents import read_run_config
from jaxrec.adapters.incidents import incidents_from_facts, read_attempt_facts
from jaxrec.adapters.kube import api_error_line, api_exit_code, delete_run_jobsets
from jaxrec.adapters.store import (
    DocumentError,
    RunLayout,
    RunStore,
    StoreUnavailable,
    first_line,
    store_errors,
    transient_as_unavailable,
)
from jaxrec.model.config import ConfigError
from jaxrec.model.contract import AttemptOutcome, Decision, ExitCode, FinalStatus
from jaxrec.model.names import RUN_ID_LABEL
from jaxrec.model.outputs import FinalizeOutputs
from jaxrec.model.records import AttemptRecord, Ledger, RunLease, now
from jaxrec.model.totals import RunTotals, run_totals
from recovery_steps import lease
from recovery_steps.attempts import checkpoint_step_before, newest_checkpoint_step
from recovery_steps.retry import ledger_errors, update_ledger, with_attempt
from recovery_steps.step import Step, StepError, api_failures, k8s_client

log = logging.getLogger(__name__)

SUCCEEDED, FAILED = FinalStatus.SUCCEEDED, FinalStatus.FAILED
HANDED_OVER, NOT_HOLDER = FinalStatus.HANDED_OVER, FinalStatus.NOT_HOLDER


@dataclass
class FinalizeResult:
    """What the exit handler recorded."""

    final_status: str
    final_reason: str
    ledger: Ledger
    totals: RunTotals | None = None


def recovery_totals(store: RunStore, ledger: Ledger) -> RunTotals:
    """Steps lost and the last recovery time over the run's incidents, as the report and the drill build them.

    Each failed attempt followed by another is an incident: it lost the steps past the point the next attempt
    restored (a fresh restart restores step 0), and it recovered when the next attempt was back at the failed
    attempt's last step. A failed attempt with no next one lost an unknown number of steps and is not counted.
    """
    return run_totals([t.incident for t in incidents_from_facts(read_attempt_facts(store, ledger))])


def parse_failures(text: str | None) -> list[dict[str, Any]]:
    """Argo's ``{{workflow.failures}}`` (a JSON list of failed nodes) -> list; unparseable text -> one entry."""
    if not text or text.startswith("{{"):
        return []
    try:
        data = json.loads(text)
    except ValueError:
        return [{"displayName": "workflow", "message": " ".join(text.split())[:300]}]
    return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []


def _class_counts(ledger: Ledger) -> str:
    counts = {k: v for k, v in ledger.by_class().items() if v}
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def _decisive_failure(failures: list[dict[str, Any]]) -> dict[str, Any]:
    """The failure that says most about how the run ended, whatever order ``{{workflow.failures}}`` lists them in.

    Argo lists every failed node (DAG, Retry and Pod nodes alike) by ranging over the workflow's node map, in
    no set order, and names a pod for each, even a DAG's (argo-workflows v4.0.5,
    ``workflow/controller/operator.go``, where ``GlobalVarWorkflowFailures`` is set). So: the give-up step
    first; then a node with a message of its own (a step's; a DAG's is empty, a Retry node's only says its
    expression was false); the one that finished last; by name on a tie.
    """

    def rank(f: dict[str, Any]) -> tuple[bool, bool, str, str]:
        name, message = str(f.get("displayName") or ""), str(f.get("message") or "")
        own = bool(message) and not message.startswith(("retryStrategy.", "child "))
        return (name.startswith("give-up"), own, str(f.get("finishedAt") or ""), name)

    return max(failures, key=rank)


def final_reason(status: str, ledger: Ledger, failures: list[dict[str, Any]]) -> str:
    """One line saying how the run ended (pure).

    A Succeeded run is described as completed (never as failed); a Failed one names the budget or the
    failed step that ended it.
    """
    failed = [a for a in ledger.attempts if a.outcome == AttemptOutcome.FAILED]
    if status == SUCCEEDED:
        done = next((a for a in reversed(ledger.attempts) if a.outcome == AttemptOutcome.SUCCEEDED), None)
        text = "training completed" + (f" in attempt {done.attempt}" if done else "")
        if failed:
            text += f" after recovering from {len(failed)} interruption(s) ({_class_counts(ledger)})"
        return text
    stopped = next((a for a in reversed(ledger.attempts) if a.decision == Decision.STOP), None)
    if stopped is not None:
        why = stopped.decision_reason or "budget spent"
        return f"stopped after attempt {stopped.attempt}: {why}; last failure {stopped.failure_class}: {stopped.reason}"
    if failures:
        f = _decisive_failure(failures)
        return f"{f.get('displayName') or f.get('templateName') or 'a step'} failed: {f.get('message') or 'no message'}"
    if failed:
        last = failed[-1]
        return f"ended after attempt {last.attempt} ({last.failure_class}: {last.reason})"
    return "the workflow ended before any attempt was classified; see the failed step in the Argo UI"


def table(ledger: Ledger) -> str:
    """Per-attempt summary: attempt, outcome/class, decision, checkpoint step before -> after."""
    rows = [("attempt", "class", "decision", "checkpoint", "backoff")]
    for a in ledger.attempts:
        cls = a.failure_class.value if a.failure_class else a.outcome
        dec = a.decision.value if a.decision else "-"
        b = "-" if a.checkpoint_step_before is None else str(a.checkpoint_step_before)
        af = "-" if a.checkpoint_step_after is None else str(a.checkpoint_step_after)
        rows.append((str(a.attempt), cls, dec, f"{b} -> {af}", f"{int(a.backoff_seconds)}s" if a.decision else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _last_attempt(
    store: RunStore, final: str, clock: Callable[[], float], workflow: str | None = None
) -> AttemptRecord | None:
    """The newest attempt as the run's end closes it (succeeded, or stopped, by ``workflow``); None without one."""
    numbers = store.attempts()
    if not numbers:
        return None
    n = numbers[-1]
    return AttemptRecord(
        attempt=n,
        outcome=AttemptOutcome.SUCCEEDED if final == SUCCEEDED else AttemptOutcome.STOPPED,
        reason="training completed",
        checkpoint_step_before=checkpoint_step_before(store, n),
        checkpoint_step_after=newest_checkpoint_step(store),
        ended_at=clock() if final != SUCCEEDED else None,
        closed_at=clock(),
        workflow=workflow,
    )


def _close_stopped(led: Ledger, stopped: AttemptRecord, why: str) -> Ledger:
    """The ledger with ``stopped`` in it when its attempt is still open there (absent, or resupervised)."""
    mine = next((a for a in led.attempts if a.attempt == stopped.attempt), None)
    if mine is not None and mine.outcome != AttemptOutcome.RUNNING:
        return led  # closed already (failed, succeeded, or stopped by an earlier try of this step)
    reason = f"the workflow ended while the attempt was open ({why}); the exit handler stopped its gang"
    kept = mine.model_dump(include={"started_at", "backend", "jobset", "workflow"}) if mine else {}
    keep = {k: v for k, v in kept.items() if v is not None}
    return with_attempt(led, stopped.model_copy(update={"reason": reason, **keep}))


def run(
    store: RunStore,
    status: str,
    failures: str | None = None,
    output_dir: Path | None = None,
    *,
    closes_open: bool = False,
    clock: Callable[[], float] = now,
    workflow: str | None = None,
) -> FinalizeResult:
    """Record the run's final status and reason in the ledger (conditional write).

    On Succeeded, the attempt that completed (the newest one not yet in the ledger) is added with
    outcome 'succeeded' and its checkpoint steps. Otherwise, with ``closes_open`` (this Workflow holds the run and
    its exit handler stops the gang), the newest attempt when it is still open (not in the ledger, or resupervised)
    is closed as 'stopped' with the reason the run ended: no failure class, no budget charged, and the ledger
    still lists every attempt the store holds. ``status`` is Argo's workflow status (Succeeded, Failed, Error),
    ``failures`` its ``{{workflow.failures}}`` JSON; ``workflow`` (``{{workflow.name}}``, None: not known) is named
    on the attempt it closes.

    Raises:
        StepError: the run store cannot be read or written (exit 1, the message says which); the run was never
            validated (no ``config.json``: exit 2, nothing is recorded).
    """
    final = SUCCEEDED if status == SUCCEEDED else FAILED
    run_id = store.run_id
    failed_nodes = parse_failures(failures)
    with ledger_errors(store, 1):  # a run store it cannot read or write: exit 1
        if store.read_bytes(RunLayout.CONFIG) is None:
            # A ledger here would be the first document of a run that does not exist (a mistyped root or id).
            why = f" ({final_reason(final, Ledger(run_id=run_id), failed_nodes)})" if failed_nodes else ""
            raise StepError(
                ExitCode.CONFIGURATION,
                f"{store.url(RunLayout.CONFIG)}: no config for run {run_id!r}: it was never validated{why}, nothing "
                "is recorded; check --store-root and --run-id",
            )
        done = _last_attempt(store, final, clock, workflow) if final == SUCCEEDED or closes_open else None
        holder: dict[str, str] = {}

        def close(led: Ledger) -> Ledger:
            if done is not None and done.outcome == AttemptOutcome.STOPPED:
                led = _close_stopped(led, done, final_reason(final, led, failed_nodes))
            elif done is not None and not any(
                a.attempt == done.attempt and a.outcome == AttemptOutcome.FAILED for a in led.attempts
            ):
                led = with_attempt(led, done)
            reason = final_reason(final, led, failed_nodes)
            holder["reason"] = reason
            return led.model_copy(update={"final_status": final, "final_reason": reason, "argo_status": status})

        ledger = update_ledger(store, close)
    try:
        totals = recovery_totals(store, ledger)
    except (DocumentError, *store_errors()) as e:
        log.warning("run store %s: an attempt's records unreadable (%s); no recovery totals", store.url(), e)
        totals = None
    if output_dir is not None:
        rec = totals.recovery_seconds if totals else None
        FinalizeOutputs(
            final_status=final,
            steps_lost=totals.steps_lost if totals else 0,
            recovery_seconds=-1 if rec is None else round(rec, 3),
        ).write(Path(output_dir))
    return FinalizeResult(final, holder["reason"], ledger, totals)


def not_holder_status(ledger: Ledger | None, holder: str, run_id: str) -> tuple[str, str]:
    """The exit handler's status and line when this Workflow does not hold the run (pure).

    ``HandedOver`` when it passed the run to a continuation (the ledger says so); otherwise ``NotHolder``: a
    second submission that never got the run. Either way the ledger belongs to the holder and is left alone.
    """
    gave = [h for h in (ledger.hand_overs if ledger else []) if h.from_uid == holder]
    if gave:
        h = gave[-1]
        return HANDED_OVER, f"run {run_id!r} continues in workflow {h.to_workflow} from attempt {h.next_attempt}"
    return NOT_HOLDER, f"this workflow does not hold run {run_id!r}; its ledger is left as it is"


def stops_gang(status: str, current: RunLease | None, holder: str | None, ledger: Ledger | None) -> bool:
    """Whether the exit handler deletes the run's JobSets (pure).

    Only the lease's holder does, only once its validate-config confirmed the lease (``first_attempt``: a
    submission that refused acts on nothing), only when the run did not succeed, and never once it handed the run
    over: the gang then belongs to the continuation or to whoever holds the lease.
    """
    if not holder or status == SUCCEEDED or not lease.held_by(current, holder) or current.first_attempt is None:
        return False
    return not any(h.from_uid == holder for h in (ledger.hand_overs if ledger else []))


def stop_gang(store: RunStore, status: str, *, api_client: Any = None, k8s_host: str | None = None) -> str | None:
    """Delete the run's JobSets; the one line saying what was deleted.

    Raises:
        StepError: The API is unreachable or refused (exit 69 when retrying can help), with the command
            that deletes the gang by hand.
        StoreUnavailable: The run's config could not be read (transient).
    """
    run_id = store.run_id
    try:
        with transient_as_unavailable(store.url()):
            cfg = read_run_config(store)
    except (DocumentError, ConfigError) as e:
        return f"run {run_id} ended {status}: no JobSet looked for, the run's config is not readable ({first_line(e)})"
    ns = cfg.namespace
    by_hand = f"delete the gang by hand: kubectl delete jobsets -n {ns} -l {RUN_ID_LABEL}={run_id}"
    try:
        api_client = api_client or k8s_client(k8s_host, fix=by_hand)
        deleted, going, _ = delete_run_jobsets(api_client, ns, run_id)
    except api_failures() as e:
        code = api_exit_code(e)
        then = "Argo retries this step" if code == ExitCode.TRANSIENT else by_hand
        raise StepError(code, f"could not stop run {run_id}'s gang: {api_error_line(e)}; {then}") from None
    if deleted:
        line = f"run {run_id} ended {status}: deleted JobSet {', '.join(deleted)} in namespace {ns} (foreground)"
    else:
        line = f"run {run_id} ended {status}: no JobSet of the run left to delete in namespace {ns}"
    return line + (f"; already being deleted: {', '.join(going)}" if going else "")


def _not_holder(args: Any) -> tuple[int, str] | None:
    """The exit code and line when this Workflow does not hold the run, or None when it does."""
    store = RunStore(args.store_root, args.run_id)
    try:
        with transient_as_unavailable(store.url()):
            current = store.read_record(RunLayout.LEASE, RunLease)
            held = current is None or lease.held_by(current, args.holder)
            ledger = store.read_record(RunLayout.LEDGER, Ledger) if not held else None
            # Its validate-config took the lease, then refused or never finished, in a run that exists (a run never
            # validated at all is refused by ``run`` with its one line).
            unconfirmed = held and current is not None and current.first_attempt is None
            unconfirmed = unconfirmed and store.read_bytes(RunLayout.CONFIG) is not None
            if unconfirmed:
                lease.release(store, args.holder)
    except (DocumentError, *store_errors()) as e:
        raise StepError(1, f"{store.url()}: {e}") from None
    if held and not unconfirmed:
        return None
    status, line = not_holder_status(ledger, args.holder, args.run_id)
    if unconfirmed:
        line = f"this workflow never validated run {args.run_id!r}: its lease released, nothing recorded or deleted"
    if args.output_dir is not None:
        FinalizeOutputs(final_status=status, steps_lost=0, recovery_seconds=-1).write(Path(args.output_dir))
    return 0, f"finalize: {line}"


def _stop_gang_if_holder(args: Any, ledger: Ledger) -> tuple[int, str | None]:
    """Stop the run's gang when ``stops_gang`` says so: (exit code, the line to print)."""
    store = RunStore(args.store_root, args.run_id)
    try:
        with transient_as_unavailable(store.url()):
            current = store.read_record(RunLayout.LEASE, RunLease)  # read again: the lease as it is now
        if not stops_gang(args.status, current, args.holder, ledger):
            return 0, None
        return 0, stop_gang(store, args.status, k8s_host=args.k8s_host)
    except StoreUnavailable as e:
        print(f"finalize: {e}; transient, Argo retries this step", file=sys.stderr)
        return int(ExitCode.TRANSIENT), None
    except (DocumentError, *store_errors()) as e:
        print(f"finalize: {store.url()}: {e}; the run's gang was not stopped", file=sys.stderr)
        return 1, None
    except StepError as e:
        print(f"finalize: {e}", file=sys.stderr)
        return int(e.code), None


def parser() -> argparse.ArgumentParser:
    """The step's arguments."""
    p = cli.StepArgumentParser(prog="python -m recovery_steps.finalize", description=__doc__)
    p.add_argument("--store-root", required=True, type=cli.store_root)
    p.add_argument("--run-id", required=True, type=cli.run_id)
    p.add_argument("--status", required=True, type=cli.bounded_text(64, "--status"), help="Argo {{workflow.status}}")
    p.add_argument(
        "--failures",
        default=None,
        type=cli.bounded_text(1 << 20, "--failures"),
        help="Argo {{workflow.failures}} (JSON)",
    )
    p.add_argument("--output-dir", type=cli.output_dir, default=None)
    p.add_argument("--holder", default=None, help="this workflow's uid: act only if it holds the run lease")
    p.add_argument(
        "--workflow",
        type=cli.k8s_name,
        default=None,
        help="this workflow's name ({{workflow.name}}): the ledger names it on the attempt the run's end closes",
    )
    p.add_argument("--k8s-host", default=None, type=cli.http_url, help="Kubernetes API URL (default: in-cluster)")
    return p


def act(args: argparse.Namespace) -> tuple[int, str]:
    """Record the run's end (when this Workflow holds it), stop a gang left behind, release the lease."""
    if args.holder and (early := _not_holder(args)) is not None:
        return early
    try:
        r = run(
            RunStore(args.store_root, args.run_id),
            args.status,
            args.failures,
            args.output_dir,
            closes_open=bool(args.holder),
            workflow=args.workflow,
        )
    except StepError as e:
        if e.code == ExitCode.CONFIGURATION and args.holder:
            # A lease taken by a validate-config that then refused: released, nothing else written.
            with contextlib.suppress(DocumentError, *store_errors()):
                lease.release(RunStore(args.store_root, args.run_id), args.holder)
        raise
    code, gang = _stop_gang_if_holder(args, r.ledger) if args.holder else (0, None)
    if code == ExitCode.TRANSIENT:
        return code, ""  # the retry stops the gang, then releases the lease (the ledger write is idempotent)
    if args.holder:
        # The last write: a transient answer ends the step 69 (``run_step``), and Argo's retry finds the end recorded.
        lease.release(RunStore(args.store_root, args.run_id), args.holder)
    lines = [f"run {args.run_id}: {r.final_status}: {r.final_reason}", table(r.ledger)]
    if r.totals is not None:
        rec = "-" if r.totals.recovery_seconds is None else f"{r.totals.recovery_seconds:.1f}s"
        lines.append(f"incidents {r.totals.incidents}, steps lost {r.totals.steps_lost}, last recovery {rec}")
    if gang:
        lines.append(f"finalize: {gang}")
    return int(code), "\n".join(lines)


# A run store that cannot be reached for good (not transient) ends the step with 1.
STEP = Step("finalize", parser, act, FinalizeOutputs, store_code=1)
main = STEP.main


if __name__ == "__main__":
    sys.exit(main())

"""Retry budgets: the pure retry/stop decision over the ledger, and the ledger's conditional update.

``decide(...)`` is pure: it sees the attempts already closed, the one being closed now and the
``RetryConfig``. ``append_attempt(...)`` is the only I/O: a read-modify-write of ``ledger.json``
guarded by the object's generation, retried when another writer got there first.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from jaxrec.adapters.store import (
    DocumentError,
    PreconditionFailed,
    RunLayout,
    RunStore,
    StoreUnavailable,
    first_line,
    is_transient,
    store_errors,
)
from jaxrec.model.config import ARGO_MAX_DEPTH, RetryConfig, segment_pod_depth
from jaxrec.model.contract import FAILURE_CLASSES, AttemptOutcome, Decision, FailureClass
from jaxrec.model.records import AttemptRecord, Ledger
from recovery_steps.step import StepError

log = logging.getLogger(__name__)

# Classes the no-progress guard does not count; their own budgets, counted since the last progress by default,
# bound them instead. A capacity attempt never ran training, so it cannot advance the checkpoint. A preemption is
# the platform's doing: on Spot, several in a row can come faster than ``checkpoint.interval_steps``, and the guard
# (3 by default) would stop the run long before the preemption budget (20, or the 50-100 a Spot config sets) that
# exists to bound exactly that. Counting only attempts that reached their first step would not help: a preemption
# after a few steps but before the next checkpoint still advances nothing.
NO_PROGRESS_EXEMPT = frozenset(c.cls for c in FAILURE_CLASSES if c.no_progress_exempt)


@dataclass(frozen=True)
class RetryDecision:
    """What happens after a failed attempt."""

    decision: Decision
    reason: str
    backoff_seconds: int
    attempts_by_class: dict[str, int]
    failures_of_class: int


def backoff_seconds(cfg: RetryConfig, cls: FailureClass, k: int) -> int:
    """Backoff before retrying the ``k``-th failure (1-based) of ``cls``: base * factor^(k-1), capped.

    Rounded up to whole seconds (Argo's suspend duration takes an integer).
    """
    b = cfg.backoff_for(cls)
    raw = b.base_s * b.factor ** max(k - 1, 0)
    return int(math.ceil(min(raw, b.max_s)))


def backoff_wait(backoff_s: float, ended_at: float | None, now: float) -> float:
    """The part of a backoff still to wait at ``now``: the backoff counts from the attempt's end.

    Detection, teardown and classification already took time since the gang stopped; a backoff of 10 s
    after a failure means the next attempt starts no sooner than 10 s after it, as the Kubernetes Job
    controller counts a pod's backoff from its finish time. Without the end time, the whole backoff.
    """
    if ended_at is None:
        return float(backoff_s)
    return max(0.0, float(backoff_s) - max(0.0, now - ended_at))


def argo_duration(seconds: float) -> str:
    """``seconds`` as Argo's suspend duration reads it (whole milliseconds, rounded up: never shorter)."""
    return f"{int(math.ceil(round(seconds * 1000, 6)))}ms"


def advanced(a: AttemptRecord) -> bool:
    """Whether attempt ``a`` advanced the checkpoint step."""
    before = -1 if a.checkpoint_step_before is None else a.checkpoint_step_before
    after = -1 if a.checkpoint_step_after is None else a.checkpoint_step_after
    return after > before


def stalled_attempts(attempts: Sequence[AttemptRecord]) -> int:
    """Consecutive failed attempts, newest backwards, that did not advance the checkpoint step.

    Attempts of a ``NO_PROGRESS_EXEMPT`` class are not counted, but one that advanced the checkpoint (a preemption
    that saved on its way out) is progress all the same and ends the run of stalls.
    """
    n = 0
    for a in sorted(attempts, key=lambda a: a.attempt, reverse=True):
        if a.outcome != AttemptOutcome.FAILED:
            continue
        if advanced(a):
            break
        if a.failure_class not in NO_PROGRESS_EXEMPT:
            n += 1
    return n


def failures_in_scope(attempts: Sequence[AttemptRecord], cls: FailureClass, scope: str) -> int:
    """Failed attempts of ``cls`` that count against its budget.

    ``run``: all of them. ``since_progress``: newest backwards, up to and including the newest attempt that
    advanced the checkpoint step (its failure came after the progress it made).
    """
    n = 0
    for a in sorted(attempts, key=lambda a: a.attempt, reverse=True):
        if a.outcome == AttemptOutcome.FAILED and (a.failure_class or FailureClass.UNKNOWN) == cls:
            n += 1
        if scope == "since_progress" and a.outcome == AttemptOutcome.FAILED and advanced(a):
            break
    return n


def decide(
    previous: Sequence[AttemptRecord], current: AttemptRecord, cfg: RetryConfig, *, resupervised: int = 0
) -> RetryDecision:
    """Retry or stop after ``current`` failed, given the attempts closed before it.

    ``previous``: the ledger's attempts (an entry with ``current.attempt`` is ignored: re-runs are idempotent).

    Returns:
        The decision, a reason that names the budget when it stops, the backoff and the counts by class. A
        retry after ``cfg.attempts_per_workflow`` attempts of ``current.workflow``, or one whose pods Argo would
        refuse as nested too deep (``resupervised``: supervisors re-attached in that Workflow, each one call
        deeper), is ``HAND_OVER``: the same retry, in a continuation Workflow of the run id.
    """
    cls = current.failure_class or FailureClass.UNKNOWN
    attempts = [a for a in previous if a.attempt != current.attempt] + [current]
    counts = {c.value: 0 for c in FailureClass}
    for a in attempts:
        if a.outcome == AttemptOutcome.FAILED:
            counts[(a.failure_class or FailureClass.UNKNOWN).value] += 1
    k = counts[cls.value]  # over the whole run: drives the backoff
    scope = cfg.scope(cls)
    spent_k = failures_in_scope(attempts, cls, scope)
    budget = cfg.budget(cls)
    started = current.attempt + 1
    stalled = stalled_attempts(attempts)

    def stop(reason: str) -> RetryDecision:
        return RetryDecision(Decision.STOP, reason, 0, counts, k)

    if spent_k > budget:
        spent = "no retries" if budget == 0 else f"{budget} retr{'y' if budget == 1 else 'ies'}"
        where = " since the last progress" if scope == "since_progress" else ""
        return stop(f"{cls.value} budget spent: {spent_k} {cls.value} failure(s){where}, budget allows {spent}")
    if cls not in NO_PROGRESS_EXEMPT and stalled >= cfg.no_progress_attempts:
        return stop(
            f"no progress: {stalled} consecutive failed attempts without the checkpoint step advancing "
            f"(guard retry.no_progress_attempts={cfg.no_progress_attempts})"
        )
    if cfg.max_attempts is not None and started >= cfg.max_attempts:
        return stop(f"attempt cap reached: {started} attempts (retry.max_attempts={cfg.max_attempts})")
    wait = backoff_seconds(cfg, cls, k)
    since = " since progress" if scope == "since_progress" else ""
    reason = f"{cls.value} retry {spent_k} of {budget}{since}, next attempt {current.attempt + 1} after {wait}s"
    ran = workflow_attempts(attempts, current.workflow)
    too_deep = ran > 0 and segment_pod_depth(ran + 1, resupervised) >= ARGO_MAX_DEPTH
    if ran >= cfg.attempts_per_workflow or too_deep:
        # Every attempt nests two template calls deeper: the next one runs in a continuation Workflow.
        why = (
            f"its pods would nest {segment_pod_depth(ran + 1, resupervised)} calls deep ({resupervised} "
            f"supervisor(s) re-attached), Argo refuses {ARGO_MAX_DEPTH}"
            if too_deep and ran < cfg.attempts_per_workflow
            else f"retry.attempts_per_workflow={cfg.attempts_per_workflow}"
        )
        reason += f", in a continuation Workflow ({ran} attempts ran in {current.workflow}; {why})"
        return RetryDecision(Decision.HAND_OVER, reason, wait, counts, k)
    return RetryDecision(Decision.RETRY, reason, wait, counts, k)


def workflow_attempts(attempts: Sequence[AttemptRecord], workflow: str | None) -> int:
    """Attempts the Workflow ``workflow`` ran (0 when the Workflow is not known: nothing to hand over)."""
    if workflow is None:
        return 0
    return sum(1 for a in attempts if a.workflow == workflow)


def update_ledger(
    store: RunStore, mutate: Callable[[Ledger], Ledger], *, tries: int = 20, sleep: Callable[[float], None] = time.sleep
) -> Ledger:
    """Read-modify-write ``ledger.json`` under a generation precondition; retry when it lost a race.

    ``mutate`` builds the new ledger from the current one (called again after each lost race); the very ledger it
    was given back writes nothing. Returns the ledger as written (as read, where nothing changed).

    Raises:
        Contended: every try lost its race (a ``PreconditionFailed``).
    """

    def change(current: Ledger | None) -> Ledger:
        return mutate(current if current is not None else Ledger(run_id=store.run_id))

    def pause(i: int) -> None:
        log.info("the ledger changed while it was updated; reading it again")
        sleep(min(0.05 * (i + 1), 0.5))

    return store.update_record(RunLayout.LEDGER, Ledger, change, tries=tries, pause=pause)


def with_attempt(ledger: Ledger, record: AttemptRecord) -> Ledger:
    """The ledger with ``record`` in it: appended, or replacing the entry of the same attempt."""
    kept = [a for a in ledger.attempts if a.attempt != record.attempt]
    attempts = sorted([*kept, record], key=lambda a: a.attempt)
    return ledger.model_copy(update={"attempts": attempts})


def append_attempt(store: RunStore, record: AttemptRecord, **kw) -> Ledger:
    """Add ``record`` to the ledger with a conditional write (appending the same attempt twice is idempotent)."""
    return update_ledger(store, lambda led: with_attempt(led, record), **kw)


@contextlib.contextmanager
def ledger_errors(store: RunStore, code: int) -> Iterator[None]:
    """Turn a failure to read or update the ledger into the step's ``StepError`` with exit ``code`` and one line.

    A transient one (unreachable, HTTP 429/5xx) becomes ``StoreUnavailable``: the step exits ``transient`` and
    Argo retries it, outside every failure-class budget.
    """

    def error(line: str) -> StepError:
        return StepError(code, line)

    try:
        yield
    except DocumentError as e:
        raise error(str(e)) from None
    except PreconditionFailed as e:
        raise error(f"could not update the ledger: {e}") from None
    except store_errors() as e:
        if is_transient(e):
            raise StoreUnavailable(
                f"run store {store.url()} unreachable: {type(e).__name__}: {first_line(e)}"
            ) from None
        from jaxrec.adapters.cli import store_error_line

        raise error(store_error_line("run store", store.url(), e).removeprefix("run store: ")) from None

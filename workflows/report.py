"""Incident table and timeline picture of a run: ``python -m workflows.report <run dir or gs:// run>``."""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxrec.adapters.documents import read_worker_reports
from jaxrec.adapters.incidents import incidents_from_facts, read_attempt_facts
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.records import (
    EventKind,
    Incident,
    Ledger,
    LocalSummary,
    PreemptionSave,
    WorkerEvent,
    WorkerExitReport,
    parse_event_line,
)
from jaxrec.model.totals import CATEGORIES, CATEGORY_HELP, Goodput, goodput, incident_badput

TIMELINE = "timeline.png"


class ReportError(Exception):
    """The target is not a run (one readable line)."""


def open_run(target: str) -> RunStore:
    """The run store of ``<root>/runs/<run-id>`` (a local directory or a ``gs://`` URL).

    Raises:
        ReportError: when the target does not name a run.
    """
    t = target.rstrip("/")
    head, _, run_id = t.rpartition("/")
    root, sep, _ = head.rpartition("/runs") if head.endswith("/runs") else ("", "", "")
    if not sep or not run_id:
        if not t.startswith("gs://") and Path(t).name and Path(t).parent.name == "runs":
            root, run_id = str(Path(t).parent.parent), Path(t).name
        else:
            raise ReportError(f"{target}: not a run; give <store-root>/runs/<run-id> (a directory or gs:// URL)")
    store = RunStore(root or ".", run_id)
    if not store.exists(RunLayout.CONFIG) and not store.exists(RunLayout.ATTEMPTS):
        raise ReportError(f"{target}: no run found there (no config.json or attempts/)")
    return store


def load_incidents(store: RunStore) -> list[Incident]:
    """Every incident of the run, by attempt.

    A local run stores its incident records (timed from the workers' events); a run on a cluster does not, and its
    incidents are built from what each attempt left in the store (``adapters.incidents``).
    """
    out = [i for a in store.attempts() if (i := store.read_record(RunLayout.incident(a), Incident)) is not None]
    if not out:
        out = [t.incident for t in incidents_from_facts(read_attempt_facts(store))]
    return sorted(out, key=lambda i: (i.detected_at or i.stopped_at or 0, i.attempt))


def load_events(store: RunStore) -> list[WorkerEvent]:
    """The workers' events saved with the run, sorted by time."""
    lines = [
        line for o in store.list(RunLayout.LOCAL_EVENTS) for line in (store.read_bytes(o.name) or b"").splitlines()
    ]
    events = [e for line in lines if (e := parse_event_line(line)) is not None]
    return sorted(events, key=lambda e: e.t)


def elapsed(a: float | None, b: float | None) -> str:
    """Seconds from ``a`` to ``b`` to a tenth, "-" when either is unknown."""
    return "-" if a is None or b is None else f"{b - a:.1f}"


def incident_table(incidents: Sequence[Incident]) -> str:
    """The incident table as aligned text (seconds measured from the failure)."""
    head = (
        "attempt",
        "scenario",
        "class",
        "detect",
        "stopped",
        "ready",
        "started",
        "restored",
        "1st step",
        "recovered",
        "pre",
        "restored",
        "tier",
        "lost",
    )
    rows = [head]
    for i in incidents:
        t0 = i.injected_at or i.detected_at
        rows.append(
            (
                str(i.attempt),
                i.scenario or "-",
                i.failure_class.value if i.failure_class else "-",
                elapsed(t0, i.detected_at),
                elapsed(t0, i.stopped_at),
                elapsed(t0, i.slice_ready_at),
                elapsed(t0, i.workers_started_at),
                elapsed(t0, i.restored_at),
                elapsed(t0, i.first_step_at),
                elapsed(t0, i.recovered_at),
                "-" if i.pre_failure_step is None else str(i.pre_failure_step),
                "-" if i.restored_step is None else str(i.restored_step),
                i.restore_tier or "-",
                "-" if i.steps_lost is None else str(i.steps_lost),
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = [
        "  ".join(v.rjust(w) if c not in (1, 2) else v.ljust(w) for c, (v, w) in enumerate(zip(r, widths, strict=True)))
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines) + "\n(times in seconds after the failure was injected, or detected)"


def goodput_lines(g: Goodput) -> str:
    """Time goodput and where the rest of the wall time went, one category a line."""
    lines = [
        f"time goodput {g.time_goodput:.2f} (productive {g.productive_seconds:.1f}s of {g.wall_seconds:.1f}s wall); "
        f"step goodput {g.step_goodput:.2f} ({g.steps_kept} of {g.steps_computed} steps computed kept)"
    ]
    for cat in CATEGORIES:
        v = g.badput[cat]
        share = v / g.wall_seconds if g.wall_seconds else 0.0
        lines.append(f"  {cat:22} {v:7.1f}s  {share:5.1%}  {CATEGORY_HELP[cat]}")
    return "\n".join(lines)


def preemption_line(attempt: int, reports: Sequence[WorkerExitReport]) -> str | None:
    """What the gang of ``attempt`` did with its state on SIGTERM, from the deciding worker's report (None: no stop).

    Process 0 decides for the gang; its report is shown (another's when process 0 left none).
    """
    stopped = [r for r in reports if r.preemption_save != PreemptionSave.NONE]
    if not stopped:
        return None
    r = min(stopped, key=lambda r: r.process_index)
    est = "none measured" if r.preemption_estimate_s is None else f"{r.preemption_estimate_s:.2f} s"
    budget = "?" if r.preemption_budget_s is None else f"{r.preemption_budget_s:.2f} s"
    return (
        f"attempt {attempt}: SIGTERM stop after step {r.last_step}: {r.preemption_save.value} "
        f"(budget {budget}, save estimate {est}; {r.preemption_reason})"
    )


def incident_badput_table(incidents: Sequence[Incident]) -> str:
    """Each incident's lost time by category (seconds, on the incident record's clock)."""
    cats = ("detection", "waiting_for_resources", "startup_and_restore", "compilation", "recomputed", "total")
    rows = [("attempt", *cats)]
    for i in incidents:
        b = incident_badput(i)
        rows.append((str(i.attempt), *("-" if b[c] is None else f"{b[c]:.1f}" for c in cats)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines) + "\n(lost time per incident, seconds, by category)"


def draw_timeline(events: Sequence[WorkerEvent], incidents: Sequence[Incident], title: str) -> bytes:
    """A PNG: step against wall clock per attempt, failures, restores and checkpoints marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min((e.t for e in events), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=100)
    attempts = sorted({e.attempt for e in events})
    for a in attempts:
        pts = [
            (e.t - t0, e.step) for e in events if e.attempt == a and e.process_index == 0 and e.event == EventKind.STEP
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), lw=1.5, label=f"attempt {a}")
    saves = [
        (e.t - t0, e.step)
        for e in events
        if e.event == EventKind.SAVE_COMMITTED and e.process_index == 0 and e.step is not None
    ]
    if saves:
        ax.scatter(*zip(*saves, strict=True), marker="s", s=18, color="tab:gray", zorder=3, label="checkpoint")
    for n, i in enumerate(incidents):
        when = i.injected_at or i.detected_at
        if when is not None:
            ax.axvline(when - t0, color="tab:red", ls="--", lw=1, label="failure" if n == 0 else None)
        if i.restored_at is not None and i.restored_step is not None:
            ax.scatter(
                [i.restored_at - t0],
                [i.restored_step],
                marker="^",
                s=50,
                color="tab:green",
                zorder=4,
                label="restore" if n == 0 else None,
            )
        if i.recovered_at is not None and i.pre_failure_step is not None:
            ax.scatter(
                [i.recovered_at - t0],
                [i.pre_failure_step],
                marker="o",
                s=30,
                facecolors="none",
                edgecolors="tab:green",
                zorder=4,
                label="back at pre-failure step" if n == 0 else None,
            )
    ax.set_xlabel("wall clock (s)")
    ax.set_ylabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def run(target: str, *, say: Callable[[str], None] = print) -> list[str]:
    """Print the run's summary and incident table; write the timeline PNG next to the run.

    Returns:
        Where the picture was written.

    Raises:
        ReportError: when the target is not a run.
    """
    store = open_run(target)
    incidents = load_incidents(store)
    events = load_events(store)
    ledger = store.read_record(RunLayout.LEDGER, Ledger)
    summary = store.read_record(RunLayout.LOCAL_SUMMARY, LocalSummary)
    status = (summary.status if summary else None) or (ledger.final_status if ledger else None) or "unknown"
    say(f"run {store.run_id}: {status}" + (f" ({ledger.final_reason})" if ledger and ledger.final_reason else ""))
    if ledger:
        by = {k: v for k, v in ledger.by_class().items() if v}
        say(f"attempts closed: {len(ledger.attempts)}; failures by class: {by or 'none'}")
    if summary is not None and summary.params_match_reference is not None:
        say(f"final parameters equal the reference run: {summary.params_match_reference}")
    say(incident_table(incidents) if incidents else "no incidents")
    for n in store.attempts():
        line = preemption_line(n, read_worker_reports(store, n)[0])
        if line:
            say(line)
    if incidents:
        say(incident_badput_table(incidents))
    if events:
        say(goodput_lines(goodput(events)))
    say(f"report: python -m workflows.report {store.url()}")
    try:
        png = draw_timeline(events, incidents, f"run {store.run_id}: {status}")
    except ModuleNotFoundError as e:  # the summary above stands; the picture needs the plotting library
        if (e.name or "").split(".")[0] != "matplotlib":
            raise
        say(f"timeline: not drawn ({e}; pip install matplotlib)")
        return []
    paths = []
    if store.is_gcs:
        store.write_bytes(TIMELINE, png)
        local = Path(".local-runs/reports") / f"{store.run_id}-{TIMELINE}"
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(png)
        paths += [store.url(TIMELINE), str(local)]
    else:
        p = Path(store.url(TIMELINE))
        p.write_bytes(png)
        paths.append(str(p))
    say("timeline: " + "  ".join(paths))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m workflows.report``."""
    p = argparse.ArgumentParser(prog="python -m workflows.report", description=__doc__)
    p.add_argument("run", help="<store-root>/runs/<run-id> (a directory or gs:// URL)")
    args = p.parse_args(argv)
    try:
        run(args.run)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

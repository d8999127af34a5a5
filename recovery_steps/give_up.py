"""``give-up``: fail the workflow on purpose when ``classify-failure`` decided to stop.

Usage: ``python -m recovery_steps.give_up --failure-class C --reason TEXT [--store-root R --run-id ID --holder UID
--workflow NAME --namespace NS]``. Prints one line, ``giving up: class C: TEXT; to go on after a fix: argo resubmit
...`` (also the container's termination message: the node's message in Argo), and exits 1.

With ``--holder`` it first asks whether this Workflow has already ended once: its own exit handler released the run
lease, or another Workflow holds it. That is ``argo retry`` of a run that gave up: Argo v4.0.5 resets only this step
and the nodes above it (``workflow/util/util.go``, ``FormulateRetryWorkflow``: a failed node with a succeeded
descendant is kept), so the verdict is the same, and the Workflow then stays Running with nothing left to run (its
nested DAG is not assessed again; argo-workflows issue #10425). A retried give-up therefore stops its own Workflow
(``spec.shutdown: Stop``, as ``argo stop`` does) and says what to run instead: ``argo resubmit``, a new Workflow of
the same run id, which continues the run from its latest checkpoint with the ledger's budgets.

Destructive acts: none (the exit handler stops the gang, on its own evidence).
"""

from __future__ import annotations

import argparse
import sys

from jaxrec.adapters import cli
from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.contract import ExitCode, FailureClass
from jaxrec.model.names import DESCRIPTION_ANNOTATION, FAILURE_CLASS_LABEL
from jaxrec.model.records import RunLease
from recovery_steps import lease
from recovery_steps.step import Step, StepError, api_failures, k8s_client, say_why


def verdict(failure_class: str, reason: str) -> str:
    """The one line that says why the run stops."""
    known = {c.value for c in FailureClass}
    cls = failure_class if failure_class in known else f"{failure_class} (not a known failure class)"
    return f"{lease.GIVING_UP}class {cls}: {' '.join(reason.split()) or 'no reason given'}"


def replayed(current: RunLease | None, holder: str) -> bool:
    """True when the Workflow ``holder`` has already ended once (pure).

    Its exit handler released the run lease, or another Workflow took the run since. A lease that only expired is
    still this Workflow's.
    """
    return current is not None and not lease.held_by(current, holder)


def mark_workflow(args: argparse.Namespace, line: str) -> None:
    """Label the Workflow with the class and put ``line`` first in its description (shown in the workflow list).

    The Argo UI's workflow list shows a Workflow's description under its name; Argo fills the list's MESSAGE
    column from the root node's message (v4.0.5 ``operator.go``: ``workflowMessage = node.Message``), which a DAG
    failed by a child leaves empty. ``argo resubmit`` copies both to the new Workflow, whose validate-config takes
    them off (``lease.clear_give_up_marks``). Best effort: a refusal is logged and the step gives up all the same.
    """
    from jaxrec.adapters.kube import Kube

    cls = args.failure_class if args.failure_class in {c.value for c in FailureClass} else "unknown"
    try:
        kube = Kube(k8s_client(args.k8s_host), args.namespace)
        before = lease.description(kube.get_workflow(args.workflow))
        text = line[:1024] + (f"\n\n{before}" if before else "")
        patch = {"metadata": {"labels": {FAILURE_CLASS_LABEL: cls}, "annotations": {DESCRIPTION_ANNOTATION: text}}}
        kube.patch_workflow(args.workflow, patch)
    except (StepError, *api_failures()) as e:
        print(f"give-up: the Workflow keeps no label of its class: {' '.join(str(e).split())[:200]}", file=sys.stderr)


def parser() -> argparse.ArgumentParser:
    """The step's arguments."""
    p = cli.StepArgumentParser(prog="python -m recovery_steps.give_up", description=__doc__)
    p.add_argument("--failure-class", required=True, type=cli.bounded_text(64, "--failure-class"))
    p.add_argument("--reason", required=True, type=cli.bounded_text(4096, "--reason"))
    p.add_argument("--store-root", default=None, type=cli.store_root, help="the run store's root (with --holder)")
    p.add_argument("--run-id", default=None, type=cli.run_id, help="the run id (with --holder)")
    p.add_argument("--holder", default=None, help="this workflow's uid: stop it when it had already ended once")
    p.add_argument("--workflow", default=None, type=cli.k8s_name, help="this workflow's name ({{workflow.name}})")
    p.add_argument("--namespace", default=None, type=cli.k8s_name, help="this workflow's namespace")
    p.add_argument("--k8s-host", default=None, type=cli.http_url, help="Kubernetes API URL (default: in-cluster)")
    return p


def act(args: argparse.Namespace) -> tuple[int, str]:
    """Say why the run stops (on stderr, where Argo shows it) and fail; stop this Workflow when it is a replay."""
    line = verdict(args.failure_class, args.reason)
    if args.holder:
        if not (args.store_root and args.run_id and args.workflow and args.namespace):
            raise StepError(ExitCode.CONFIGURATION, "--holder needs --store-root, --run-id, --workflow and --namespace")
        current = RunStore(args.store_root, args.run_id).read_record(RunLayout.LEASE, RunLease)
        if replayed(current, args.holder):
            lease.stop_workflow(k8s_client(args.k8s_host), args.namespace, args.workflow)
            line = f"{line}; {lease.REPLAYED}"
        else:
            mark_workflow(args, line)
    line = f"{line}; {lease.resubmit_line(args.workflow, args.namespace)}"
    print(line, file=sys.stderr)
    say_why(line)
    return 1, ""


STEP = Step("give-up", parser, act)
main = STEP.main


if __name__ == "__main__":
    sys.exit(main())

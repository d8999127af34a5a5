"""``hand-over``: continue the run in a new Workflow of the same run id before this one nests too deep.

Why (the depth Argo refuses, ``model.config.ARGO_MAX_DEPTH``) and what the continuation is: docs/DEPLOY.md. A
retried hand-over finds the continuation it created (the name is deterministic). The continuation is named in the
output ``continuation``, not in this Workflow's description: patching it would need ``workflows patch``, a right
the steps do without. Passing the run lease lets the continuation's validate-config renew it instead of waiting.
Locally the runner stands in for the API server: this step names the continuation and makes its uid, and the
runner starts it when this Workflow has ended.

Destructive acts and their evidence: none. Passing the lease (after which this Workflow's exit handler stops
nothing) comes only once the continuation exists: created, or found under its deterministic name with the label
that names this Workflow; a Workflow of that name that continues another is refused, not replaced.

Exit codes: 0 handed over; 2 configuration (the API refused: RBAC, or the name is taken by another Workflow);
69 transient (API or store unreachable, HTTP 429/5xx: Argo retries the step, outside every budget).
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxrec.adapters import cli
from jaxrec.adapters.documents import read_ledger, read_run_config
from jaxrec.adapters.kube import Kube
from jaxrec.adapters.store import AttemptRef, Contended, RunLayout, RunStore, transient_as_unavailable
from jaxrec.model.config import ConfigError, JobConfig
from jaxrec.model.contract import Backend, ExitCode
from jaxrec.model.names import (
    ARGO_GROUP,
    ARGO_VERSION,
    CONTINUES_LABEL,
    DESCRIPTION_ANNOTATION,
    RUN_ID_LABEL,
    TITLE_ANNOTATION,
    continuation_name,
)
from jaxrec.model.outputs import HandOverOutputs
from jaxrec.model.records import HandOver, Ledger, RunLease, now
from recovery_steps import lease
from recovery_steps.retry import ledger_errors, update_ledger
from recovery_steps.step import Step, StepError, api_error, api_failures, k8s_client

log = logging.getLogger(__name__)

# Spec fields a controller or a user sets on a live Workflow that the continuation must not inherit.
_LIVE_SPEC_FIELDS = ("shutdown", "suspend")
# Labels and annotations under this prefix are the controller's own (phase, completed, ...).
_CONTROLLER_PREFIX = "workflows.argoproj.io/"


@dataclass(frozen=True)
class Continuation:
    """The Workflow that carries the run on."""

    name: str
    uid: str


def ui_link(namespace: str, name: str) -> str:
    """A Markdown link to a Workflow in the Argo UI (its path is ``/workflows/<namespace>/<name>``)."""
    return f"[{name}](/workflows/{namespace}/{name})"


def continuation_manifest(own: Mapping[str, Any], name: str, run_id: str, attempt: int) -> dict[str, Any]:
    """The continuation Workflow of ``own`` (a Workflow object as the API returns it), pure.

    The spec is ``own``'s (entrypoint, templates, arguments, mutex, exit handler) without the fields that stop
    or suspend a live Workflow; the user's labels and annotations carry over, the controller's do not.
    """
    meta = own.get("metadata", {})
    namespace = meta.get("namespace", "default")
    own_name = meta.get("name", "")
    spec = copy.deepcopy(dict(own.get("spec", {})))
    for k in _LIVE_SPEC_FIELDS:
        spec.pop(k, None)
    labels = {k: v for k, v in (meta.get("labels") or {}).items() if not k.startswith(_CONTROLLER_PREFIX)}
    labels.update({RUN_ID_LABEL: run_id, CONTINUES_LABEL: own_name})
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if not k.startswith(_CONTROLLER_PREFIX)}
    annotations[TITLE_ANNOTATION] = f"{run_id} from attempt {attempt}"
    annotations[DESCRIPTION_ANNOTATION] = (
        f"Run `{run_id}` continued from attempt {attempt}; earlier attempts: {ui_link(namespace, own_name)}"
    )
    return {
        "apiVersion": f"{ARGO_GROUP}/{ARGO_VERSION}",
        "kind": "Workflow",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations},
        "spec": spec,
    }


# What a refused call needs: the Role of argo/rbac.yaml grants the workflow's ServiceAccount these verbs.
_RBAC_HINT = "; the workflow's ServiceAccount needs workflows get and create (apply argo/rbac.yaml)"


def create_on_gke(
    api_client: Any, namespace: str, own_name: str, own_uid: str, run_id: str, attempt: int
) -> Continuation:
    """Create (or find, when a retried hand-over made it already) the continuation Workflow on the cluster."""
    kube = Kube(api_client, namespace)
    name = continuation_name(run_id, attempt)
    doing = f"get workflow {own_name}"
    try:
        own = kube.get_workflow(own_name)
        if own is None:
            raise StepError(ExitCode.CONFIGURATION, f"get workflow {own_name}: not found (404) in {namespace}")
        if own.get("metadata", {}).get("uid") != own_uid:
            uid = own.get("metadata", {}).get("uid")
            raise StepError(ExitCode.CONFIGURATION, f"workflow {own_name} has uid {uid}, not {own_uid}")
        doing = f"create workflow {name}"
        made = kube.create_workflow(continuation_manifest(own, name, run_id, attempt))
        if made is None:  # a retried hand-over created it already
            doing = f"get workflow {name}"
            made = kube.get_workflow(name) or {}
            continues = (made.get("metadata", {}).get("labels") or {}).get(CONTINUES_LABEL)
            if continues != own_name:
                raise StepError(
                    ExitCode.CONFIGURATION,
                    f"workflow {name} exists and does not continue {own_name} (its {CONTINUES_LABEL} is "
                    f"{continues!r}): delete it (argo delete {name}) and retry this step",
                )
            log.info("continuation %s already exists (a retried hand-over)", name)
    except api_failures() as e:
        raise api_error(e, doing=doing, refused_hint=_RBAC_HINT) from None
    return Continuation(made["metadata"]["name"], made["metadata"]["uid"])


LEASE_TRIES = 5
"""Conditional writes ``pass_lease`` tries before it gives up (the store stayed contended: transient)."""


def pass_lease(
    store: RunStore,
    own_uid: str,
    to: Continuation,
    ttl_s: float,
    *,
    first_attempt: int,
    clock: Callable[[], float] = now,
) -> RunLease:
    """Give the run lease from ``own_uid`` to the continuation (idempotent: already given is fine).

    The continuation's lease keeps this one's namespace and cluster, so a later submission can still tell
    whether the continuation's Workflow is alive, and names ``first_attempt``, the attempt it starts with: a
    confirmed holder, so its exit handler records the run's end and deletes the run's JobSets (every one with the
    run's label, whichever attempt made it, as ``finalize.stop_gang`` does).

    Raises:
        StepError: another workflow holds the run, or the lease was released.
    """

    def give(current: RunLease | None) -> RunLease:
        if current is not None and current.holder == to.uid and not current.released:
            return current
        if current is not None and (current.holder != own_uid or current.released):
            raise StepError(
                ExitCode.CONFIGURATION,
                f"this workflow no longer holds run {store.run_id!r} (holder {current.holder_name}, released "
                f"{current.released}); the continuation {to.name} will wait for the lease",
            )
        t = clock()
        # The continuation runs where this Workflow runs (same namespace, same cluster).
        return RunLease(
            run_id=store.run_id,
            holder=to.uid,
            holder_name=to.name,
            ttl_s=ttl_s,
            acquired_at=t,
            renewed_at=t,
            namespace=current.namespace if current else None,
            cluster=current.cluster if current else None,
            first_attempt=first_attempt,
        )

    try:
        return store.update_record(RunLayout.LEASE, RunLease, give, tries=LEASE_TRIES)
    except Contended as e:
        raise StepError(ExitCode.TRANSIENT, str(e)) from None


def record(store: RunStore, entry: HandOver) -> Ledger:
    """Append ``entry`` to the ledger's hand-overs (once: a retried step does not add it twice)."""

    def add(led: Ledger) -> Ledger:
        if any(h.to_workflow == entry.to_workflow and h.from_uid == entry.from_uid for h in led.hand_overs):
            return led
        return led.model_copy(update={"hand_overs": [*led.hand_overs, entry]})

    return update_ledger(store, add)


def run(
    ref: AttemptRef,
    own: lease.Claimant,
    output_dir: Path | None = None,
    *,
    api_client: Any = None,
    clock: Callable[[], float] = now,
) -> Continuation:
    """Hand the run over from this Workflow (``own``: its uid and name) to its continuation, from ``ref.attempt``.

    Raises:
        StepError: with the exit code and the one line to print.
        StoreUnavailable: the run store is unreachable (transient).
    """
    store = ref.store()
    run_id, attempt, workflow, workflow_uid = ref.run_id, ref.attempt, own.name, own.uid
    with (
        ledger_errors(store, ExitCode.CONFIGURATION),
        transient_as_unavailable(store.url()),
    ):
        try:
            cfg: JobConfig = read_run_config(store)
        except ConfigError as e:
            problems = "; ".join(e.problems)
            raise StepError(ExitCode.CONFIGURATION, f"the run's config is not valid: {problems}") from None
        read_ledger(store)  # a damaged ledger is refused before a continuation is created
        to = create_on_gke(api_client or k8s_client(None), cfg.namespace, workflow, workflow_uid, run_id, attempt)
        pass_lease(store, workflow_uid, to, cfg.retry.lease_ttl_s, first_attempt=attempt, clock=clock)
        record(
            store,
            HandOver(
                from_workflow=workflow,
                from_uid=workflow_uid,
                to_workflow=to.name,
                to_uid=to.uid,
                next_attempt=attempt,
                at=clock(),
                backend=Backend.of(cfg.slice),
            ),
        )
    if output_dir is not None:
        HandOverOutputs(continuation=to.name, continuation_uid=to.uid).write(Path(output_dir))
    return to


def parser() -> argparse.ArgumentParser:
    """The step's arguments."""
    p = cli.StepArgumentParser(prog="python -m recovery_steps.hand_over", description=__doc__.split("\n")[0])
    p.add_argument("--store-root", required=True, type=cli.store_root)
    p.add_argument("--run-id", required=True, type=cli.run_id)
    p.add_argument("--attempt", required=True, type=cli.attempt, help="the attempt the continuation starts with")
    p.add_argument("--workflow", required=True, type=cli.k8s_name, help="this Workflow's name ({{workflow.name}})")
    p.add_argument(
        "--workflow-uid",
        required=True,
        type=cli.bounded_text(64, "--workflow-uid"),
        help="this Workflow's uid ({{workflow.uid}}): the run lease's holder",
    )
    p.add_argument("--output-dir", type=cli.output_dir, default=None)
    return p


def act(args: argparse.Namespace) -> tuple[int, str]:
    """Hand the run over; the line naming the continuation."""
    try:
        to = run(AttemptRef.of(args), lease.Claimant(args.workflow_uid, args.workflow), args.output_dir)
    except lease.LeaseHeld as e:
        raise StepError(ExitCode.CONFIGURATION, str(e)) from None
    return 0, f"run {args.run_id}: attempt {args.attempt} continues in workflow {to.name} (uid {to.uid})"


# A run store that cannot be reached for good (not transient) ends the step with 1.
STEP = Step("hand-over", parser, act, HandOverOutputs, store_code=1)
main = STEP.main


if __name__ == "__main__":
    sys.exit(main())

"""``validate-config``: validate a job config once, pin it in the run store, and check it against the run's past.

Arguments and outputs: docs/CONTRACTS.md. ``--offline`` validates the config alone and touches no store (outputs
without ``first-attempt``). With ``--preflight true`` (the workflow's template) it first checks the permissions and
cluster objects the run needs (``recovery_steps.preflight``), before any slice is provisioned; with ``--holder`` it
takes the run lease (``recovery_steps.lease``) for that workflow.

Destructive acts and their evidence: none of its own. It replaces ``config.json`` only under the generation it read
(the replaced one is kept as ``config.<hash>.json``), and it takes the run lease only after the config compared
clean, so a refused submission never holds the run and its exit handler deletes nothing. A read that failed is
never a negative answer: an open attempt whose JobSet cannot be read ends the step 69 (retried), never "not running".
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxrec.adapters import cli
from jaxrec.adapters.documents import read_ledger
from jaxrec.adapters.kube import Kube
from jaxrec.adapters.store import (
    DocumentError,
    PreconditionFailed,
    RunLayout,
    RunStore,
    first_line,
    store_errors,
    transient_as_unavailable,
)
from jaxrec.adapters.verify import manifest_compat_problems, read_manifest
from jaxrec.model.compat import diff_configs, is_safe, rule_for
from jaxrec.model.config import ConfigError, JobConfig, load_config, run_id_pod_name_problem
from jaxrec.model.contract import ExitCode
from jaxrec.model.outputs import ValidateOutputs
from jaxrec.model.records import RunConfigDocument
from recovery_steps.attempts import left_open
from recovery_steps.step import Step, StepError, api_error, api_failures, k8s_client

log = logging.getLogger(__name__)


@dataclass
class ValidateResult:
    """What ``run`` decided: the exit code, the lines a user reads, and the outputs on success."""

    code: ExitCode
    messages: list[str] = field(default_factory=list)
    outputs: ValidateOutputs | None = None


def previous_config_path(config_hash: str) -> str:
    """Where a replaced ``config.json`` is kept."""
    return f"config.{config_hash}.json"


def latest_manifest_step(store: RunStore) -> tuple[int, Any] | None:
    """The newest step directory with a readable manifest, and the manifest (None when there is none)."""
    for step in reversed(store.checkpoint_steps()):
        manifest, _ = read_manifest(store, str(step), step, store.run_id)
        if manifest is not None:
            return step, manifest
    return None


def next_attempt(store: RunStore) -> int:
    """The first attempt number of a (re)submitted workflow: one past every attempt the run has seen.

    A workflow resubmitted under the same run id continues the numbering, so its attempts never
    overwrite earlier records or reset the budgets kept in the ledger.
    """
    seen = store.attempts()
    ledger = read_ledger(store)
    seen += [a.attempt for a in ledger.attempts] if ledger is not None else []
    return max(seen) + 1 if seen else 0


def first_attempt_of(store: RunStore, gang_running: Callable[[int], bool] | None) -> tuple[int, list[str]]:
    """The submission's first attempt, and the line saying so when it continues one a lost Workflow left running.

    ``next_attempt``, or the newest attempt when its gang still runs and nothing decided or closed it.
    """
    n = next_attempt(store)
    last = n - 1
    if gang_running is None or last < 0 or not left_open(store, last) or not gang_running(last):
        return n, []
    return last, [
        f"attempt {last} of run {store.run_id} is still training and nothing decided or closed it (its "
        f"Workflow was deleted): continuing at attempt {last}, its gang kept"
    ]


def _check_change(old: dict[str, Any], new: dict[str, Any], accept_safe: bool) -> tuple[bool, list[str]]:
    changes = diff_configs(old, new)
    lines = []
    for c in changes:
        rule = rule_for(c.path)
        lines.append(f"  {c.render()}  [{'safe' if rule.safe else 'incompatible'}: {rule.reason}]")
    all_safe = all(is_safe(c) for c in changes)
    if accept_safe and all_safe:
        return True, ["accepting safe changes to the run's config:", *lines]
    head = "the config differs from the one this run was started with:"
    if all_safe:
        tail = "every change is safe for the checkpoints: rerun with --accept-safe-changes to accept them"
    else:
        tail = "some changes are incompatible with the run's checkpoints: revert them, or start a new run id"
    return False, [head, *lines, tail]


def run(
    cfg: JobConfig,
    store: RunStore,
    *,
    accept_safe_changes: bool = False,
    gang_running: Callable[[int], bool] | None = None,
    dry_run: bool = False,
) -> ValidateResult:
    """Check ``cfg`` against the run's stored config and latest checkpoint, then pin it in the store.

    Args:
        cfg: The validated config.
        store: The run store of ``cfg.run_id`` (possibly at an overridden root).
        accept_safe_changes: Accept a changed config when every change is safe per the compatibility table.
        gang_running: Whether attempt n's JobSet still runs (on a cluster; None: nothing can tell). A resubmission
            continues at the newest attempt when its gang runs and nothing decided or closed it (its Workflow was
            deleted): train-segment re-attaches to the gang, no step is lost. It raises ``StepError`` when it
            cannot tell (an unreadable API is never "not running").
        dry_run: Compare only: every check, nothing written (a submission compares before it takes the run lease).

    Returns:
        0 with the outputs, 2 when the config differs from the run's (and may not be accepted) or when a
        resubmission's attempt numbers make the run id too long for its pod names, 3 when the latest checkpoint
        is incompatible with it.
    """
    new = cfg.model_dump(mode="json")
    new_hash = cfg.config_hash()
    doc = RunConfigDocument(config=new, hash=new_hash)
    try:
        stored, generation = store.read_record_versioned(RunLayout.CONFIG, RunConfigDocument)
        first_attempt, messages = first_attempt_of(store, gang_running)
    except DocumentError as e:
        return ValidateResult(
            ExitCode.CONFIGURATION, [f"{e}; or restore it from the run's history, or start a new run id"]
        )
    # A resubmission continues the attempt numbering: its first attempt may need more digits than the policy's.
    problem = run_id_pod_name_problem(cfg, first_attempt)
    if problem:
        return ValidateResult(ExitCode.CONFIGURATION, [problem])
    replace_old: RunConfigDocument | None = None
    if stored is not None and stored.hash != new_hash:
        ok, lines = _check_change(stored.config, new, accept_safe_changes)
        if not ok:
            return ValidateResult(ExitCode.CONFIGURATION, [f"run {cfg.run_id!r} ({store.url()}):", *lines])
        messages += lines
        replace_old = stored

    latest = latest_manifest_step(store)
    if latest is not None:
        step, manifest = latest
        problems = manifest_compat_problems(manifest, new, cfg.slice.num_hosts)
        if problems:
            lines = [f"the latest checkpoint (step {step}) is incompatible with this config:"]
            lines += [f"  {p}" for p in problems]
            lines.append("revert these fields, or start a new run id")
            return ValidateResult(ExitCode.INCOMPATIBLE_CHECKPOINT, messages + lines)
    outputs = ValidateOutputs(
        run_id=cfg.run_id,
        # Absolute for a local root: later steps may run from another working directory.
        store_root=store.root if store.is_gcs else str(Path(store.root).resolve()),
        config_hash=new_hash,
        hosts=cfg.slice.num_hosts,
        first_attempt=first_attempt,
    )
    refused = None if dry_run else _write_config(store, doc, stored, generation, replace_old)
    if refused is not None:
        return ValidateResult(ExitCode.CONFIGURATION, [*messages, refused])
    return ValidateResult(ExitCode.OK, messages, outputs)


def _write_config(
    store: RunStore,
    doc: RunConfigDocument,
    stored: RunConfigDocument | None,
    generation: int | None,
    replace_old: RunConfigDocument | None,
) -> str | None:
    """Pin the config under the generation read; the line saying why not (None: pinned)."""
    try:
        if replace_old is not None:
            store.write_record(previous_config_path(replace_old.hash), replace_old)
            store.write_record(RunLayout.CONFIG, doc, if_generation_match=generation, idempotent=True)
        elif stored is None:
            store.write_record(RunLayout.CONFIG, doc, if_generation_match=0, idempotent=True)
        else:
            # The same config, pinned again under the generation read: when another validate-config replaced it
            # meanwhile, one of the two writes fails, so two different configs never both succeed. The pinned
            # document is a state (idempotent): the same bytes there, a try whose answer was lost, are done.
            store.write_record(RunLayout.CONFIG, stored, if_generation_match=generation, idempotent=True)
    except PreconditionFailed:
        return f"{store.url(RunLayout.CONFIG)} changed while being validated; run validate-config again"
    return None


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "yes", "1"):
        return True
    if value in ("false", "no", "0", ""):
        return False
    raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a boolean; use true or false")


def offline_outputs(cfg: JobConfig, store_root: str) -> dict[str, str]:
    """The outputs that follow from the config alone (no ``first-attempt``: that needs the store)."""
    local = not store_root.startswith("gs://")
    return {
        "run-id": cfg.run_id,
        "store-root": str(Path(store_root).resolve()) if local else store_root,
        "config-hash": cfg.config_hash(),
        "hosts": str(cfg.slice.num_hosts),
    }


def parser() -> argparse.ArgumentParser:
    """The step's arguments."""
    p = cli.StepArgumentParser(prog="python -m recovery_steps.validate_config", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, type=cli.bounded_text(cli.PATH_MAX, "--config"), help="the job config")
    p.add_argument(
        "--store-root", type=cli.store_root, help="override the config's storage.root (gs://bucket/prefix or a dir)"
    )
    p.add_argument(
        "--run-id",
        type=cli.run_id,
        help="override the config's run_id (the workflow passes its run-id parameter: `argo submit -p run-id=...`)",
    )
    p.add_argument(
        "--accept-safe-changes",
        nargs="?",
        const="true",
        default="false",
        type=_flag,
        metavar="true|false",
        help="accept config changes the checkpoints survive (a bare flag means true)",
    )
    p.add_argument("--offline", action="store_true", help="validate the config only; read and write no store")
    p.add_argument(
        "--preflight",
        default="false",
        type=_flag,
        metavar="true|false",
        help="check the store's and the cluster's permissions first (the workflow sets it)",
    )
    p.add_argument("--holder", default=None, help="take the run lease for this workflow uid ({{workflow.uid}})")
    p.add_argument("--holder-name", default=None, help="the workflow's name ({{workflow.name}})")
    p.add_argument("--k8s-host", default=None, help="Kubernetes API URL for the preflight (default: in-cluster)")
    p.add_argument("--output-dir", type=cli.output_dir, help="one file per output parameter")
    return p


def act(args: argparse.Namespace) -> tuple[int, str]:
    """Validate the config; pin it in the run store unless offline; the line saying it is valid."""
    if args.output_dir is None and not args.offline:
        raise StepError(ExitCode.CONFIGURATION, "--output-dir is required (unless --offline) (see --help)")
    # An invalid config is this step's verdict, not its failure: its problems are printed as they are found.
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(e.render(), file=sys.stderr)
        return int(ExitCode.CONFIGURATION), ""
    if args.run_id:  # every other step and the workers use the workflow's run-id: the pinned config says the same
        cfg = cfg.model_copy(update={"run_id": args.run_id})
    # Refused before any store or cluster is touched: JobSet's webhook would refuse the attempt's JobSet (422).
    problem = run_id_pod_name_problem(cfg)
    if problem:
        print(f"invalid config {args.config}: {problem}", file=sys.stderr)
        return int(ExitCode.CONFIGURATION), ""
    root = args.store_root or cfg.storage.root
    r = ValidateResult(ExitCode.OK, []) if args.offline else _pin(args, cfg, RunStore(root, cfg.run_id))
    for line in r.messages:
        print(line, file=sys.stderr)
    if r.code != ExitCode.OK:
        return int(r.code), ""
    if not args.offline:
        r.outputs.write(args.output_dir)
    elif args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        for name, value in offline_outputs(cfg, root).items():
            (args.output_dir / name).write_text(value)
    where = "offline, no store read" if args.offline else "pinned in the run store"
    return 0, f"config {cfg.config_hash()[:12]} of run {cfg.run_id} is valid ({cfg.slice.num_hosts} hosts, {where})"


def _pin(args: argparse.Namespace, cfg: JobConfig, store: RunStore) -> ValidateResult:
    """The preflight (when asked), the run lease (with ``--holder``), then ``run`` against the run store."""
    if args.preflight:
        code = _preflight(cfg, store, args.k8s_host)
        if code != ExitCode.OK:
            return ValidateResult(code, [])
    try:
        with transient_as_unavailable(store.url()):
            if args.holder:
                return _pin_as_holder(args, cfg, store)
            return run(cfg, store, accept_safe_changes=args.accept_safe_changes)
    except store_errors() as e:
        line = cli.store_error_line("validate-config", store.url(), e).removeprefix("validate-config: ")
        raise StepError(1, f"{line}; or validate the config alone with --offline") from None


def _pin_as_holder(args: argparse.Namespace, cfg: JobConfig, store: RunStore) -> ValidateResult:
    """Compare, take the run lease, pin, confirm the lease: a submission that refuses never holds the run.

    Destructive acts: none here, but the lease it confirms lets its exit handler delete the JobSets of attempts
    from its first attempt on. So the lease is taken only after the config compared clean (a refused resubmission's
    exit handler then finds another holder or none, and deletes nothing), released again when pinning refuses
    after all, and confirmed with the first attempt only once the config is pinned.
    """
    from recovery_steps import lease

    site, alive, gang_running = _holder_check(cfg, args.k8s_host)
    accept = args.accept_safe_changes
    compared = run(cfg, store, accept_safe_changes=accept, gang_running=gang_running, dry_run=True)
    if compared.code != ExitCode.OK:
        return compared
    claimant = lease.Claimant(args.holder, args.holder_name or args.holder, site)
    try:
        lease.acquire(store, claimant, cfg.retry.lease_ttl_s, is_alive=alive)
    except lease.LeaseHeld as e:
        return ValidateResult(ExitCode.CONFIGURATION, [f"configuration: {e}"])
    # Only a holder of the run may adopt what a lost Workflow left running.
    r = run(cfg, store, accept_safe_changes=accept, gang_running=gang_running)
    if r.code != ExitCode.OK:
        lease.release(store, args.holder)  # the run changed meanwhile: left as it was, to whoever acts for it
        return r
    try:
        lease.confirm(store, args.holder, r.outputs.first_attempt)
    except lease.LeaseHeld as e:
        return ValidateResult(ExitCode.CONFIGURATION, [f"configuration: {e}"])
    if args.holder_name:
        _clear_give_up_marks(cfg, args.holder_name, args.k8s_host)
    return r


def _clear_give_up_marks(cfg: JobConfig, workflow: str, k8s_host: str | None) -> None:
    """Take the give-up's label and line that ``argo resubmit`` copied to this Workflow off again.

    Best effort: a refusal is logged and the run goes on.
    """
    from recovery_steps.lease import clear_give_up_marks

    try:
        if clear_give_up_marks(Kube(k8s_client(k8s_host), cfg.namespace), workflow):
            print(f"validate-config: took the give-up's label and line of the resubmitted run off {workflow}")
    except (StepError, *api_failures()) as e:
        print(f"validate-config: {workflow} keeps a give-up's label: {first_line(e)}", file=sys.stderr)


STEP = Step("validate-config", parser, act, ValidateOutputs)
main = STEP.main


def _holder_check(cfg: JobConfig, k8s_host: str | None):
    """Where this workflow runs, and two questions to the cluster (None: it cannot be asked).

    Whether another lease holder's Workflow is alive (else the TTL decides), and whether an attempt's gang runs.
    """
    from recovery_steps import lease

    try:
        api_client = k8s_client(k8s_host)
    except Exception as e:  # noqa: BLE001 - no client: the TTL decides the lease; no gang is known not to run
        return lease.Site(namespace=cfg.namespace), None, _cannot_tell(f"no Kubernetes API client ({first_line(e)})")
    return *lease.on_gke(api_client, cfg.namespace), _gang_running(api_client, cfg)


def _cannot_tell(why: str) -> Callable[[int], bool]:
    """``gang_running`` where the cluster cannot be asked: an open attempt's gang may run, so the step is retried."""

    def running(attempt: int) -> bool:
        raise StepError(
            ExitCode.TRANSIENT,
            f"attempt {attempt} was left open and whether its gang still trains cannot be read: {why}; Argo retries "
            "this step (nothing was taken or deleted)",
        )

    return running


def _gang_running(api_client: Any, cfg: JobConfig) -> Callable[[int], bool]:
    """Whether the JobSet of attempt n exists and has not finished (404: it does not).

    Any other failure raises ``StepError`` (69 for 429, 5xx and no answer; 2 for a refusal such as 403): a read that
    failed is not "not running", or the numbering would move past a live gang that the next provision-slice then
    refuses to delete and the run stops.
    """
    from jaxrec.model.names import jobset_name
    from jaxrec.model.snapshot import jobset_from_api

    def running(attempt: int) -> bool:
        name = jobset_name(cfg.run_id, attempt)
        try:
            obj = Kube(api_client, cfg.namespace).get_jobset(name)
        except Exception as e:  # noqa: BLE001 - every failure is mapped to its exit code
            doing = f"cannot read JobSet {name} of open attempt {attempt}"
            raise api_error(e, doing=doing, transient_hint="; Argo retries this step") from None
        return obj is not None and not jobset_from_api(obj).finished

    return running


def _preflight(cfg: JobConfig, store: RunStore, k8s_host: str | None) -> ExitCode:
    """Run the preflight; print one line per problem; the exit code it calls for."""
    from recovery_steps import preflight

    try:
        problems = preflight.run(cfg, store, k8s_host=k8s_host)
    except preflight.PreflightUnreachable as e:
        print(f"preflight: {e}; retry later", file=sys.stderr)
        return ExitCode.TRANSIENT
    for problem in problems:
        print(f"configuration: {problem.line()}", file=sys.stderr)
    return preflight.exit_code(problems)


if __name__ == "__main__":
    sys.exit(main())

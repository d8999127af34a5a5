"""Pure decisions of the trainer: worker identity, start-up checks, faults, exit codes, compatibility."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from jaxrec.model.compat import check_compatible
from jaxrec.model.config import JobConfig
from jaxrec.model.contract import PEER_LOSS_MARKERS, ExitCode
from jaxrec.model.records import STARTUP_MARGIN, CheckpointManifest
from jaxrec.model.tpu import TPU_TYPES

FAULT_KINDS = ("app-bug", "nan", "hang", "kill-during-save", "native-crash")
"""``native-crash@0`` dies by SIGSEGV in the start-up (the runtime's initialisation), ``@N`` before step N."""


class TrainerExit(Exception):
    """A decided exit: the worker writes its report and leaves with ``code``."""

    def __init__(self, code: ExitCode, message: str):
        self.code = code
        super().__init__(message)


@dataclass(frozen=True)
class LocalIdentity:
    """How a local worker joins the gang (from the environment the local runner sets)."""

    coordinator_address: str
    process_id: int
    num_processes: int


def local_identity(env: Mapping[str, str]) -> LocalIdentity:
    """Read the CPU slice's identity variables; raise TrainerExit(2) naming each missing one."""
    problems = []
    addr = env.get("TRAINER_COORDINATOR_ADDRESS", "")
    if not addr:
        problems.append("TRAINER_COORDINATOR_ADDRESS: not set; set it to 127.0.0.1:PORT of process 0")
    ints = {}
    for name, hint in (
        ("JOB_COMPLETION_INDEX", "this worker's index 0..N-1"),
        ("TRAINER_NUM_PROCESSES", "the number of worker processes N"),
    ):
        raw = env.get(name, "")
        try:
            ints[name] = int(raw)
        except ValueError:
            problems.append(f"{name}: {raw!r} is not an integer; set it to {hint}")
    if not problems and not 0 <= ints["JOB_COMPLETION_INDEX"] < ints["TRAINER_NUM_PROCESSES"]:
        problems.append(
            f"JOB_COMPLETION_INDEX: {ints['JOB_COMPLETION_INDEX']} is outside 0..{ints['TRAINER_NUM_PROCESSES'] - 1}"
        )
    if problems:
        raise TrainerExit(ExitCode.CONFIGURATION, "; ".join(problems))
    return LocalIdentity(addr, ints["JOB_COMPLETION_INDEX"], ints["TRAINER_NUM_PROCESSES"])


# JAX's coordinator port on Cloud TPU (jax._src.clusters.cloud_tpu_cluster.coordinator_port), unless
# JAX_COORDINATOR_PORT overrides it as it does for jax.distributed.initialize's own detection.
TPU_COORDINATOR_PORT = "8482"


def coordinator_to_wait_for(env: Mapping[str, str], local: LocalIdentity | None) -> str | None:
    """The ``host:port`` of the coordination service this process should see listening before it joins.

    Process 0 hosts the service; every other process that calls ``jax.distributed.initialize`` before the
    service listens has its first connection refused, and gRPC retries only after its initial reconnect
    backoff (1 s, growing by 1.6 each time; grpc doc/connection-backoff.md). Waiting for the listener
    with a fine poll instead joins within a poll of process 0 being ready. ``None``: this process is the
    coordinator, or the address is not known before JAX detects it.

    Local gangs pass their identity; on GKE the TPU webhook's ``TPU_WORKER_ID`` and ``TPU_WORKER_HOSTNAMES``
    (or ``MEGASCALE_COORDINATOR_ADDRESS`` on multislice) name it as JAX's cloud-TPU detection reads them.
    """
    if local is not None:
        return None if local.process_id == 0 else local.coordinator_address
    worker = env.get("TPU_WORKER_ID", "").strip()
    explicit = env.get("JAX_COORDINATOR_ADDRESS", "").strip()  # JAX joins this one before any detection
    hosts = [h.strip() for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    megascale = env.get("MEGASCALE_COORDINATOR_ADDRESS", "").strip()
    slice_id = env.get("MEGASCALE_SLICE_ID", "0").strip() or "0"
    if not worker.isdigit() or not (hosts or megascale or explicit):
        return None
    if int(worker) == 0 and slice_id == "0":
        return None
    if explicit:
        return explicit
    host = (megascale or hosts[0]).split(":")[0]
    return f"{host}:{env.get('JAX_COORDINATOR_PORT') or TPU_COORDINATOR_PORT}"


def topology_problems(
    cfg: JobConfig, *, process_count: int, local_devices: int, global_devices: int, platform: str
) -> list[str]:
    """Compare what jax.distributed sees with the config; one line per mismatch (empty: all agree)."""
    s = cfg.slice
    out = []
    if process_count != s.num_hosts:
        out.append(
            f"slice.hosts: the config expects {s.num_hosts} processes but jax.distributed has {process_count}; "
            "start one worker per host or fix the slice shape"
        )
    if local_devices != s.devices_per_process:
        out.append(
            f"slice.devices_per_host: the config expects {s.devices_per_process} devices per process but this "
            f"process sees {local_devices}"
        )
    expected_global = s.num_hosts * s.devices_per_process
    if global_devices != expected_global:
        out.append(f"slice: the config expects {expected_global} devices in all but the job has {global_devices}")
    if s.is_cpu:
        if s.local_devices == "cpu" and platform != "cpu":
            out.append(f"slice.accelerator: 'local' runs on the CPU, but the JAX platform is {platform!r}")
        elif s.local_devices == "accelerator" and platform == "cpu":
            out.append(
                "slice.local_devices: 'accelerator', but JAX finds no accelerator on this machine (only the CPU); "
                "set local_devices: cpu"
            )
    else:
        if platform != "tpu":
            out.append(f"slice.accelerator: {s.accelerator} needs TPU devices, but the JAX platform is {platform!r}")
        chips = TPU_TYPES[s.accelerator].chips(s.topology or "")
        if chips != global_devices:
            out.append(f"slice.topology: {s.topology} has {chips} chips but the job has {global_devices} devices")
    return out


@dataclass(frozen=True)
class Faults:
    """Faults a rehearsal asks the worker to inject: kind -> step."""

    at: dict[str, int] = field(default_factory=dict)

    def due(self, kind: str, step: int) -> bool:
        """True when fault ``kind`` is set for ``step``."""
        return self.at.get(kind) == step


def parse_faults(text: str | None) -> Faults:
    """Parse ``TRAINER_FAULT`` (``KIND@STEP[,KIND@STEP...]``); raise TrainerExit(2) on a bad entry."""
    at: dict[str, int] = {}
    problems = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        kind, sep, step = part.partition("@")
        if kind not in FAULT_KINDS or not sep or not step.isdigit():
            problems.append(
                f"TRAINER_FAULT: {part!r} is not KIND@STEP with KIND one of {', '.join(FAULT_KINDS)} and STEP >= 0"
            )
            continue
        at[kind] = int(step)
    if problems:
        raise TrainerExit(ExitCode.CONFIGURATION, "; ".join(problems))
    return Faults(at)


# What libtpu says when another program holds this host's TPU chips (its lock file); the holder lets them go
# when it ends, so a start-up that meets it is transient, not a broken accelerator.
LIBTPU_HELD_MARKERS = ("libtpu multi-process lockfile", "tpu in use", "the tpu is already in use")


def exit_code_for(exc: BaseException, *, during_init: bool = False) -> ExitCode:
    """An exception's contract code: its own if decided; at start-up 69 (chips held) or 22; later 20 (peer) or 42."""
    if isinstance(exc, TrainerExit):
        return exc.code
    text = f"{type(exc).__name__}: {exc}".lower()
    cause = exc.__cause__ or exc.__context__
    if cause is not None:
        text += f" {type(cause).__name__}: {cause}".lower()
    if during_init:
        return ExitCode.TRANSIENT if any(m in text for m in LIBTPU_HELD_MARKERS) else ExitCode.ACCELERATOR_INIT
    if any(m in text for m in PEER_LOSS_MARKERS):
        return ExitCode.PEER_LOST
    return ExitCode.APPLICATION


def bucket_check_exit(exc: BaseException, cfg: JobConfig, bucket: str) -> TrainerExit | None:
    """The exit a failed read of the run bucket's metadata calls for at start, or None to go on (docs/TRAINER.md).

    Refused or absent is configuration: the attempt could never checkpoint. A transient failure
    (``store.is_transient``) is not: the store's own retries decide later. Neither is anything that is not a store
    error (the check must not turn a bug of its own into a verdict).
    """
    from google.api_core import exceptions

    from jaxrec.adapters.iam import ROLE_FOR_PERMISSION, permission_from_403, workload_principal
    from jaxrec.adapters.store import first_line, is_transient, store_errors

    if not isinstance(exc, store_errors()) or is_transient(exc):
        return None
    ksa = f"{cfg.namespace}/{cfg.worker_service_account}"
    if isinstance(exc, exceptions.Forbidden):
        perm = permission_from_403(exc.message, "storage.buckets.get")
        role = ROLE_FOR_PERMISSION.get(perm, "roles/storage.objectUser")
        return TrainerExit(
            ExitCode.CONFIGURATION,
            f"the workers' ServiceAccount {ksa} lacks {perm} on gs://{bucket} (orbax reads the bucket's metadata; "
            f"roles/storage.objectUser does not grant it); fix: gcloud storage buckets add-iam-policy-binding "
            f"gs://{bucket} --role={role} --member={workload_principal(cfg, cfg.worker_service_account)}",
        )
    return TrainerExit(
        ExitCode.CONFIGURATION,
        f"the workers' ServiceAccount {ksa} cannot read the metadata of gs://{bucket} ({type(exc).__name__}: "
        f"{first_line(exc)[:200]}); check that the bucket exists and that the workers have Google credentials "
        "(Workload Identity)",
    )


def first_step_grace(configured_s: float, earlier_s: Sequence[float]) -> float:
    """The watchdog's grace before the first step.

    The configured one, or ``STARTUP_MARGIN`` times the longest of ``earlier_s`` (this run's earlier start-ups)
    when that is longer: a restore or compilation as long as one the run already went through is not a hang.
    """
    return max(configured_s, STARTUP_MARGIN * max(earlier_s, default=0.0))


def watchdog_limit(
    hang_timeout_s: float, compile_grace_s: float, first_step_done: bool, save_timeout_s: float | None = None
) -> float:
    """Seconds without progress after which the worker is hung (``save_timeout_s``: while the loop waits for a save)."""
    limit = hang_timeout_s if first_step_done else hang_timeout_s + compile_grace_s
    return limit if save_timeout_s is None else max(limit, save_timeout_s)


class SaveReason(StrEnum):
    """Why a step is saved (``NONE``: it is not)."""

    NONE = "none"
    INTERVAL = "interval"
    PREEMPTION = "preemption"
    FINAL = "final"


def save_decision(
    step: int, *, interval_steps: int, total_steps: int, stop_agreed: bool, last_saved: int | None
) -> SaveReason:
    """Whether to save after ``step`` completed, and why.

    A stop every process agreed on saves the step it stopped at (a graceful exit loses no step);
    the last step is always saved; otherwise every ``interval_steps``. A step already saved (the
    restored one) is never saved again. Preemption and final saves are waited for before exiting.
    """
    if step == last_saved:
        return SaveReason.NONE
    if stop_agreed:
        return SaveReason.PREEMPTION
    if step >= total_steps:
        return SaveReason.FINAL
    if step % interval_steps == 0:
        return SaveReason.INTERVAL
    return SaveReason.NONE


def compatibility_problems(
    saved_config: Mapping[str, Any], saved_process_count: int, cfg: JobConfig, process_count: int
) -> list[str]:
    """Why a checkpoint written under ``saved_config`` cannot be restored under ``cfg`` (empty: it can).

    The config difference is judged by the shared compatibility table (``jaxrec.model.compat``);
    the process count that wrote the checkpoint must also equal the gang's (the per-process data
    state and bit-exact resume depend on it).
    """
    out = [p.render() for p in check_compatible(saved_config, cfg.model_dump(mode="json"))]
    if saved_process_count != process_count:
        out.append(
            f"process_count: checkpoint was written by {saved_process_count} processes, this gang has {process_count}"
        )
    return out


def fsdp_axis(shape: tuple[int, ...], n: int) -> int | None:
    """The dimension of a parameter to shard over ``n`` devices: the largest one divisible by ``n``."""
    if n <= 1 or not shape or math.prod(shape) < n:
        return None
    return max((i for i, d in enumerate(shape) if d % n == 0 and d >= n), key=lambda i: shape[i], default=None)


def task_problems(
    saved: CheckpointManifest, task_name: str, task_version: str, dataset_version: str, resume_mode: str
) -> list[str]:
    """Why a checkpoint's task or data does not fit the task and data in use now (empty: it fits).

    The config diff already covers ``task.name`` and ``task.options``; this adds what only the
    running code knows: the task's declared version, and the dataset's version (for record files,
    the fingerprint of the files found now). Changed data is refused under ``exact`` (the saved
    position would point into other data) and accepted under ``reshuffle`` (a new order starts).
    """
    out = []
    if saved.task_name != task_name:
        out.append(f"task: checkpoint of task {saved.task_name!r}, this run trains {task_name!r}")
    elif saved.task_version != task_version:
        out.append(
            f"task version: {saved.task_version!r} -> {task_version!r} (incompatible: the task declared a change "
            "of its state; start a new run id, or run the task version that wrote the checkpoint)"
        )
    if saved.dataset_version != dataset_version and resume_mode == "exact":
        out.append(
            f"data: dataset version {saved.dataset_version!r} -> {dataset_version!r} (the files changed since the "
            "checkpoint): restore the files, or set data.resume_mode: reshuffle to start a new order over them"
        )
    return out


# --- the save on SIGTERM ---------------------------------------------------------------------------

EXIT_MARGIN_S = 1.0
"""Seconds of the shutdown window kept for leaving after the save: the exit report (one small document),
closing the checkpoint manager and JAX's distributed shutdown barrier, which every process reaches
together (measured locally under load: 0.05 s from the last commit to the exit). A save is budgeted
on the window minus this."""

SAVE_SAFETY_FACTOR = 1.5
"""A save is started only when its estimate times this fits the budget left: a save's duration varies
with the store's latency and the host's load, and a save cut by the kill is lost work and a lost exit
report, while a skipped one costs only the steps since the last checkpoint."""

_STOP_FLAG_MAX = 2**31 - 1


def stop_flag(sigterm_age_s: float | None) -> int:
    """The stop flag of a process for the next step: 0, or 1 + milliseconds since its SIGTERM.

    The step reduces the flags with a max, so every process learns, with the agreement itself, how long
    ago the gang's first SIGTERM arrived (each process measures on its own clock: no clocks are compared).
    """
    if sigterm_age_s is None:
        return 0
    return min(1 + max(0, int(sigterm_age_s * 1000)), _STOP_FLAG_MAX)


def sigterm_age(flag: int) -> float | None:
    """Seconds since the gang's first SIGTERM, read from a reduced stop flag (None: no stop)."""
    return None if flag <= 0 else (flag - 1) / 1000


class PreemptionAction(StrEnum):
    """What the gang does with its state once a SIGTERM stop is agreed."""

    SAVE = "save"  # (wait for the save in flight, then) save the agreed step and commit it
    FINISH_IN_FLIGHT = "finish-in-flight"  # commit the interval save in flight; do not start another
    EXIT = "exit"  # leave at once: no save started, a save in flight is abandoned (never restored)


@dataclass(frozen=True)
class PreemptionPlan:
    """One decision over the save on SIGTERM, with what it was decided from."""

    action: PreemptionAction
    reason: str
    budget_s: float
    elapsed_s: float
    estimate_s: float | None
    in_flight: bool

    def to_json(self) -> dict[str, Any]:
        """The plan as a JSON object (what process 0 publishes to the others)."""
        return {**asdict(self), "action": self.action.value}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PreemptionPlan:
        """The plan ``to_json`` wrote."""
        return cls(
            PreemptionAction(d["action"]),
            str(d["reason"]),
            float(d["budget_s"]),
            float(d["elapsed_s"]),
            None if d["estimate_s"] is None else float(d["estimate_s"]),
            bool(d["in_flight"]),
        )


def save_budget(window_s: float) -> float:
    """Seconds a save may take after SIGTERM: the shutdown window minus the exit margin (never negative)."""
    return max(0.0, window_s - EXIT_MARGIN_S)


def preemption_plan(
    *, budget_s: float, elapsed_s: float, estimate_s: float | None, save_in_flight: bool
) -> PreemptionPlan:
    """Whether the agreed step is saved inside the shutdown window, and what happens to a save in flight.

    A save in flight costs (at most) one more save time before the agreed step's save can start, since
    saves are taken one at a time. The remaining budget is ``budget_s - elapsed_s``; a save is counted as
    ``estimate_s * SAVE_SAFETY_FACTOR``.

    With no estimate (a fresh run before its first committed save, or a manifest without
    ``save_seconds``) the save is attempted while any budget is left: there is nothing saved to fall back
    to but the run's start, and a save cut by the kill is never restored (orbax commits a step atomically
    and restore-latest restores only a step with a verified manifest), so trying risks only the exit report.

    Args:
        budget_s: Save budget after SIGTERM (``save_budget(window)``).
        elapsed_s: Seconds since the gang's first SIGTERM.
        estimate_s: Estimated seconds of one save (the newest measured), or None.
        save_in_flight: An interval save has not committed yet.

    Returns:
        The plan, with its one-line reason.
    """
    left = budget_s - elapsed_s

    def plan(action: PreemptionAction, reason: str) -> PreemptionPlan:
        return PreemptionPlan(action, reason, budget_s, elapsed_s, estimate_s, save_in_flight)

    if left <= 0:
        est = "none measured" if estimate_s is None else f"{estimate_s:.2f} s"
        why = f"no budget left ({elapsed_s:.2f} s since SIGTERM of {budget_s:.2f} s; save estimate {est})"
        return plan(PreemptionAction.EXIT, why)
    if estimate_s is None:
        return plan(PreemptionAction.SAVE, f"no save time measured yet: saving with {left:.2f} s left")
    need = estimate_s * SAVE_SAFETY_FACTOR
    if save_in_flight:
        if 2 * need <= left:
            return plan(
                PreemptionAction.SAVE, f"the save in flight and one more fit: 2 x {need:.2f} s <= {left:.2f} s left"
            )
        if need <= left:
            why = f"only the save in flight fits: {need:.2f} s <= {left:.2f} s left < 2 x {need:.2f} s"
            return plan(PreemptionAction.FINISH_IN_FLIGHT, why)
        return plan(PreemptionAction.EXIT, f"not even the save in flight fits: {need:.2f} s > {left:.2f} s left")
    if need <= left:
        return plan(PreemptionAction.SAVE, f"the save fits: {need:.2f} s <= {left:.2f} s left")
    return plan(PreemptionAction.EXIT, f"the save does not fit: {need:.2f} s > {left:.2f} s left")


STUCK_AFTER_SIGTERM_MIN_S = 1.0
"""Shortest wait for a step after SIGTERM before a worker decides its gang cannot step (local steps take ms)."""
STUCK_AFTER_SIGTERM_STEPS = 3
"""Step times to wait: a step that takes three times the last one is not coming (the collective is blocked)."""


def stuck_after_sigterm_s(last_step_seconds: float | None) -> float:
    """Seconds without a completed step after SIGTERM after which the worker leaves without a save (pure).

    Args:
        last_step_seconds: Wall time of the newest step (None before the first one: nothing to save yet).
    """
    return max(STUCK_AFTER_SIGTERM_MIN_S, STUCK_AFTER_SIGTERM_STEPS * (last_step_seconds or 0.0))

"""Which config changes a checkpoint survives: one table of dotted config paths, safe or not, with a reason.

``validate-config`` uses it to accept or refuse a changed config for an existing run, ``restore-latest``
and the trainer use it to decide whether a checkpoint can be restored under the current config.
A path is judged by the most specific rule whose path equals it or is a prefix of it; paths no rule
covers are unsafe.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    """One row of the compatibility table."""

    path: str
    safe: bool
    reason: str


_RESHARD = (
    "the process count and mesh are recorded in the checkpoint; orbax could reshard the arrays, but the "
    "per-host data-iterator state does not carry over and the run is no longer bit-exact: start a new run"
)

RULES: tuple[Rule, ...] = (
    # Identity of the run.
    Rule("run_id", False, "a checkpoint belongs to the run that wrote it"),
    # Where and how it is deployed: nothing in the checkpoint depends on it.
    Rule("namespace", True, "Kubernetes placement only"),
    Rule("image", True, "a new image may fix a bug; the code version is recorded in every checkpoint"),
    Rule("service_account", True, "credentials only"),
    Rule("worker_service_account", True, "credentials only"),
    Rule("storage.root", True, "where the run store lives; checkpoints carry no absolute paths"),
    Rule("storage.durable_mount", True, "a declaration about the volume behind a local root; the data is the same"),
    Rule("slice.spot", True, "capacity type only; the slice shape is unchanged"),
    Rule("slice.reservation", True, "capacity source only; the slice shape is unchanged"),
    Rule("slice.maintenance_window_s", True, "a provisioning policy only"),
    Rule("slice.on_scheduled_maintenance", True, "a provisioning policy only"),
    Rule("slice.worker_cpu", True, "a pod request only; the slice shape is unchanged"),
    Rule("slice.worker_memory_gib", True, "a pod request only; the slice shape is unchanged"),
    Rule("slice.termination_grace_s", True, "a timeout: the pod's SIGTERM-to-SIGKILL grace; the state is the same"),
    Rule("slice.shutdown_window_s", True, "a timeout: the save budget on SIGTERM; the state is the same"),
    Rule("slice.accelerator", False, "another chip changes numerics, memory layout and the device count"),
    Rule("slice.topology", False, _RESHARD),
    Rule("slice.hosts", False, _RESHARD),
    Rule("slice.devices_per_host", False, _RESHARD),
    Rule("slice.local_devices", False, "the CPU or this machine's chips: numerics and the device count change"),
    # What is trained: the state's shapes and meaning.
    Rule("task.name", False, "another task: the saved state belongs to another model and data"),
    Rule(
        "task.options",
        False,
        "the task's options may shape its state; a task declares the options that are safe to change "
        "(TaskSpec.safe_options)",
    ),
    Rule("model", False, "parameter shapes or dtypes change: the saved state does not fit the model"),
    Rule("optimizer", True, "a hyperparameter: the optimizer state keeps its structure (the trajectory changes)"),
    Rule("optimizer.name", False, "another optimizer has another state structure"),
    Rule("data", False, "the saved data position would point into different data"),
    Rule("data.dataset", False, "another dataset: the saved data position means nothing there"),
    Rule("data.dataset_version", False, "another dataset version: the saved data position means nothing there"),
    Rule("data.global_batch_size", False, "the step-to-sample mapping and the learning-rate schedule change"),
    Rule(
        "data.files",
        True,
        "where the record files are; what they hold is checked at restore by their fingerprint, which "
        "data.resume_mode refuses ('exact') or starts a new order over ('reshuffle') when it changed",
    ),
    Rule("data.num_records", False, "epoch boundaries move: the saved data position points elsewhere"),
    Rule("data.seed", False, "another data order: 'exact' resume would continue in a different order"),
    Rule("data.worker_count", False, "the saved grain iterator state is kept per worker process"),
    Rule("data.read_threads", True, "how many threads prepare batches; the order and the saved position are the same"),
    Rule("data.prefetch_batches", True, "how far ahead batches are prepared; the saved position is the next batch"),
    Rule(
        "data.resume_mode",
        True,
        "how the input resumes: 'exact' continues at the saved data position, 'reshuffle' starts a new "
        "order seeded by the restored step; both read the same saved state",
    ),
    # The training loop.
    Rule("training", True, "loop settings that the saved state does not depend on"),
    Rule("training.total_steps", True, "extends or shortens the run; the schedule length is fixed by the optimizer"),
    Rule("training.seed", False, "the RNG key is restored from the checkpoint; another seed would contradict it"),
    Rule(
        "training.sharding",
        True,
        "orbax restores every array into the sharding the current mesh asks for; values are unchanged "
        "(later steps may differ in the last bits: reductions run in another order)",
    ),
    Rule("training.heartbeat_timeout_s", True, "a timeout"),
    Rule("training.init_timeout_s", True, "a timeout"),
    Rule("training.shutdown_timeout_s", True, "a timeout"),
    Rule("training.steps_ahead", True, "how far the host dispatches ahead; the steps and their results are the same"),
    Rule("training.hang_timeout_s", True, "a timeout"),
    Rule("training.compile_grace_s", True, "a timeout"),
    Rule("training.compilation_cache", True, "a cache: compiled programs are rebuilt when absent"),
    Rule("training.compilation_cache_dir", True, "a cache: compiled programs are rebuilt when absent"),
    Rule("training.step_delay_s", True, "pacing of local rehearsals only"),
    # Policies around the state.
    Rule("checkpoint", True, "save policy (interval, retention, async) only; the saved format is the same"),
    Rule("retry", True, "recovery policy only"),
    Rule("monitoring", True, "metrics and alerts only"),
    Rule("supervision", True, "deadlines of the attempt's supervisor only"),
)

_BY_PATH = {r.path: r for r in RULES}

UNKNOWN_RULE = Rule("", False, "no rule covers this field: treated as incompatible")


def task_rules(config: Mapping[str, Any]) -> dict[str, Rule]:
    """The rules the config's task declares for its own options (``TaskSpec.safe_options``).

    An unresolvable task declares none: its options stay under the unsafe ``task.options`` rule.
    """
    from jaxrec.model.tasks import TaskError, resolve_task

    name = (config.get("task") or {}).get("name", "lm")
    try:
        spec = resolve_task(name)
    except TaskError:
        return {}
    return {f"task.options.{k}": Rule(f"task.options.{k}", True, why) for k, why in spec.safe_options.items()}


def rule_for(path: str, extra: Mapping[str, Rule] | None = None) -> Rule:
    """The most specific rule for a dotted config path (unknown paths: an unsafe default).

    Args:
        path: The dotted config path.
        extra: Rules that apply on top of the table (a task's own, from ``task_rules``).
    """
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        rule = (extra or {}).get(key) or _BY_PATH.get(key)
        if rule is not None:
            return rule
    return Rule(path, UNKNOWN_RULE.safe, UNKNOWN_RULE.reason)


class _Missing:
    def __repr__(self) -> str:
        return "<absent>"


MISSING: Any = _Missing()
"""Stands for a field that one side of a difference does not have."""


@dataclass(frozen=True)
class Change:
    """One field that differs between two configs."""

    path: str
    old: Any
    new: Any

    def render(self) -> str:
        """``dotted.path: old -> new``."""
        return f"{self.path}: {_show(self.old)} -> {_show(self.new)}"


@dataclass(frozen=True)
class Problem:
    """A change the checkpoint does not survive."""

    change: Change
    reason: str

    @property
    def path(self) -> str:
        """The dotted config path."""
        return self.change.path

    def render(self) -> str:
        """``dotted.path: old -> new (incompatible: reason)``."""
        return f"{self.change.render()} (incompatible: {self.reason})"


def _show(v: Any) -> str:
    if v is MISSING:
        return "<absent>"
    if isinstance(v, str):
        return repr(v)
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, path + "."))
        else:
            out[path] = v
    return out


def diff_configs(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """Every leaf field that differs between two config trees (canonical dicts), sorted by path.

    Args:
        old: The config the run (or checkpoint) was written with, as ``JobConfig.model_dump(mode="json")``.
        new: The config in use now, in the same form.

    Returns:
        One ``Change`` per differing leaf; a field present on one side only has ``MISSING`` on the other.
    """
    a, b = _flatten(old), _flatten(new)
    changes = []
    for path in sorted(a.keys() | b.keys()):
        va, vb = a.get(path, MISSING), b.get(path, MISSING)
        same = va is not MISSING and vb is not MISSING and va == vb
        if not same or (type(va) is not type(vb) and not _same_number(va, vb)):
            changes.append(Change(path, va, vb))
    return changes


def _same_number(a: Any, b: Any) -> bool:
    numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (a, b))
    return numbers and a == b


def is_safe(change: Change) -> bool:
    """True when a checkpoint survives this change."""
    return rule_for(change.path).safe


def check_compatible(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Problem]:
    """The changes from ``old`` to ``new`` that a checkpoint written under ``old`` does not survive.

    The table's rules apply, plus the safe options the task of ``new`` declares (when both sides
    name the same task; a change of task is refused by ``task.name`` whatever its options).

    Args:
        old: Config the checkpoint (or the run) was written with (canonical dict).
        new: Config in use now (canonical dict).

    Returns:
        One ``Problem`` per unsafe change; empty when the checkpoint can be restored under ``new``.
    """
    extra = task_rules(new)
    judged = ((c, rule_for(c.path, extra)) for c in diff_configs(old, new))
    return [Problem(c, rule.reason) for c, rule in judged if not rule.safe]


def table_markdown() -> str:
    """The compatibility table as Markdown (docs/CHECKPOINTS.md embeds exactly this text)."""
    lines = ["| config path | on change | why |", "|---|---|---|"]
    for r in sorted(RULES, key=lambda r: r.path):
        lines.append(f"| `{r.path}` | {'safe' if r.safe else 'incompatible'} | {r.reason} |")
    lines.append(f"| any other path | incompatible | {UNKNOWN_RULE.reason} |")
    return "\n".join(lines)

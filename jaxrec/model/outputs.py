"""Every step's output parameters, declared once: name, type, description.

Each step's declaration drives the Hera template's output parameters (``workflows.templates``), the step's
writer (``StepOutputs.write``: one file per parameter, as Argo's ``valueFrom.path`` reads them) and every
reader (``StepOutputs.read``: the local runner, the tests). A ``when`` condition compares the values of the
enums in ``jaxrec.model.contract``, never a literal typed twice.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, ClassVar, Self, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from jaxrec.model.contract import (
    AttemptOutcome,
    Decision,
    FailureClass,
    FinalStatus,
    StallKind,
    outcome_check,
)

# train-segment's outcome: the outcomes supervision.json holds (a verdict, or error).
_SegmentOutcome = Annotated[
    AttemptOutcome,
    AfterValidator(outcome_check(AttemptOutcome.SUPERVISION_OUTCOMES, "train-segment's outcome output")),
]


def out(description: str, *, shown: bool = False) -> Any:
    """Declare one output parameter; ``shown`` ones are printed in the local runner's one line per step."""
    return Field(description=description, json_schema_extra={"shown": shown})


def _dashed(name: str) -> str:
    return name.replace("_", "-")


class UndeclaredOutput(ValueError):
    """A reference to an output parameter no step declares (the Workflow's wiring is wrong)."""


class StepOutputs(BaseModel):
    """Base of one step's outputs: field ``restore_step`` is Argo output parameter ``restore-step``."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=_dashed, populate_by_name=True)

    TEMPLATE: ClassVar[str]
    """The Argo template whose outputs these are."""

    @classmethod
    def names(cls) -> list[str]:
        """Output parameter names, in declaration order."""
        return [f.alias or n for n, f in cls.model_fields.items()]

    @classmethod
    def name_of(cls, field: str) -> str:
        """The output parameter name of declared field ``field`` (``next_attempt`` -> ``next-attempt``).

        Raises:
            UndeclaredOutput: ``field`` is not declared (the message lists the declared ones).
        """
        f = cls.model_fields.get(field)
        if f is None:
            raise UndeclaredOutput(
                f"{cls.__name__} ({cls.TEMPLATE}) declares no output {field!r}; declared: {', '.join(cls.model_fields)}"
            )
        return f.alias or field

    @classmethod
    def descriptions(cls) -> dict[str, str]:
        """Output parameter name -> description."""
        return {f.alias or n: f.description or "" for n, f in cls.model_fields.items()}

    @classmethod
    def shown(cls) -> list[str]:
        """Output parameter names worth a place in a one-line summary of the step."""
        return [f.alias or n for n, f in cls.model_fields.items() if (f.json_schema_extra or {}).get("shown")]

    def files(self) -> dict[str, str]:
        """Output parameter name -> the text Argo reads from its file."""
        return {name: _render(value) for name, value in self.model_dump(by_alias=True).items()}

    def write(self, output_dir: Path) -> None:
        """Write one file per output parameter into ``output_dir``."""
        output_dir.mkdir(parents=True, exist_ok=True)
        for name, text in self.files().items():
            (output_dir / name).write_text(text)

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any, info: ValidationInfo) -> Any:
        # An optional output that is unset is an empty file (a ``when`` compares it with ''), never "null".
        optional = type(None) in get_args(cls.model_fields[info.field_name].annotation)
        return None if optional and value == "" else value

    @classmethod
    def parse(cls, values: dict[str, str]) -> Self:
        """The outputs from their texts (as Argo passes them on); raises pydantic's ValidationError."""
        fields = ((f.alias or n, f) for n, f in cls.model_fields.items())
        data = {k: values[k] if _is_text(f.annotation) else json.loads(values[k]) for k, f in fields if k in values}
        return cls.model_validate(data)

    @classmethod
    def read(cls, output_dir: Path) -> Self:
        """The outputs a step wrote into ``output_dir``."""
        return cls.parse({n: (output_dir / n).read_text() for n in cls.names() if (output_dir / n).exists()})


def _is_text(annotation: Any) -> bool:
    args = [a for a in get_args(annotation) if a is not type(None)] if get_args(annotation) else [annotation]
    return len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], str)


def _render(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, sort_keys=True)


class ValidateOutputs(StepOutputs):
    """``validate-config``."""

    TEMPLATE: ClassVar[str] = "validate-config"
    run_id: str = out("The run id the config names.")
    store_root: str = out("The run-store root (absolute for a local root).")
    config_hash: str = out("Hash of the validated config, pinned in the run store.", shown=True)
    hosts: int = out("Hosts (workers) of the slice.")
    first_attempt: int = out("Number of the first attempt of this submission (resubmits continue).")


class RestoreOutputs(StepOutputs):
    """``restore-latest``."""

    TEMPLATE: ClassVar[str] = "restore-latest"
    restore_step: int = out("The checkpoint step every worker restores; -1 for a fresh start.", shown=True)
    restore_path: str = out("The verified step directory (empty for a fresh start).", shown=True)
    skipped: list[dict[str, Any]] = out("Checkpoints not chosen: JSON list of {step, name, reason}.", shown=True)


class ProvisionOutputs(StepOutputs):
    """``provision-slice``."""

    TEMPLATE: ClassVar[str] = "provision-slice"
    jobset_name: str = out("Name of the attempt's JobSet (jobset_name(run id, attempt)).", shown=True)
    coordinator_port: int = out("Port of the JAX coordination service.")
    metrics_port: int = out("First port of the workers' /metrics endpoints (local: one per host).")


class SegmentOutputs(StepOutputs):
    """``train-segment`` (the attempt's supervisor)."""

    TEMPLATE: ClassVar[str] = "train-segment"
    outcome: _SegmentOutcome = out("succeeded, failed or stalled (model.contract.AttemptOutcome).", shown=True)
    stall_kind: StallKind | None = out(
        "capacity, configuration, image-pull, hang, node-lost or refused when stalled; empty otherwise.", shown=True
    )
    reason: str = out("One line: why the attempt is over.", shown=True)
    last_step: int = out("Newest step any worker reported (-1: none).")
    checkpoint_step: int = out("Newest committed checkpoint step after the stop (-1: none).")
    placement: str = out("Where the gang asked to run: the recovery ladder's level and why.", shown=True)
    restarted_in_place: str = out(
        "The gang's restarts in place (level 0), one line: 'attempt 0 (infrastructure: why) -> 1; ...' (empty: none).",
        shown=True,
    )


class ClassifyOutputs(StepOutputs):
    """``classify-failure``."""

    TEMPLATE: ClassVar[str] = "classify-failure"
    failure_class: FailureClass = out("Why the attempt failed (closed vocabulary).", shown=True)
    decision: Decision = out("retry, stop, or hand-over (retry in a continuation Workflow).", shown=True)
    reason: str = out("One line: the verdict's reason (and the decision's, when stopping).", shown=True)
    backoff_seconds: int = out("The retry policy's backoff, in seconds, counted from the attempt's end.", shown=True)
    backoff_wait: str = out("What is left of it when classified: the suspend's duration (e.g. 400ms).")
    attempts_by_class: dict[str, int] = out("Failed attempts so far, by class (JSON).")
    next_attempt: int = out("Number of the next attempt.", shown=True)
    budget_exhausted: bool = out("1 when the run stops because the class spent its budget, else 0.")


class HandOverOutputs(StepOutputs):
    """``hand-over``."""

    TEMPLATE: ClassVar[str] = "hand-over"
    continuation: str = out("Name of the Workflow that continues the run.", shown=True)
    continuation_uid: str = out("Its uid: the run lease's holder from now on.")


class FinalizeOutputs(StepOutputs):
    """``exit-handler`` (finalize)."""

    TEMPLATE: ClassVar[str] = "exit-handler"
    final_status: FinalStatus = out(
        "Succeeded or Failed; HandedOver when a continuation Workflow carries the run on; NotHolder when another "
        "Workflow holds the run.",
        shown=True,
    )
    steps_lost: int = out("Steps recomputed over the run's incidents.")
    recovery_seconds: float = out("Seconds from the last failure to back at its step; -1 if none.")


STEP_OUTPUTS: tuple[type[StepOutputs], ...] = (
    ValidateOutputs,
    RestoreOutputs,
    ProvisionOutputs,
    SegmentOutputs,
    ClassifyOutputs,
    HandOverOutputs,
    FinalizeOutputs,
)
"""Every step that has outputs."""


def outputs_table_markdown() -> str:
    """The step-output table of docs/CONTRACTS.md, generated from the declarations above."""
    rows = ["| template | output | type | meaning |", "|---|---|---|---|"]
    for declared in STEP_OUTPUTS:
        for n, f in declared.model_fields.items():
            kinds = get_args(f.annotation) if isinstance(f.annotation, UnionType) else (f.annotation,)
            kind = " or ".join("empty" if k is type(None) else getattr(k, "__name__", str(k)) for k in kinds)
            rows.append(f"| `{declared.TEMPLATE}` | `{f.alias or n}` | {kind} | {f.description} |")
    return "\n".join(rows)

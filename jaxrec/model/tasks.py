"""Which task a job trains: resolve ``task.name`` to a ``TaskSpec`` and validate its options, without JAX.

A task is named in the config as ``lm`` (the built-in language model) or ``package.module:ATTR``, where
``ATTR`` is a ``TaskSpec``. The module ``package.module`` must import without JAX: it declares the
options model (pydantic) and the task's name and version, and its ``build`` imports the model code only
when the trainer calls it. That keeps ``validate-config`` (and every step program) JAX-free while a bad
task option still gets the same one-line error as any other config field.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

BUILTIN_TASKS: dict[str, str] = {"lm": "trainer.lm_task:TASK"}
"""Short names of the tasks shipped with the trainer, and the spec each stands for."""

_TARGET = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,39}$")


@dataclass(frozen=True)
class TaskSpec:
    """What the harness needs to know about a task before JAX is imported.

    Attributes:
        name: Recorded in every checkpoint manifest; a checkpoint is restored only into the same name.
        version: Bump it whenever the task's state changes structure or meaning (parameter tree, extra
            state, batch layout); a checkpoint of another version is refused.
        options: The pydantic model of ``task.options`` (``extra="forbid"`` recommended).
        build: ``build(options) -> Task`` (see ``trainer.task.Task``); imports JAX and the model lazily.
        safe_options: Option names a checkpoint survives a change of, each with the reason.
    """

    name: str
    version: str
    options: type[BaseModel]
    build: Callable[[Any], Any] = field(repr=False)
    safe_options: Mapping[str, str] = field(default_factory=dict)


class TaskError(ValueError):
    """``task.name`` cannot be resolved, or ``task.options`` are invalid; one line per problem."""


def resolve_task(name: str) -> TaskSpec:
    """The ``TaskSpec`` ``name`` stands for (a built-in short name or ``package.module:ATTR``).

    Raises:
        TaskError: One line naming ``task.name`` and the fix.
    """
    target = BUILTIN_TASKS.get(name, name)
    if not _TARGET.match(target):
        shown = name if len(name) <= 80 else name[:77] + "..."
        raise TaskError(
            f"task.name: {shown!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor "
            "'package.module:ATTR'; name an importable TaskSpec, e.g. examples.image_classifier.task:TASK"
        )
    module_name, attr = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's module: one line
        raise TaskError(
            f"task.name: cannot import {module_name!r} ({type(e).__name__}: {str(e)[:120]}); install the "
            "package that holds it or fix the module path"
        ) from None
    spec = getattr(module, attr, None)
    if not isinstance(spec, TaskSpec):
        raise TaskError(
            f"task.name: {module_name}.{attr} is {'missing' if spec is None else type(spec).__name__}, not a "
            "TaskSpec; point task.name at a TaskSpec (jaxrec.model.tasks.TaskSpec)"
        )
    if not _VERSION.match(spec.version):
        raise TaskError(f"task.name: {target} declares version {spec.version!r}; use 1-40 letters, digits, '.-_'")
    return spec


def validate_options(spec: TaskSpec, options: Mapping[str, Any]) -> BaseModel:
    """``options`` validated by the task's own model.

    Raises:
        TaskError: One line per problem, each naming ``task.options.<field>``.
    """
    try:
        return spec.options.model_validate(dict(options))
    except ValidationError as e:
        lines = []
        for err in e.errors()[:20]:
            loc = ".".join(str(p) for p in ("task", "options", *err["loc"]))
            if err["type"] == "extra_forbidden":
                lines.append(f"{loc}: unknown option; valid options: {', '.join(sorted(spec.options.model_fields))}")
            elif err["type"] == "missing":
                lines.append(f"{loc}: required option is missing")
            else:
                msg = err["msg"].removeprefix("Value error, ")
                got = repr(err.get("input"))
                lines.append(f"{loc}: {msg} (got {got if len(got) <= 60 else got[:57] + '...'})")
        raise TaskError("\n".join(lines)) from None


def options_hash(options: Mapping[str, Any]) -> str:
    """sha256 of the validated options' canonical JSON: what the manifest records."""
    return hashlib.sha256(json.dumps(dict(options), sort_keys=True, separators=(",", ":")).encode()).hexdigest()

"""The built-in task: a small decoder-only language model on generated token sequences (``task.name: lm``).

This module imports without JAX (``validate-config`` resolves it); ``build`` imports the model.
"""

from __future__ import annotations

from typing import Any

from jaxrec.model.config import ModelConfig
from jaxrec.model.tasks import TaskSpec


def _build(options: ModelConfig) -> Any:
    from trainer.model import LanguageModelTask

    return LanguageModelTask(options)


TASK = TaskSpec(name="lm", version="1", options=ModelConfig, build=_build)

"""The image classifier's TaskSpec and options: ``task.name: examples.image_classifier.task:TASK``.

This module imports without JAX (``validate-config`` imports it to check ``task.options``); ``build``
imports the model only when a worker starts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxrec.model.tasks import TaskSpec


class Options(BaseModel):
    """``task.options`` of the image classifier."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image_size: int = Field(default=8, ge=4, le=64, description="Height and width of the generated images.")
    num_classes: int = Field(default=4, ge=2, le=4, description="Classes: a bright blob in one of 4 quadrants.")
    channels: int = Field(default=8, ge=1, le=256, description="Convolution channels.")
    noise: float = Field(default=0.3, ge=0, le=2, description="Standard deviation of the pixel noise.")
    label_smoothing: float = Field(default=0.0, ge=0, lt=1, description="Label smoothing of the loss.")

    @model_validator(mode="after")
    def _check_size(self) -> Options:
        if self.image_size % 2:
            raise ValueError(f"image_size: {self.image_size} is odd; use an even size (the quadrants must be equal)")
        return self


def _build(options: Options) -> Any:
    from examples.image_classifier.model import ImageClassifierTask

    return ImageClassifierTask(options)


TASK = TaskSpec(
    name="image-classifier",
    version="1",
    options=Options,
    build=_build,
    safe_options={"label_smoothing": "a loss setting: the parameters and statistics keep their shapes"},
)

"""A convolutional classifier with batch norm (flax NNX) and the images it trains on, generated from a seed.

The model's parameters are the task's ``params``; its batch-norm running statistics are the task's
``extra`` state, which the harness checkpoints and restores with everything else. NNX modules are
stateful objects, so the task moves between them and plain pytrees with ``nnx.split`` / ``nnx.merge``:
the harness only ever holds pure dicts of arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grain
import jax
import numpy as np
import optax
from flax import nnx

from examples.image_classifier.task import Options
from jaxrec.model.config import DataConfig
from trainer.task import TaskState


class Classifier(nnx.Module):
    """conv 3x3 -> batch norm -> relu -> conv 3x3 -> relu -> global average pool -> linear."""

    def __init__(self, opts: Options, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, opts.channels, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(opts.channels, momentum=0.9, rngs=rngs)
        self.conv2 = nnx.Conv(opts.channels, opts.channels, (3, 3), rngs=rngs)
        self.head = nnx.Linear(opts.channels, opts.num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits (batch, num_classes) of images (batch, H, W, 1)."""
        h = nnx.relu(self.bn(self.conv1(x)))
        h = nnx.relu(self.conv2(h))
        return self.head(h.mean(axis=(1, 2)))


@dataclass(frozen=True)
class QuadrantImages:
    """Example ``i``: a noisy image with a bright square in the quadrant of its label, drawn from ``(seed, i)``."""

    seed: int
    size: int
    num_classes: int
    noise: float

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        """``{"image": float32 (size, size, 1), "label": int32 ()}``."""
        rng = np.random.default_rng([self.seed, int(index)])
        label = int(rng.integers(0, self.num_classes))
        half = self.size // 2
        img = rng.normal(0.0, self.noise, (self.size, self.size)).astype(np.float32)
        r, c = divmod(label, 2)
        img[r * half : (r + 1) * half, c * half : (c + 1) * half] += 1.0
        return {"image": img[..., None], "label": np.asarray(label, np.int32)}


class ImageClassifierTask:
    """The harness's view of the classifier: init, loss (updating the batch statistics), dataset."""

    def __init__(self, opts: Options):
        self.opts = opts
        abstract = nnx.eval_shape(lambda: Classifier(opts, nnx.Rngs(0)))
        self.graphdef, _, _ = nnx.split(abstract, nnx.Param, nnx.BatchStat)

    def _model(self, key: jax.Array) -> Classifier:
        return Classifier(self.opts, nnx.Rngs(params=key))

    def init(self, key: jax.Array) -> TaskState:
        """Parameters from ``key``; the batch-norm statistics as extra state."""
        _, params, stats = nnx.split(self._model(key), nnx.Param, nnx.BatchStat)
        return TaskState(nnx.to_pure_dict(params), nnx.to_pure_dict(stats))

    def _merge(self, params: Any, stats: Any) -> Classifier:
        abstract = nnx.eval_shape(lambda: self._model(jax.random.key(0)))
        _, p, s = nnx.split(abstract, nnx.Param, nnx.BatchStat)
        nnx.replace_by_pure_dict(p, params)
        nnx.replace_by_pure_dict(s, stats)
        return nnx.merge(self.graphdef, p, s)

    def loss(self, params: Any, extra: Any, batch: dict[str, jax.Array], key: jax.Array) -> tuple[jax.Array, Any]:
        """Cross-entropy of the batch (batch statistics in train mode) and the updated running statistics."""
        model = self._merge(params, extra)
        model.train()
        logits = model(batch["image"])
        labels = optax.smooth_labels(jax.nn.one_hot(batch["label"], self.opts.num_classes), self.opts.label_smoothing)
        loss = optax.softmax_cross_entropy(logits, labels).mean()
        _, _, stats = nnx.split(model, nnx.Param, nnx.BatchStat)
        return loss, nnx.to_pure_dict(stats)

    def dataset(self, data: DataConfig) -> grain.MapDataset:
        """``data.num_records`` generated images with their labels."""
        images = QuadrantImages(data.seed, self.opts.image_size, self.opts.num_classes, self.opts.noise)
        return grain.MapDataset.range(data.num_records).map(images)

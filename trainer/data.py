"""The deterministic input pipeline: grain over a task's examples (generated or from record files), by process.

How the processes share each global batch, and the resume modes: docs/TRAINER.md ("Data and resume modes"). The
iterator's position is ``next_index``: batches consumed since the order (``order_seed``) began at ``start_step``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from jaxrec.model.config import DataConfig


@dataclass(frozen=True)
class SyntheticSequences:
    """Record ``i``: ``seq_len + 1`` tokens of an arithmetic progression (mod vocab) drawn from ``(seed, i)``.

    Learnable (the next token follows from the previous two) and reproducible anywhere, no downloads.
    """

    seed: int
    vocab_size: int
    length: int

    def __call__(self, index: int) -> np.ndarray:
        """The token sequence of record ``index`` (int32)."""
        rng = np.random.default_rng([self.seed, int(index)])
        start, stride = rng.integers(0, self.vocab_size, size=2)
        return ((start + stride * np.arange(self.length)) % self.vocab_size).astype(np.int32)


def sequence_dataset(data: DataConfig, vocab_size: int, seq_len: int) -> grain.MapDataset:
    """``data.num_records`` sequences of ``seq_len + 1`` tokens drawn from ``(data.seed, index)``."""
    source = SyntheticSequences(seed=data.seed, vocab_size=vocab_size, length=seq_len + 1)
    return grain.MapDataset.range(data.num_records).map(source)


@dataclass(frozen=True)
class DataPosition:
    """Where the data pipeline stands: the order's seed, the step it began at, batches consumed."""

    order_seed: int
    start_step: int
    next_index: int


def reshuffle_seed(seed: int, step: int) -> int:
    """The order seed of a ``reshuffle`` resume at ``step``: a stable function of (seed, step)."""
    digest = hashlib.sha256(f"{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def resume_position(mode: str, seed: int, restored_step: int, saved: DataPosition | None) -> DataPosition:
    """Decide the data position of a segment that starts at ``restored_step`` (-1: fresh).

    Args:
        mode: ``exact`` (continue the saved order at the saved position) or ``reshuffle`` (a new
            order seeded by the restored step, from its beginning).
        seed: ``data.seed`` of the config.
        restored_step: the step restored (-1 for a fresh start).
        saved: the position stored with the restored checkpoint (None for a fresh start).

    Returns:
        The position to build the pipeline at.
    """
    if restored_step < 0 or saved is None:
        return DataPosition(order_seed=seed, start_step=0, next_index=0)
    if mode == "reshuffle":
        return DataPosition(order_seed=reshuffle_seed(seed, restored_step), start_step=restored_step, next_index=0)
    return saved


def local_batch_size(cfg: DataConfig, process_count: int) -> int:
    """Rows of each global batch this process reads."""
    return cfg.global_batch_size // process_count


@dataclass(frozen=True)
class _Lookup:
    """Index -> example of ``source`` (a picklable callable, for grain worker processes)."""

    source: Any

    def __call__(self, index: int) -> Any:
        return self.source[int(index)]


@dataclass(frozen=True)
class DataSource:
    """A task's examples, one per index, and the dataset version every checkpoint records."""

    examples: grain.MapDataset
    version: str


def open_source(task: Any, data: DataConfig) -> DataSource:
    """The examples training reads: the task's generated ones, or those of ``data.files``.

    The version is ``data.dataset_version`` for generated examples and the fingerprint of the file
    list (names, sizes, checksums or GCS generations) for record files.
    """
    if data.dataset == "records":
        from trainer import records

        assert data.files is not None  # DataConfig requires it
        files = records.list_files(data.files)
        return DataSource(records.record_dataset(files), records.fingerprint(files))
    return DataSource(task.dataset(data), data.dataset_version)


def build_dataset(
    data: DataConfig, source: grain.MapDataset, order_seed: int, process_index: int, process_count: int
) -> grain.MapDataset:
    """The dataset of one process's local batches of ``source``'s examples (stacked along a new axis 0)."""
    ds = grain.MapDataset.range(len(source)).shuffle(seed=order_seed).repeat(None)
    ds = ds[process_index::process_count]
    return ds.map(_Lookup(source)).batch(local_batch_size(data, process_count), drop_remainder=True)


def make_iterator(
    data: DataConfig, source: grain.MapDataset, position: DataPosition, process_index: int, process_count: int
) -> grain.DatasetIterator:
    """A grain iterator over this process's batches, positioned at ``position.next_index``."""
    # Elements here are whole local batches: the read options bound how many steps ahead they are prepared.
    options = grain.ReadOptions(num_threads=data.read_threads, prefetch_buffer_size=data.prefetch_batches)
    ds = build_dataset(data, source, position.order_seed, process_index, process_count)
    it = iter(ds.to_iter_dataset(options))
    if position.next_index:
        it.set_state({"next_index": position.next_index})
    return it

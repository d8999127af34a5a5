"""The deterministic input pipeline: grain over a generated token dataset, sharded by process.

Global batch ``k`` of an order is the slice ``[k*B, (k+1)*B)`` of the shuffled, repeated record
indices; process ``p`` of ``P`` reads every ``P``-th element of it starting at ``p``, so the
processes together read exactly the global batch and none reads another's rows. The order is
fixed by ``order_seed``; the iterator's position is ``next_index`` (batches consumed since the
order began at ``start_step``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import grain
import numpy as np

from recovery_steps.kernel.config import DataConfig, ModelConfig


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


def build_dataset(
    data: DataConfig, model: ModelConfig, order_seed: int, process_index: int, process_count: int
) -> grain.MapDataset:
    """The dataset of one process's local batches (int32, shape (local_batch, seq_len + 1))."""
    source = SyntheticSequences(seed=data.seed, vocab_size=model.vocab_size, length=model.seq_len + 1)
    ds = grain.MapDataset.range(data.num_records).shuffle(seed=order_seed).repeat(None)
    ds = ds[process_index::process_count]
    return ds.map(source).batch(local_batch_size(data, process_count), drop_remainder=True)


def make_iterator(
    data: DataConfig, model: ModelConfig, position: DataPosition, process_index: int, process_count: int
) -> grain.DatasetIterator:
    """A grain iterator over this process's batches, positioned at ``position.next_index``."""
    it = iter(build_dataset(data, model, position.order_seed, process_index, process_count).to_iter_dataset())
    if position.next_index:
        it.set_state({"next_index": position.next_index})
    return it

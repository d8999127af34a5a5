"""Compile the training step from abstract inputs on a thread, while the state is being restored.

The step function has explicit input shardings, so its executable depends only on the shapes, dtypes and
shardings of the state, the batch and the stop flags, never on their values: it can be lowered and compiled
from ``Trainer.abstract_state`` and one batch's shapes while orbax reads the checkpoint (JAX's ahead-of-time
API: ``jit(f).lower(*abstract).compile()``). The restore does not wait for the compilation, nor the
compilation for the restore; the first step waits only for what is left of the compilation.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from jaxrec.model.records import now

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AheadResult:
    """The compiled step (None when compiling ahead failed: the first step compiles it) and its timing."""

    compiled: Any
    started_at: float
    finished_at: float
    error: str | None = None

    @property
    def seconds(self) -> float:
        """Wall-clock seconds the compilation took."""
        return self.finished_at - self.started_at


def overlap_seconds(a_start: float, a_end: float, b_start: float, b_end: float) -> float:
    """Seconds two intervals have in common (pure)."""
    return max(0.0, min(a_end, b_end) - max(a_start, b_start))


def abstract_inputs(tr: Any, local_batch: Any, process_count: int) -> tuple[Any, Any]:
    """The global batch and the stop flags as ``ShapeDtypeStruct``s with the step's input shardings.

    Args:
        tr: The ``Trainer`` (mesh, batch sharding).
        local_batch: One local batch of this process (a pytree of arrays; only shapes and dtypes are read).
        process_count: Processes of the gang (the global batch stacks every process's rows).
    """
    import jax
    import numpy as np

    def one(x: Any) -> jax.ShapeDtypeStruct:
        x = np.asarray(x)
        return jax.ShapeDtypeStruct((x.shape[0] * process_count, *x.shape[1:]), x.dtype, sharding=tr.batch_sharding)

    flags = jax.ShapeDtypeStruct((tr.mesh.size,), np.int32, sharding=tr.batch_sharding)
    return jax.tree.map(one, local_batch), flags


class AheadCompile:
    """Lower and compile ``tr.step_fn`` from abstract inputs on a daemon thread, started at construction."""

    def __init__(self, tr: Any, batch: Any, flags: Any):
        self._tr, self._batch, self._flags = tr, batch, flags
        self._result: AheadResult | None = None
        self._thread = threading.Thread(target=self._run, name="compile-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = now()
        try:
            compiled = self._tr.step_fn.lower(self._tr.abstract_state, self._batch, self._flags).compile()
            self._result = AheadResult(compiled, t0, now())
        except Exception as e:  # noqa: BLE001 - the first step compiles it the usual way instead
            log.warning("compiling the step ahead failed (%s: %s); the first step compiles it", type(e).__name__, e)
            self._result = AheadResult(None, t0, now(), f"{type(e).__name__}: {e}")

    def result(self) -> AheadResult:
        """Wait for the compilation and return it."""
        self._thread.join()
        assert self._result is not None
        return self._result

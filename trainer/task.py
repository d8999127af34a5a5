"""The task interface: what a user supplies so the recovery harness trains their model on their data.

A task is three things — a model's initial state, its loss, and the examples it trains on — plus,
optionally, how its parameters are laid out on the mesh. The harness owns everything else: the
optimizer (from the ``optimizer`` section), the jitted step, the RNG, the data order and position,
checkpoints, restore, stop agreement and exit codes. The config names the task by a ``TaskSpec``
(``jaxrec.model.tasks``), which lives in a module that imports without JAX; its ``build``
returns an object with the methods below.

What recovery guarantees for every task (the one place they are stated):

* **Complete state.** A checkpoint holds the task's params, the optimizer state (with the schedule
  count), the step, the step RNG key, the task's ``extra`` state (for example batch-norm statistics)
  and the data position (per-process grain iterator state plus the order seed and start step).
* **Exact data position.** The harness shuffles, repeats and shards the task's examples by process;
  global batch ``k`` is positions ``[kB, (k+1)B)`` of one seeded order. With ``data.resume_mode:
  exact`` a restored run reads exactly the batches an uninterrupted run would have read.
* **Bit-identical resume.** With the same process count, a run killed and resumed ends with the same
  parameters as an uninterrupted one, provided ``init``, ``loss`` and ``dataset`` are deterministic
  functions of their arguments (no host clocks, no unseeded randomness, no Python-side state).
* **Compatibility.** The manifest records the task's name, version and options hash; a checkpoint is
  restored only into the same task name and version, and only across option changes the task
  declared safe (``TaskSpec.safe_options``). Bump ``TaskSpec.version`` when the state changes shape
  or meaning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    import grain
    import jax
    from jax.sharding import Mesh, PartitionSpec

    from jaxrec.model.config import DataConfig


class TaskState(NamedTuple):
    """What ``Task.init`` returns: the trainable parameters and any other state the task carries.

    Attributes:
        params: The pytree of arrays the optimizer updates.
        extra: State that is not optimized but evolves with training and must survive a restore
            (for example batch-norm running statistics); ``None`` when the task has none.
    """

    params: Any
    extra: Any = None


@runtime_checkable
class Task(Protocol):
    """The methods the harness calls. All of them are traced by ``jax.jit`` except ``dataset``."""

    def init(self, key: jax.Array) -> TaskState:
        """The initial state from a PRNG key (derived from ``training.seed``); must be deterministic."""
        ...

    def loss(self, params: Any, extra: Any, batch: Any, key: jax.Array) -> tuple[jax.Array, Any]:
        """The scalar training loss of ``batch`` and the new ``extra`` state.

        Args:
            params: The parameters (as ``init`` returned them, updated by the optimizer).
            extra: The extra state (``None`` when ``init`` returned none).
            batch: The global batch: ``dataset``'s example structure with a leading batch axis,
                sharded over the mesh's ``data`` axis.
            key: A PRNG key for this step (dropout, augmentation), a function of the step.

        Returns:
            ``(loss, new_extra)``; return ``extra`` unchanged when the task has none.
        """
        ...

    def dataset(self, data: DataConfig) -> grain.MapDataset:
        """The examples the task generates, one per index (``data.dataset: synthetic``).

        Each example is a numpy array or a flat ``dict`` of numpy arrays of fixed shapes. With
        ``data.dataset: records`` the harness reads these same examples back from record files
        (``python -m trainer.write_records`` writes them), so the structure is the same.
        """
        ...


def partition_of(task: Any, path: tuple[Any, ...], leaf: Any, mesh: Mesh) -> PartitionSpec | None:
    """The task's own layout of one parameter, or None to use ``training.sharding``.

    A task may define ``partition(path, leaf, mesh) -> PartitionSpec | None`` for its parameters
    (``path`` is relative to the parameter tree); tasks without it, and the optimizer state, get the
    harness's layout (replicated, or FSDP along the largest dimension the device count divides).
    """
    fn = getattr(task, "partition", None)
    return None if fn is None else fn(path, leaf, mesh)

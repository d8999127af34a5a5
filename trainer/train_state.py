"""Training state on a global mesh: shardings (data parallel, FSDP or the task's), initialisation, the jitted step.

The state is the task's (params and extra) wrapped in what the harness owns: optimizer state, step,
step RNG and the data order. Any task plugs in through ``trainer.task.Task``; nothing here knows the model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrec.model.config import JobConfig
from trainer.decisions import fsdp_axis
from trainer.optim import make_optimizer
from trainer.task import Task, TaskState, partition_of

AXIS = "data"


@dataclass
class Trainer:
    """Everything the loop needs to run steps: mesh, shardings, the model and the compiled functions."""

    mesh: Mesh
    batch_sharding: NamedSharding
    replicated: NamedSharding
    abstract_state: Any
    init_fn: Any
    step_fn: Any


def make_mesh() -> Mesh:
    """A 1-D mesh over every device of every process (the data axis)."""
    return Mesh(np.array(jax.devices()), (AXIS,))


def _spec(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct, mesh: Mesh, fsdp: bool, task: Any) -> NamedSharding:
    # The task lays out its parameters (path relative to them); everything else follows training.sharding.
    own = partition_of(task, path[1:], leaf, mesh) if path and getattr(path[0], "key", None) == "params" else None
    if own is not None:
        return NamedSharding(mesh, own)
    if not fsdp:
        return NamedSharding(mesh, P())
    axis = fsdp_axis(tuple(leaf.shape), mesh.size)
    if axis is None:
        return NamedSharding(mesh, P())
    parts: list[str | None] = [None] * len(leaf.shape)
    parts[axis] = AXIS
    return NamedSharding(mesh, P(*parts))


def build(cfg: JobConfig, mesh: Mesh, task: Task) -> Trainer:
    """Build the optimizer, shardings and jitted init/step of ``task`` for ``cfg`` on ``mesh``."""
    tx = make_optimizer(cfg.optimizer, cfg.training.total_steps)

    def init(seed: jax.Array) -> dict[str, Any]:
        key = jax.random.key(seed)
        init_key, step_key = jax.random.split(key)
        ts = TaskState(*task.init(init_key))
        state = {
            "params": ts.params,
            "opt_state": tx.init(ts.params),
            "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(step_key),
            "data_order_seed": jnp.asarray(cfg.data.seed, jnp.int32),
            "data_start_step": jnp.zeros((), jnp.int32),
        }
        if jax.tree.leaves(ts.extra):  # checkpointed only when the task has some
            state["extra"] = ts.extra
        return state

    # An abstract seed: a concrete jnp.zeros would compile and run an op on this process's own device, a
    # program whose cache key differs per process and that only process 0 writes to the persistent cache.
    abstract = jax.eval_shape(init, jax.ShapeDtypeStruct((), jnp.int32))
    fsdp = cfg.training.sharding == "fsdp"
    shardings = jax.tree_util.tree_map_with_path(lambda path, leaf: _spec(path, leaf, mesh, fsdp, task), abstract)
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(AXIS))

    def step(state: dict[str, Any], batch: Any, stop_flags: jax.Array):
        key = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])

        def loss_fn(params):
            return task.loss(params, state.get("extra"), batch, key)

        (loss, extra), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new_state = {
            **state,
            "params": params,
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "rng": jax.random.key_data(key),
        }
        if "extra" in state:
            new_state["extra"] = extra
        # The stop flags of every process, reduced inside the step: all processes agree on when to stop.
        return new_state, loss, jnp.max(stop_flags)

    init_fn = jax.jit(init, out_shardings=shardings)
    step_fn = jax.jit(
        step,
        in_shardings=(shardings, batch_sharding, batch_sharding),
        out_shardings=(shardings, replicated, replicated),
        donate_argnums=0,
    )
    abstract_with_shardings = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    return Trainer(mesh, batch_sharding, replicated, abstract_with_shardings, init_fn, step_fn)


def global_batch(tr: Trainer, local: Any, process_count: int) -> Any:
    """Assemble the global batch (an array or a pytree of arrays) from each process's local rows."""

    def one(x: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(tr.batch_sharding, x, (x.shape[0] * process_count, *x.shape[1:]))

    return jax.tree.map(one, local)


def stop_flags(tr: Trainer, stop: int) -> jax.Array:
    """One flag per device of the mesh, this process's devices set to its own stop flag (0: no stop)."""
    n_local = len(tr.mesh.local_devices)
    return jax.make_array_from_process_local_data(
        tr.batch_sharding, np.full((n_local,), int(stop), np.int32), (tr.mesh.size,)
    )


def params_digest(params: Any) -> str:
    """sha256 over every parameter's bytes (gathered across processes), in tree order."""
    from jax.experimental import multihost_utils

    full = multihost_utils.process_allgather(params, tiled=True)
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(full):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


def local_state_digest(state: Any) -> str:
    """sha256 over this process's shards of every leaf of ``state`` (path, shard index, bytes), in tree order.

    No gather: each process hashes what it holds, so two runs of one sharding compare their states shard by
    shard, optimizer state included, at the cost of one device-to-host copy of the local shards.
    """
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        h.update(jax.tree_util.keystr(path).encode())
        for shard in sorted(leaf.addressable_shards, key=lambda s: str(s.index)):
            h.update(str(shard.index).encode())
            h.update(np.ascontiguousarray(np.asarray(shard.data)).tobytes())
    return h.hexdigest()

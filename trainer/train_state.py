"""Training state on a global mesh: shardings (data parallel or FSDP), initialisation, the jitted step."""

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

from recovery_steps.kernel.config import JobConfig
from trainer.decisions import fsdp_axis
from trainer.model import DecoderLM, compute_dtype, lm_loss, make_optimizer

AXIS = "data"


@dataclass
class Trainer:
    """Everything the loop needs to run steps: mesh, shardings, the model and the compiled functions."""

    mesh: Mesh
    state_shardings: Any
    batch_sharding: NamedSharding
    replicated: NamedSharding
    abstract_state: Any
    init_fn: Any
    step_fn: Any
    seq_len: int


def make_mesh() -> Mesh:
    """A 1-D mesh over every device of every process (the data axis)."""
    return Mesh(np.array(jax.devices()), (AXIS,))


def _spec(leaf: jax.ShapeDtypeStruct, mesh: Mesh, fsdp: bool) -> NamedSharding:
    if not fsdp:
        return NamedSharding(mesh, P())
    axis = fsdp_axis(tuple(leaf.shape), mesh.size)
    if axis is None:
        return NamedSharding(mesh, P())
    parts: list[str | None] = [None] * len(leaf.shape)
    parts[axis] = AXIS
    return NamedSharding(mesh, P(*parts))


def build(cfg: JobConfig, mesh: Mesh) -> Trainer:
    """Build the model, optimizer, shardings and jitted init/step for ``cfg`` on ``mesh``."""
    platform = jax.devices()[0].platform
    model = DecoderLM(cfg.model, dtype=compute_dtype(cfg.model, platform))
    tx = make_optimizer(cfg.optimizer, cfg.training.total_steps)
    seq = cfg.model.seq_len

    def init(seed: jax.Array) -> dict[str, Any]:
        key = jax.random.key(seed)
        init_key, step_key = jax.random.split(key)
        params = model.init(init_key, jnp.zeros((1, seq), jnp.int32))["params"]
        return {
            "params": params,
            "opt_state": tx.init(params),
            "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.key_data(step_key),
            "data_order_seed": jnp.asarray(cfg.data.seed, jnp.int32),
            "data_start_step": jnp.zeros((), jnp.int32),
        }

    abstract = jax.eval_shape(init, jnp.zeros((), jnp.int32))
    shardings = jax.tree.map(lambda leaf: _spec(leaf, mesh, cfg.training.sharding == "fsdp"), abstract)
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(AXIS))

    def step(state: dict[str, Any], batch: jax.Array, stop_flags: jax.Array):
        def loss_fn(params):
            logits = model.apply({"params": params}, batch[:, :-1])
            return lm_loss(logits, batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        rng = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"]))
        new_state = {**state, "params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": rng}
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
    return Trainer(mesh, shardings, batch_sharding, replicated, abstract_with_shardings, init_fn, step_fn, seq)


def global_batch(tr: Trainer, local: np.ndarray, process_count: int) -> jax.Array:
    """Assemble the global batch from each process's local rows."""
    shape = (local.shape[0] * process_count, *local.shape[1:])
    return jax.make_array_from_process_local_data(tr.batch_sharding, local, shape)


def stop_flags(tr: Trainer, stop: bool) -> jax.Array:
    """One flag per device of the mesh, this process's devices set to its own stop request."""
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

"""The local and peer tiers in the gang: save each host's part often, copy it to peers, restore the closest copy.

How the gang saves, chooses and checks the copies: docs/CHECKPOINTS.md ("Local and peer tiers"). Each process saves
on one background thread (its part, its announcement, then its peers' parts, ring order). Process 0 decides the
restore (``choose_restore``) over what every host lists on its own disk and publishes the plan; every host loads its
part and says whether it could; a copy that failed is marked bad and the gang decides again (each round excludes at
least one copy, so the rounds end). Process 0 writes the attempt's ``tiers.json`` (``TierRecord``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import jax
import numpy as np

from jaxrec.adapters.store import RunLayout, RunStore
from jaxrec.model.config import JobConfig
from jaxrec.model.records import TierPart, TierRecord, TierSkipped, now
from jaxrec.model.tiers import GcsStep, PartCopy, PartSource, Tier, TierPlan, TierSkip, choose_restore
from trainer.local_parts import Layout, LoadedPart, LocalParts, PartProblem, PartServer, Shard, index_key

log = logging.getLogger(__name__)

PEER_WAIT_S = 60.0
"""How long a host waits for a peer's announcement of a part before it leaves that copy out."""
SKIPPED = "skipped"
"""A host's announcement of a step it did not save (its previous save still ran): its peers copy nothing."""
SAVED = "1"
ANNOUNCEMENTS_KEPT = 8
"""A host's newest announcements left in the coordination service; older ones are deleted as new ones come."""


def local_dir(cfg: JobConfig, env: dict[str, str] | os._Environ) -> str:
    """The local directory of this host: ``TRAINER_LOCAL_DIR`` (set per host for the CPU slice) or the config's."""
    return env.get("TRAINER_LOCAL_DIR") or cfg.checkpoint.local.directory


def node_name(env: dict[str, str] | os._Environ) -> str:
    """The node this process runs on (``NODE_NAME`` from the pod's ``spec.nodeName``; else the host name)."""
    return env.get("NODE_NAME") or socket.gethostname()


def host_shards(state: Any) -> list[Shard]:
    """The shards this process holds of every leaf, one per distinct index, as host arrays (blocks on the values)."""
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        seen = set()
        for s in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
            idx = [list(sl.indices(dim))[:2] for sl, dim in zip(s.index, leaf.shape, strict=True)]
            key = index_key(idx)
            if key in seen:
                continue
            seen.add(key)
            data = np.asarray(s.data)
            out.append(Shard(jax.tree_util.keystr(path), idx, data.dtype.name, list(data.shape), data))
    return out


def assemble(part: LoadedPart, abstract_state: Any) -> Any:
    """The state as global arrays in ``abstract_state``'s shardings, from this process's part (PartProblem)."""

    def leaf(path: Any, a: Any) -> jax.Array:
        name = jax.tree_util.keystr(path)
        arrays = []
        for device, index in a.sharding.addressable_devices_indices_map(a.shape).items():
            key = index_key([list(sl.indices(dim))[:2] for sl, dim in zip(index, a.shape, strict=True)])
            s = part.shards.get((name, key))
            if s is None or np.dtype(jax.numpy.dtype(s.dtype)) != np.dtype(a.dtype):
                raise PartProblem(f"part {part.part} of step {part.step} has no shard {key} of {name} in {a.dtype}")
            host = np.frombuffer(s.data, dtype=a.dtype).reshape(s.shape)
            arrays.append(jax.device_put(host, device))
        return jax.make_array_from_single_device_arrays(a.shape, a.sharding, arrays)

    return jax.tree_util.tree_map_with_path(leaf, abstract_state)


@dataclass
class TierRestore:
    """What the gang restored: the plan, and for a local or peer plan this process's state and data position."""

    plan: TierPlan
    state: Any = None
    data_state: dict[str, Any] | None = None
    seconds: float = 0.0


class LocalTier:
    """One process's side of the local and peer tiers for one attempt."""

    def __init__(self, cfg: JobConfig, store: RunStore, attempt: int, kv: Any, env: Any, layout: Layout):
        lt = cfg.checkpoint.local
        self.cfg, self.store, self.attempt, self.kv, self.layout = cfg, store, attempt, kv, layout
        self.interval, self.keep, self.peers = int(lt.interval_steps or 0), lt.keep, lt.peers
        self.pi, self.pc = jax.process_index(), jax.process_count()
        self.parts = LocalParts(local_dir(cfg, env), cfg.run_id, node_name(env))
        self.wait_ms = int(cfg.training.init_timeout_s * 1000)
        self.token = self._token()
        self.server = PartServer(self.parts, self.token, env.get("POD_IP") or "127.0.0.1")
        self.addresses: dict[int, str] = {}
        self.nodes: dict[int, str] = {}
        self._saver = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-saver")
        self._pending: concurrent.futures.Future | None = None
        self.skipped_saves = 0
        self._announced: collections.deque[str] = collections.deque()
        self._announcing = threading.Lock()
        self.on_saved: Callable[[int, str], None] | None = None  # (step, tier) after a part lands

    def _key(self, *parts: Any) -> str:
        return "/".join(["jaxrec/tier", str(self.attempt), *map(str, parts)])

    def _token(self) -> str:
        if self.pi == 0:
            self.kv.key_value_set(self._key("token"), secrets.token_hex(16))
        return self.kv.blocking_key_value_get(self._key("token"), self.wait_ms)

    # --- restore -------------------------------------------------------------------------------------------

    def _scan(self) -> list[PartCopy]:
        copies = []
        for step, part in self.parts.complete():
            try:
                self.parts.check(step, part, self.layout)
                copies.append(PartCopy(step, part, self.parts.node))
            except PartProblem as e:
                copies.append(PartCopy(step, part, self.parts.node, verified=False, problem=str(e)))
        return copies

    def _exchange(self) -> list[PartCopy]:
        """Publish this host's node, server and copies; learn every host's. Returns every copy in the slice."""
        mine = {"node": self.parts.node, "address": self.server.address, "copies": [c.__dict__ for c in self._scan()]}
        self.kv.key_value_set(self._key("host", self.pi), json.dumps(mine))
        copies = []
        for i in range(self.pc):
            got = json.loads(self.kv.blocking_key_value_get(self._key("host", i), self.wait_ms))
            self.nodes[i], self.addresses[i] = got["node"], got["address"]
            copies += [PartCopy(**c) for c in got["copies"]]
        return copies

    def _decide(self, rnd: int, copies: list[PartCopy], gcs_step: int) -> TierPlan:
        if self.pi == 0:
            gcs = [GcsStep(gcs_step)] if gcs_step >= 0 else []
            plan = choose_restore(self.nodes, copies, gcs, max_step=self.cfg.training.total_steps)
            self.kv.key_value_set(self._key("plan", rnd), json.dumps(_plan_json(plan)))
        return _plan_from(json.loads(self.kv.blocking_key_value_get(self._key("plan", rnd), self.wait_ms)))

    def _load_mine(self, plan: TierPlan, abstract_state: Any) -> tuple[Any, LoadedPart]:
        src = next(s for s in plan.sources if s.part == self.pi)
        assert plan.step is not None
        if src.tier is Tier.PEER:
            holder = next(i for i, n in self.nodes.items() if n == src.node)
            n = self.parts.fetch(self.addresses[holder], self.token, plan.step, self.pi, self.layout)
            log.info("part %d of step %d copied from node %s (%d bytes)", self.pi, plan.step, src.node, n)
        loaded = self.parts.load(plan.step, self.pi, self.layout)
        return assemble(loaded, abstract_state), loaded

    def _agree(self, rnd: int, problem: str | None) -> list[str]:
        """Every process's load verdict for round ``rnd``, as process 0 publishes them (empty: all loaded)."""
        self.kv.key_value_set(self._key("loaded", rnd, self.pi), problem or "")
        if self.pi == 0:
            bad = []
            for i in range(self.pc):
                said = self.kv.blocking_key_value_get(self._key("loaded", rnd, i), self.wait_ms)
                if said:
                    bad.append(json.dumps({"part": i, "problem": said}))
            self.kv.key_value_set(self._key("verdict", rnd), json.dumps(bad))
        return json.loads(self.kv.blocking_key_value_get(self._key("verdict", rnd), self.wait_ms))

    def restore(self, gcs_step: int, abstract_state: Any) -> TierRestore:
        """Choose with the gang where the restored step comes from; load this process's part when it is on the slice.

        Args:
            gcs_step: restore-latest's verified step in the bucket (-1: none).
            abstract_state: The state's shapes, dtypes and shardings.

        Returns:
            The plan and, for a local or peer plan, this process's state and data position.
        """
        t0 = now()
        copies = self._exchange()
        refused: list[str] = []
        rnd = 0
        while True:
            plan = self._decide(rnd, copies, gcs_step)
            if plan.step is None or plan.tier is Tier.GCS:
                result = TierRestore(plan, seconds=now() - t0)
                break
            state = loaded = problem = None
            try:
                state, loaded = self._load_mine(plan, abstract_state)
            except PartProblem as e:
                problem = str(e)
                log.warning("part %d of step %d not usable: %s", self.pi, plan.step, problem)
            bad = [json.loads(b) for b in self._agree(rnd, problem)]
            if not bad:
                assert loaded is not None
                result = TierRestore(plan, state, loaded.data_state, now() - t0)
                break
            on = {s.part: s.node for s in plan.sources}
            refused += [f"step {plan.step} part {b['part']} on {on.get(b['part'])}: {b['problem']}" for b in bad]
            marked = _mark_bad(copies, plan, bad)
            # Each round excludes a copy; a problem no copy explains excludes the whole step.
            copies = marked if marked != copies else [c for c in copies if c.step != plan.step]
            rnd += 1
        if self.pi == 0:
            self._record(result, gcs_step, rnd + 1, refused)
        return result

    def _record(self, r: TierRestore, gcs_step: int, rounds: int, refused: list[str]) -> None:
        p = r.plan
        record = TierRecord(
            attempt=self.attempt,
            gcs_step=gcs_step,
            step=p.step if p.step is not None else -1,
            tier=p.tier,
            parts=[TierPart(part=s.part, tier=s.tier, node=s.node) for s in p.sources],
            skipped=[TierSkipped(step=k.step, reason=k.reason) for k in p.skipped],
            note=p.note,
            rounds=rounds,
            refused=refused,
            seconds=r.seconds,
            decided_at=now(),
        )
        self.store.write_record(RunLayout.tier_record(self.attempt), record)
        if p.step is None:
            log.info("no step restorable from any tier: fresh start")
        else:
            tiers = {t.value: n for t, n in p.parts_by_tier.items()}
            log.info("step %d restored from tier %s in %.2f s (parts %s)", p.step, record.tier, r.seconds, tiers)

    # --- save ----------------------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether ``step`` is a local save step."""
        return self.interval > 0 and step > 0 and step % self.interval == 0

    def save(self, step: int, snapshot: Any, data_state: dict[str, Any]) -> bool:
        """Hand ``step``'s on-device copy to the local saver; False (skipped) when the previous one still runs."""
        if self._pending is not None and not self._pending.done():
            self.skipped_saves += 1
            log.warning(
                "local save of step %d skipped: the previous one still runs (%d skipped)", step, self.skipped_saves
            )
            try:
                self._announce(step, SKIPPED)
            except Exception as e:  # noqa: BLE001 - its peers then wait PEER_WAIT_S for this copy, no longer
                log.warning("skip of local step %d not announced: %s", step, e)
            return False
        self._pending = self._saver.submit(self._save, step, snapshot, data_state)
        return True

    def _meta(self) -> dict[str, Any]:
        """The part manifest's layout fields: the whole ``Layout`` but the run, which ``LocalParts`` names."""
        return {k: v for k, v in asdict(self.layout).items() if k != "run_id"} | {"attempt": self.attempt}

    def _save(self, step: int, snapshot: Any, data_state: dict[str, Any]) -> None:
        try:
            self.parts.write(step, self.pi, host_shards(snapshot), data_state, self._meta())
            del snapshot
            self._announce(step, SAVED)
            if self.on_saved:
                self.on_saved(step, Tier.LOCAL.value)
        except Exception as e:  # noqa: BLE001 - a failed local save costs only this copy
            log.warning("local save of step %d failed: %s", step, e)
            return
        for k in range(1, min(self.peers, self.pc - 1) + 1):
            src = (self.pi - k) % self.pc
            try:
                said = self.kv.blocking_key_value_get(self._key("saved", step, src), int(PEER_WAIT_S * 1000))
                if said == SKIPPED:
                    log.info("peer copy of part %d of step %d: its host skipped that save", src, step)
                    continue
                self.parts.fetch(self.addresses[src], self.token, step, src, self.layout)
                if self.on_saved:
                    self.on_saved(step, Tier.PEER.value)
            except Exception as e:  # noqa: BLE001 - the peer copy is missing; restore falls back past it
                log.warning("peer copy of part %d of step %d not taken: %s", src, step, e)
        self.parts.gc(self.keep)

    def _announce(self, step: int, what: str) -> None:
        """Say whether this host saved its part of ``step`` (``SAVED``) or skipped it (``SKIPPED``).

        The training thread announces skips, the saver thread saves; the newest ``ANNOUNCEMENTS_KEPT`` stay.
        """
        key = self._key("saved", step, self.pi)
        self.kv.key_value_set(key, what)
        with self._announcing:
            self._announced.append(key)
            old = [self._announced.popleft() for _ in range(len(self._announced) - ANNOUNCEMENTS_KEPT)]
        for k in old:
            self.kv.key_value_delete(k)


def _plan_json(p: TierPlan) -> dict[str, Any]:
    return {
        "step": p.step,
        "sources": [[s.part, s.tier.value, s.node] for s in p.sources],
        "skipped": [[k.step, k.reason] for k in p.skipped],
        "note": p.note,
    }


def _plan_from(d: dict[str, Any]) -> TierPlan:
    return TierPlan(
        d["step"],
        tuple(PartSource(part, Tier(tier), node) for part, tier, node in d["sources"]),
        tuple(TierSkip(step, reason) for step, reason in d["skipped"]),
        d["note"],
    )


def _mark_bad(copies: list[PartCopy], plan: TierPlan, bad: list[dict[str, Any]]) -> list[PartCopy]:
    """The copies the plan used for the parts in ``bad``, marked unverified with the problem found on load."""
    used = {s.part: s.node for s in plan.sources}
    problems = {(b["part"], used.get(b["part"])): b["problem"] for b in bad}
    out = []
    for c in copies:
        why = problems.get((c.part, c.node)) if c.step == plan.step else None
        out.append(PartCopy(c.step, c.part, c.node, verified=False, problem=why) if why else c)
    return out

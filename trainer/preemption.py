"""The save on SIGTERM, decided once for the gang: process 0 plans, the others read its plan (docs/TRAINER.md).

orbax's save is collective: a process that saves while another exits waits in a barrier until the kill. So process 0
alone plans and publishes the plan in the coordination service's key-value store (orbax's own multihost utilities
use it the same way: ``orbax/checkpoint/_src/multihost/multihost.py``, ``key_value_set`` / ``key_value_dir_get``):
nothing is compiled and no collective runs on the devices.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from trainer.decisions import PreemptionAction, PreemptionPlan, preemption_plan, save_budget

log = logging.getLogger("trainer")

AGREEMENT_MIN_WAIT_S = 0.5
"""Shortest wait for process 0's plan: it is published within milliseconds of the agreed step, so even
with no budget left a follower waits this long rather than leave alone while process 0 might be saving."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def distributed_client() -> Any:
    """The JAX distributed runtime client of this process (None before ``jax.distributed.initialize``)."""
    from jax._src import distributed

    return distributed.global_state.client


class PreemptionAgreement:
    """One plan per agreed stop, made by process 0 and followed by every process.

    Args:
        attempt: The attempt number (names the key, so a later attempt never reads an old plan).
        process_index: This process's index; process 0 plans.
        window_s: The shutdown window the node gives (``SliceConfig.preemption_window_s``).
        client: The key-value store (``distributed_client()``); None for a gang of one process.
    """

    def __init__(self, attempt: int, process_index: int, window_s: float, client: Any):
        self.attempt = attempt
        self.process_index = process_index
        self.budget_s = save_budget(window_s)
        self.client = client

    def key(self, step: int) -> str:
        """The key of the plan for a stop agreed at ``step``."""
        return f"jaxrec/preemption/attempt-{self.attempt}/step-{step}"

    def decide(self, step: int, elapsed_s: float, estimate_s: float | None, save_in_flight: bool) -> PreemptionPlan:
        """The gang's plan for the stop agreed at ``step`` (process 0 decides and publishes; others wait for it).

        A follower waits at most the budget left (at least ``AGREEMENT_MIN_WAIT_S``); without a plan by
        then it leaves without saving, as does process 0 when it cannot publish its plan.
        """

        def leave(why: str) -> PreemptionPlan:
            return PreemptionPlan(PreemptionAction.EXIT, why, self.budget_s, elapsed_s, estimate_s, save_in_flight)

        if self.process_index == 0:
            plan = preemption_plan(
                budget_s=self.budget_s, elapsed_s=elapsed_s, estimate_s=estimate_s, save_in_flight=save_in_flight
            )
            if self.client is not None:
                try:
                    self.client.key_value_set(self.key(step), json.dumps(plan.to_json()))
                except Exception as e:  # noqa: BLE001 - the others cannot hear us: nobody may start a save
                    plan = leave(f"could not publish the plan ({_first_line(e)})")
            log.info("preemption at step %d: %s (%s)", step, plan.action.value, plan.reason)
            return plan
        wait_s = max(self.budget_s - elapsed_s, AGREEMENT_MIN_WAIT_S)
        try:
            raw = self.client.blocking_key_value_get(self.key(step), int(wait_s * 1000))
            plan = PreemptionPlan.from_json(json.loads(raw))
        except Exception as e:  # noqa: BLE001 - no plan: leaving is the one choice that cannot hang the gang
            plan = leave(f"no plan from process 0 within {wait_s:.2f} s ({_first_line(e)})")
        log.info("preemption at step %d: %s, as process 0 decided (%s)", step, plan.action.value, plan.reason)
        return plan


PEER_NOTICE_TIMEOUT_S = 0.25
"""The longest a worker's exit waits to tell the others a peer is gone (a lost service must not hold it)."""


class PeerLossNotice:
    """The first survivor that sees a peer gone tells the others, through the same key-value store.

    When a worker dies, only its ring neighbours see the step's collective fail (within ~0.2 s); the
    others block in the collective until the coordination heartbeat times out, or, after SIGTERM, until
    no step has completed for a while. A neighbour that leaves as peer-lost sets one key per attempt; a
    blocked worker that reads it leaves at once instead. Nothing is read while steps complete.

    Args:
        attempt: The attempt number (names the key; each attempt has its own coordination service anyway).
        process_index: This process's index (named in the notice).
        client: The key-value store (``distributed_client()``); None for a gang of one process.
    """

    def __init__(self, attempt: int, process_index: int, client: Any):
        self.attempt = attempt
        self.process_index = process_index
        self.client = client

    @property
    def key(self) -> str:
        """The attempt's notice key."""
        return f"jaxrec/peer-lost/{self.attempt}"

    def announce(self, reason: str) -> None:
        """Publish that this process saw a peer gone; waits at most ``PEER_NOTICE_TIMEOUT_S``."""
        if self.client is None:
            return
        value = f"process {self.process_index}: {reason}"[:300]

        def publish() -> None:
            try:
                self.client.key_value_set(self.key, value)
            except Exception as e:  # noqa: BLE001 - another process told first, or the service is gone
                log.debug("peer-lost notice not published (%s)", _first_line(e))

        t = threading.Thread(target=publish, name="peer-lost-notice", daemon=True)
        t.start()
        t.join(PEER_NOTICE_TIMEOUT_S)

    def heard(self) -> str | None:
        """The notice another process published for this attempt, or None (never blocks)."""
        if self.client is None:
            return None
        try:
            return self.client.key_value_try_get(self.key)
        except Exception:  # noqa: BLE001 - not set (NOT_FOUND), or the service is gone: nothing heard
            return None

"""The port train-segment's supervisor runs over: one attempt's gang.

The supervisor (``recovery_steps.train_segment.Supervisor``) is written once over this port. Its adapter is
``recovery_steps.kube_gang.KubeGang`` over the Kubernetes API (JobSet, Jobs, pods, nodes), a cluster's or the one the
local runner serves (``workflows.local.controllers``); tests drive the supervisor over their own. Every adapter
answers ``observe`` with one record, ``model.snapshot.ClusterSnapshot`` (house style: one port, as JobSet's
reconciler runs over an injected client and clock).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from jaxrec.model.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class Attachment:
    """The attempt's JobSet as it was found or created."""

    name: str
    created_at: float | None = None
    attempt: str | None = None  # its attempt label (None: the JobSet carries none)


class Gang(Protocol):
    """What the supervisor needs of one attempt's gang: ensure it exists, observe it, stop it."""

    name: str

    def find(self) -> Attachment | None:
        """The attempt's JobSet if it exists now."""

    def create(self, manifest: Mapping[str, Any]) -> Attachment | None:
        """Create the JobSet from ``manifest``; None when one of that name already exists."""

    def start(self) -> None:
        """Begin observing; return once a first view of the gang is there (raise when none comes)."""

    def observe(self) -> ClusterSnapshot:
        """The JobSet, its Jobs, pods and their nodes now (raise when the view cannot be trusted any more)."""

    def wait(self, timeout: float) -> None:
        """Return after a change of the gang, or after ``timeout`` seconds."""

    def delete(self) -> None:
        """Delete the JobSet: its pods get their termination grace; those on a lost node stay Terminating."""

    def force_delete(self, pod: str) -> None:
        """Remove ``pod`` without its kubelet's confirmation (its node is lost)."""

    def close(self) -> None:
        """Stop observing."""

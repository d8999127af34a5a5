"""Which copy of each host's part a restore reads: own disk, a peer's disk, or GCS (a pure decision).

The rules are in docs/CHECKPOINTS.md ("The decision"). They follow two published ones: GKE's checkpoint replicator
takes the newest step for which every part has a copy somewhere in the cluster, each missing file from peers first,
then from the backup (GoogleCloudPlatform/checkpoint-replicator@3a24fd1, src/replicator/coordinator.py ``restore``);
orbax's p2p manager has a host whose directory holds another index's part fetch its own from the host that has it
(google/orbax, checkpoint/orbax/checkpoint/experimental/emergency/p2p, commit 5d9f2276 "Fetch checkpoint when process
index mismatched"). Directories belong to nodes, not to process indices; a copy counts only when it was verified
against the step's manifest, so a local or peer copy is exactly as trustworthy as a GCS one.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class Tier(enum.StrEnum):
    """Where a part is read from, nearest first."""

    LOCAL = "local"
    PEER = "peer"
    GCS = "gcs"


@dataclass(frozen=True)
class PartCopy:
    """One copy of one part of one step in a host-local directory."""

    step: int
    part: int = 0
    node: str = ""
    verified: bool = True
    problem: str = ""


@dataclass(frozen=True)
class GcsStep:
    """One step directory in the run store, verified as a whole (every part's files in its manifest)."""

    step: int
    verified: bool = True
    problem: str = ""


@dataclass(frozen=True)
class PartSource:
    """Where one part of the chosen step is read from (``node`` None for GCS)."""

    part: int
    tier: Tier
    node: str | None = None


@dataclass(frozen=True)
class TierSkip:
    """A step newer than the chosen one, and why it cannot be restored."""

    step: int
    reason: str


@dataclass(frozen=True)
class TierPlan:
    """The decision: the step (None: nothing restorable), one source per part, and the steps skipped."""

    step: int | None
    sources: tuple[PartSource, ...] = ()
    skipped: tuple[TierSkip, ...] = ()
    note: str = ""  # why local copies of the chosen step were not used, when some were not

    @property
    def tier(self) -> Tier | None:
        """GCS when the step is read from the bucket (every part), else the farthest tier a part comes from."""
        tiers = {s.tier for s in self.sources}
        return next((t for t in (Tier.GCS, Tier.PEER, Tier.LOCAL) if t in tiers), None)

    def tier_of(self, part: int) -> Tier | None:
        """The tier part ``part`` is read from."""
        return next((s.tier for s in self.sources if s.part == part), None)

    @property
    def parts_by_tier(self) -> dict[Tier, int]:
        """How many parts each tier serves."""
        out: dict[Tier, int] = {}
        for s in self.sources:
            out[s.tier] = out.get(s.tier, 0) + 1
        return out


def _source(part: int, home: str, copies: list[PartCopy], nodes: frozenset[str], gcs_ok: bool) -> PartSource | None:
    good = sorted({c.node for c in copies if c.verified and c.node in nodes})
    if home in good:
        return PartSource(part, Tier.LOCAL, home)
    if good:
        return PartSource(part, Tier.PEER, good[0])
    return PartSource(part, Tier.GCS) if gcs_ok else None


def _why_missing(part: int, copies: list[PartCopy], nodes: frozenset[str], gcs: GcsStep | None) -> str:
    seen = []
    for c in sorted(copies, key=lambda c: c.node):
        if c.node not in nodes:
            seen.append(f"on node {c.node}, not in this slice")
        elif not c.verified:
            seen.append(f"on node {c.node}: {c.problem or 'not verified'}")
    gcs_line = "not in the bucket" if gcs is None else f"bucket: {gcs.problem or 'not verified'}"
    return f"part {part} ({'; '.join([*seen, gcs_line])})" if seen else f"part {part} (no local copy; {gcs_line})"


def _all_or_gcs(plan: TierPlan) -> TierPlan:
    """One part from GCS means every part from GCS (one collective read); the note names the parts that forced it."""
    from_gcs = [s.part for s in plan.sources if s.tier is Tier.GCS]
    if not from_gcs or len(from_gcs) == len(plan.sources):
        return plan
    parts = ", ".join(map(str, from_gcs))
    note = f"part {parts} of step {plan.step} has no verified copy on the slice: every part is read from GCS"
    return TierPlan(plan.step, tuple(PartSource(s.part, Tier.GCS) for s in plan.sources), plan.skipped, note)


def choose_restore(
    placement: Mapping[int, str],
    copies: Iterable[PartCopy],
    gcs_steps: Iterable[GcsStep],
    *,
    max_step: int | None = None,
) -> TierPlan:
    """The newest step every part of which has a verified copy, and where each part is read from.

    Args:
        placement: For each part (process index) of the new attempt, the node the process runs on now.
        copies: Every local and peer copy found on the nodes (verified or not).
        gcs_steps: Every step directory in the run store (verified or not).
        max_step: Steps beyond it are skipped (``training.total_steps``).

    Returns:
        The plan; ``step`` None when no step is restorable (the caller decides whether that is a fresh start).
    """
    nodes = frozenset(placement.values())
    by_step: dict[int, dict[int, list[PartCopy]]] = defaultdict(lambda: defaultdict(list))
    for c in copies:
        by_step[c.step][c.part].append(c)
    gcs = {g.step: g for g in gcs_steps}
    skipped: list[TierSkip] = []
    for step in sorted(set(by_step) | set(gcs), reverse=True):
        if max_step is not None and step > max_step:
            skipped.append(TierSkip(step, f"beyond training.total_steps ({max_step})"))
            continue
        gcs_ok = step in gcs and gcs[step].verified
        sources, missing = [], []
        for part, home in sorted(placement.items()):
            have = by_step[step][part]
            src = _source(part, home, have, nodes, gcs_ok)
            if src is None:
                missing.append(_why_missing(part, have, nodes, gcs.get(step)))
            else:
                sources.append(src)
        if not missing:
            return _all_or_gcs(TierPlan(step, tuple(sources), tuple(skipped)))
        skipped.append(TierSkip(step, "no verified copy of " + ", ".join(missing)))
    return TierPlan(None, (), tuple(skipped))

"""What failures cost a run: steps lost and recovery time, computed in one place.

The exit handler (``finalize``), the local runner's incident records and metrics, and the report all
count with these functions, so a figure in the Argo UI, on the dashboard and in the report is one figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from recovery_steps.kernel.records import Incident


def steps_lost(pre_failure_step: int, restored_step: int) -> int:
    """Steps computed again after a failure: from the restored step (-1, a fresh start, is step 0) to the last."""
    return max(0, pre_failure_step - max(0, restored_step))


@dataclass(frozen=True)
class RunTotals:
    """The run's recovery figures: what ``jaxrec_steps_lost_total`` and ``jaxrec_recovery_duration_seconds`` say."""

    steps_lost: int
    recovery_seconds: float | None
    incidents: int


def run_totals(incidents: Sequence[Incident]) -> RunTotals:
    """Totals over a run's incidents (pure).

    Args:
        incidents: One per failure; an incident whose steps lost is unknown (no next attempt) is not counted.

    Returns:
        The steps lost summed over the counted incidents, the failure-to-recovered seconds of the newest
        incident that recovered (None when none did), and the number of incidents counted.
    """
    counted = [i for i in incidents if i.steps_lost is not None]
    recovered = [i for i in incidents if i.recovery_seconds is not None]
    newest = max(recovered, key=lambda i: i.attempt) if recovered else None
    return RunTotals(
        steps_lost=sum(i.steps_lost or 0 for i in counted),
        recovery_seconds=newest.recovery_seconds if newest else None,
        incidents=len(counted),
    )

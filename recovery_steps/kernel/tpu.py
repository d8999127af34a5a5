"""One explicit table of TPU types: GKE labels, machine types, chips per VM, valid multi-host topologies.

Hosts are derived from this table, never parsed out of strings elsewhere. Sources: the GKE TPU
documentation ("Plan TPUs in GKE", topology tables per version).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TpuType:
    """Facts about one TPU generation as GKE exposes it."""

    name: str
    gke_accelerator: str
    machine_type: str
    chips_per_vm: int
    single_host_topologies: tuple[str, ...]
    multi_host_topologies: tuple[str, ...]

    def chips(self, topology: str) -> int:
        """Number of chips in ``topology`` (product of its dimensions)."""
        return math.prod(int(d) for d in topology.split("x"))

    def hosts(self, topology: str) -> int:
        """Number of VMs (hosts, one JAX process each) a multi-host ``topology`` spans."""
        return self.chips(topology) // self.chips_per_vm

    @property
    def topologies(self) -> tuple[str, ...]:
        """Every topology GKE accepts for this type."""
        return self.single_host_topologies + self.multi_host_topologies


_3D_MULTI = (
    "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x12", "8x8x16",
    "4x4x16", "8x16x16", "16x16x16",
)  # fmt: skip

TPU_TYPES: dict[str, TpuType] = {
    t.name: t
    for t in (
        TpuType("v4", "tpu-v4-podslice", "ct4p-hightpu-4t", 4, ("2x2x1",), _3D_MULTI),
        TpuType(
            "v5e",
            "tpu-v5-lite-podslice",
            "ct5lp-hightpu-4t",
            4,
            ("1x1", "2x2", "2x4"),
            ("4x4", "4x8", "8x8", "8x16", "16x16"),
        ),
        TpuType("v5p", "tpu-v5p-slice", "ct5p-hightpu-4t", 4, ("2x2x1",), _3D_MULTI),
        TpuType(
            "v6e",
            "tpu-v6e-slice",
            "ct6e-standard-4t",
            4,
            ("1x1", "2x2", "2x4"),
            ("4x4", "4x8", "8x8", "8x16", "16x16"),
        ),
        TpuType("tpu7x", "tpu7x", "tpu7x-standard-4t", 4, ("2x2x1",), _3D_MULTI),
    )
}

LOCAL = "local"
"""Accelerator name of the local backend: CPU processes on this machine stand in for TPU hosts."""

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
    vm_vcpus: int
    vm_memory_gib: int

    @property
    def worker_cpu(self) -> float:
        """Default CPU request of one worker pod: 80% of the VM, leaving room for kubelet and GKE's DaemonSets."""
        return float(int(self.vm_vcpus * 0.8))

    @property
    def worker_memory_gib(self) -> float:
        """Default memory request of one worker pod: 80% of the VM (GKE reserves part of it for the node)."""
        return float(int(self.vm_memory_gib * 0.8))

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


# fmt: skip below: a table of short values, several to a line, reads better than one value a line.
_3D_MULTI = (
    "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x12", "8x8x16",
    "4x4x16", "8x16x16", "16x16x16",
)  # fmt: skip

TPU_TYPES: dict[str, TpuType] = {
    t.name: t
    for t in (
        # vCPUs and memory of each machine type: Compute Engine docs "Accelerator-optimized machine family"
        # and the TPU version pages (ct4p: 240/407 GB, ct5lp: 112/192 GB, ct5p: 208/448 GB, ct6e: 180/720 GB).
        TpuType("v4", "tpu-v4-podslice", "ct4p-hightpu-4t", 4, ("2x2x1",), _3D_MULTI, 240, 407),
        TpuType(
            "v5e",
            "tpu-v5-lite-podslice",
            "ct5lp-hightpu-4t",
            4,
            ("1x1", "2x2", "2x4"),
            ("4x4", "4x8", "8x8", "8x16", "16x16"),
            112,
            192,
        ),
        TpuType("v5p", "tpu-v5p-slice", "ct5p-hightpu-4t", 4, ("2x2x1",), _3D_MULTI, 208, 448),
        TpuType(
            "v6e",
            "tpu-v6e-slice",
            "ct6e-standard-4t",
            4,
            ("1x1", "2x2", "2x4"),
            ("4x4", "4x8", "8x8", "8x16", "16x16"),
            180,
            720,
        ),
        TpuType("tpu7x", "tpu7x", "tpu7x-standard-4t", 4, ("2x2x1",), _3D_MULTI, 224, 960),
    )
}

LOCAL = "local"
"""Accelerator name of the local backend: CPU processes on this machine stand in for TPU hosts."""

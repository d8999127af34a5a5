"""One explicit table of TPU types: GKE labels, machine types, chips per VM, valid topologies.

Single-host topologies are held whole by one VM (a gang of one process); multi-host ones span VMs of one type.

Hosts are derived from this table, never parsed out of strings elsewhere. Sources: the GKE TPU
documentation ("Plan TPUs in GKE", topology tables per version).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    """One TPU VM machine type: its chips, vCPUs and memory."""

    name: str
    chips: int
    vcpus: int
    memory_gib: int

    @property
    def worker_cpu(self) -> float:
        """Default CPU request of one worker pod: 80% of the VM, leaving room for kubelet and GKE's DaemonSets."""
        return float(int(self.vcpus * 0.8))

    @property
    def worker_memory_gib(self) -> float:
        """Default memory request of one worker pod: 80% of the VM (GKE reserves part of it for the node)."""
        return float(int(self.memory_gib * 0.8))


@dataclass(frozen=True)
class TpuType:
    """Facts about one TPU generation as GKE exposes it.

    ``machine`` is the VM of every multi-host slice; ``single_hosts`` names, for each single-host topology, the
    one VM that holds it whole (a gang of one process).
    """

    name: str
    gke_accelerator: str
    machine: Machine
    single_hosts: tuple[tuple[str, Machine], ...]
    multi_host_topologies: tuple[str, ...]

    @property
    def machine_type(self) -> str:
        """The machine type of a multi-host slice's VMs."""
        return self.machine.name

    @property
    def chips_per_vm(self) -> int:
        """Chips of one VM of a multi-host slice."""
        return self.machine.chips

    @property
    def single_host_topologies(self) -> tuple[str, ...]:
        """The topologies one VM holds whole."""
        return tuple(t for t, _ in self.single_hosts)

    def vm(self, topology: str) -> Machine:
        """The VM of each host of ``topology``."""
        return dict(self.single_hosts).get(topology, self.machine)

    def chips(self, topology: str) -> int:
        """Number of chips in ``topology`` (product of its dimensions)."""
        return math.prod(int(d) for d in topology.split("x"))

    def hosts(self, topology: str) -> int:
        """Number of VMs (hosts, one JAX process each) ``topology`` spans: one for a single-host topology."""
        return self.chips(topology) // self.vm(topology).chips

    @property
    def topologies(self) -> tuple[str, ...]:
        """Every topology GKE accepts for this type."""
        return self.single_host_topologies + self.multi_host_topologies


# fmt: skip below: a table of short values, several to a line, reads better than one value a line.
_3D_MULTI = (
    "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x12", "8x8x16",
    "4x4x16", "8x16x16", "16x16x16",
)  # fmt: skip
_2D_MULTI = ("4x4", "4x8", "8x8", "8x16", "16x16")

# vCPUs and memory of each machine type: Compute Engine docs "Accelerator-optimized machine family", GKE docs "Plan
# TPUs in GKE" (its machine type table: chips, vCPUs, memory and topologies per type) and the TPU version pages
# (v5e VMs hold 1, 4 or 8 chips, cloud.google.com/tpu/docs/v5e; ct4p: 240/407 GB, ct5lp-1t/4t/8t: 24/48,
# 112/192, 224/384 GB, ct5p: 208/448 GB, ct6e-1t/4t/8t: 44/176, 180/720, 180/1440 GB, tpu7x: 224/960 GB).
_V4 = Machine("ct4p-hightpu-4t", 4, 240, 407)
_V5E = Machine("ct5lp-hightpu-4t", 4, 112, 192)
_V5P = Machine("ct5p-hightpu-4t", 4, 208, 448)
_V6E = Machine("ct6e-standard-4t", 4, 180, 720)
_TPU7X = Machine("tpu7x-standard-4t", 4, 224, 960)

TPU_TYPES: dict[str, TpuType] = {
    t.name: t
    for t in (
        TpuType("v4", "tpu-v4-podslice", _V4, (("2x2x1", _V4),), _3D_MULTI),
        TpuType(
            "v5e",
            "tpu-v5-lite-podslice",
            _V5E,
            (
                ("1x1", Machine("ct5lp-hightpu-1t", 1, 24, 48)),
                ("2x2", _V5E),
                ("2x4", Machine("ct5lp-hightpu-8t", 8, 224, 384)),
            ),
            _2D_MULTI,
        ),
        TpuType("v5p", "tpu-v5p-slice", _V5P, (("2x2x1", _V5P),), _3D_MULTI),
        TpuType(
            "v6e",
            "tpu-v6e-slice",
            _V6E,
            (
                ("1x1", Machine("ct6e-standard-1t", 1, 44, 176)),
                ("2x2", _V6E),
                ("2x4", Machine("ct6e-standard-8t", 8, 180, 1440)),
            ),
            _2D_MULTI,
        ),
        TpuType("tpu7x", "tpu7x", _TPU7X, (("2x2x1", _TPU7X),), _3D_MULTI),
    )
}

LOCAL = "local"
"""Accelerator name of the CPU slice: CPU processes on one machine stand in for TPU hosts."""

"""Accelerators the planner knows: peak dense bf16 and FP8 FLOP/s, HBM size and bandwidth, links.

Playbook, "Finding the Best Training Configuration" and A3: whether a collective hides behind
compute depends on peak FLOP/s over link bandwidth, so the planner needs both, for the
in-node link (NVLink, per GPU and direction) and the network (per GPU and direction).
"""

from __future__ import annotations

import dataclasses

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s per GPU, one direction, inside a node
    network_bandwidth: float  # bytes/s per GPU, one direction, between nodes
    reserve_bytes: int = 2 * GIB  # runtime, kernels, fragmentation (playbook: "1-2 GB")
    peak_fp8_flops: float = 0.0  # dense FP8 FLOP/s; 0: no FP8 matmul units (FP8 runs at the bf16 rate)
    host_bandwidth: float = 64e9  # bytes/s a GPU to or from host memory, one direction (PCIe Gen5 x16)

    @property
    def usable_bytes(self) -> int:
        return self.hbm_bytes - self.reserve_bytes


GPUS: dict[str, Gpu] = {
    "a100": Gpu("A100 SXM 80GB", 312e12, 80 * GIB, 2.039e12, 300e9, 25e9, host_bandwidth=32e9),  # PCIe Gen4
    "h100": Gpu("H100 SXM", 989e12, 80 * GIB, 3.35e12, 450e9, 50e9, peak_fp8_flops=1979e12),
    "h200": Gpu("H200 SXM", 989e12, 141 * 10**9, 4.8e12, 450e9, 50e9, peak_fp8_flops=1979e12),
    "b200": Gpu("B200", 2250e12, 180 * 10**9, 8.0e12, 900e9, 50e9, peak_fp8_flops=4500e12),
}


def get_gpu(name: str) -> Gpu:
    """The table entry for `name` (case-insensitive); ValueError naming the known GPUs otherwise."""
    key = name.lower().strip()
    if key not in GPUS:
        raise ValueError(f"--gpu={name!r}: unknown GPU; known: {', '.join(sorted(GPUS))}")
    return GPUS[key]

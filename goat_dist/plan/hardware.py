"""GPUs the planner knows: dense bf16 peak, memory, HBM bandwidth and the links between GPUs.

Peaks come from ``observe.peak`` (the same datasheet numbers MFU is measured against during training).
Memory is what ``nvidia-smi`` reports as the device's total (a little under the marketing number).
Bandwidths are per GPU and per direction: NVLink inside a node, the node's InfiniBand/RoCE NICs shared
out per GPU (one 400 Gb/s NDR NIC per GPU on DGX/HGX H100, H200 and B200; 200 Gb/s HDR on DGX A100).
The planner applies ``LINK_EFFICIENCY`` to both: NCCL's measured bus bandwidth is about 80 % of the link.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..observe.peak import table_peak

GIB = 1024**3
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class GPU:
    name: str
    cuda_name: str  # as torch.cuda.get_device_name reports it (the key of observe.peak.PEAK_FLOPS)
    memory_gib: float
    hbm_tb_s: float
    nvlink_gb_s: float  # per GPU, per direction
    network_gb_s: float  # per GPU, per direction, between nodes
    capability: tuple[int, int] = (9, 0)  # CUDA compute capability: which attention kernels it runs

    @property
    def peak_bf16(self) -> float:
        peak = table_peak(self.cuda_name, "bf16")
        assert peak is not None, self.cuda_name
        return peak

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("a100-40gb", "NVIDIA A100-SXM4-40GB", 39.4, 1.555, 300, 25, (8, 0)),
        GPU("a100-80gb", "NVIDIA A100-SXM4-80GB", 79.2, 2.039, 300, 25, (8, 0)),
        GPU("h100-80gb", "NVIDIA H100 80GB HBM3", 79.6, 3.35, 450, 50, (9, 0)),
        GPU("h200", "NVIDIA H200", 139.8, 4.8, 450, 50, (9, 0)),
        GPU("b200", "NVIDIA B200", 178.4, 8.0, 900, 50, (10, 0)),
    )
}


def gpu(name: str) -> GPU:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None
